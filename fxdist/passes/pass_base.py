"""Pass infrastructure: ``PassBase``, ``PassResult`` and ``PassManager``.

A pass is a small frozen dataclass with a kebab-case ``name`` and one method, ``call(gm) -> PassResult``.
Its options are dataclass fields. A pass mutates the GraphModule it is given (through Graph/Node APIs)
or returns a new one; it does not time itself, lint, recompile or log. ``PassManager`` does that once
for every pass: it runs ``lint()`` and ``recompile()`` after each pass, times it, counts the nodes it
added and erased, optionally checks the outputs of each modifying pass against the outputs before
the pipeline (every earlier pass having passed the same check), and records provenance in
``gm.meta["fxdist"]["passes"]``.

``PassManager.run`` never touches the caller's module: it deep-copies it first ("apply to clone"),
runs every pass on the copy and returns the copy in a ``PassResult``. If a pass raises, fails
``lint()`` or changes the outputs, the error propagates with a note naming the pass, and the caller's
module is exactly as it was. (``run(gm, in_place=True)`` skips the copy, for modules that cannot be
deep-copied, and gives up that guarantee.)

Example (a semantics-preserving pass, ``x * 2 -> x + x``):

>>> import operator, torch
>>> from dataclasses import dataclass
>>> from typing import ClassVar
>>> import fxdist as fx
>>> from fxdist.passes.pass_base import PassBase, PassManager, PassResult
>>> @dataclass(frozen=True)
... class MulTwoToAdd(PassBase):
...     '''Rewrite ``x * 2`` as ``x + x``.'''
...     name: ClassVar[str] = "mul-two-to-add"
...
...     def call(self, gm):
...         modified = False
...         for node in gm.graph.find_nodes(op="call_function", target=operator.mul):
...             if node.args[1] == 2:
...                 node.target, node.args = operator.add, (node.args[0], node.args[0])
...                 modified = True
...         return PassResult(gm, modified)
>>> gm = fx.symbolic_trace(lambda x: torch.relu(x * 2))
>>> result = PassManager([MulTwoToAdd()]).run(gm, example_inputs=(torch.randn(3),))
>>> print(result.graph_module.code.strip())
def forward(self, x):
    mul = x + x;  x = None
    relu = torch.relu(mul);  mul = None
    return relu
>>> record = result.graph_module.meta["fxdist"]["passes"][0]
>>> (record["name"], record["nodes_added"], record["nodes_erased"], record["modified"])
('mul-two-to-add', 0, 0, True)
>>> "fxdist" in gm.meta   # the caller's module is untouched
False

Source: torch/fx/passes/infra/pass_base.py and pass_manager.py (PassResult, PassManager);
xDSL's ModulePass (a frozen dataclass with a name).
"""

from __future__ import annotations

import abc
import copy
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
import torch.utils._pytree as pytree

if TYPE_CHECKING:
    from fxdist.graph_module import GraphModule

__all__ = ["PassBase", "PassResult", "PassManager", "PassVerificationError"]

_KEBAB = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


class PassResult(NamedTuple):
    """What a pass returns.

    Attributes:
        graph_module: The transformed module (the one passed in, mutated, or a new one).
        modified: Whether the pass changed anything. ``PassManager`` verifies outputs only for passes
            that report ``True``.
    """

    graph_module: GraphModule
    modified: bool


class PassVerificationError(AssertionError):
    """A pass changed the outputs of the module beyond ``atol``/``rtol``.

    See docs/troubleshooting.md#passverificationerror.
    """


@dataclass(frozen=True)
class PassBase(abc.ABC):
    """Base class of fxdist passes: a frozen dataclass with a kebab-case ``name`` and ``call``.

    Subclasses set ``name: ClassVar[str] = "my-pass"`` (checked when the class is defined) and put
    their options in dataclass fields.

    Raises:
        TypeError: at class definition, if ``name`` is set but is not kebab-case.
    """

    name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name is not None and not (isinstance(name, str) and _KEBAB.match(name)):
            raise TypeError(
                f"{cls.__qualname__}.name must be a kebab-case string such as 'fuse-conv-bn', got {name!r}"
            )

    @abc.abstractmethod
    def call(self, gm: GraphModule) -> PassResult:
        """Run the pass on ``gm`` and return ``PassResult(graph_module, modified)``."""

    def __call__(self, gm: GraphModule) -> PassResult:
        return self.call(gm)


def _pass_name(p: Any) -> str:
    name = getattr(p, "name", None) or getattr(p, "__name__", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"pass {p!r} has no name: set `name: ClassVar[str] = 'my-pass'` on its class")
    return name


def _compare_outputs(expected: Any, actual: Any, atol: float, rtol: float) -> str | None:
    """Return None if ``actual`` matches ``expected`` (same pytree, close tensors), else why not."""
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    act_leaves, act_spec = pytree.tree_flatten(actual)
    if exp_spec != act_spec:
        return f"output structure changed from {exp_spec} to {act_spec}"
    for i, (e, a) in enumerate(zip(exp_leaves, act_leaves)):
        if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor):
            if e.shape != a.shape or e.dtype != a.dtype:
                return f"output leaf {i}: {tuple(e.shape)}/{e.dtype} became {tuple(a.shape)}/{a.dtype}"
            if not (e.is_floating_point() or e.is_complex()):
                if not torch.equal(e, a):
                    return f"output leaf {i}: {e.dtype} values differ"
            elif not torch.allclose(e, a, atol=atol, rtol=rtol, equal_nan=True):
                diff = (e - a).abs().max().item()
                return f"output leaf {i}: max abs difference {diff:.3g} > atol={atol}, rtol={rtol}"
        elif type(e) is not type(a) or (not isinstance(e, torch.Tensor) and e != a):
            return f"output leaf {i}: {e!r} became {a!r}"
    return None


class PassManager:
    """Runs passes in order on a copy of a GraphModule, with lint, recompile, timing and provenance.

    Args:
        passes: ``PassBase`` instances, or any callables ``gm -> PassResult`` with a ``name``
            (or ``__name__``).
        lint: Run ``gm.graph.lint()`` after each pass (default True).
        verify_outputs: Compare the outputs after each modifying pass with the outputs before the
            pipeline. ``None`` (default): verify iff ``example_inputs`` are given to ``run``.
        atol: Absolute tolerance of the output check.
        rtol: Relative tolerance of the output check.

    Provenance: ``run`` appends one dict per pass to ``result.graph_module.meta["fxdist"]["passes"]``:
    ``{"name": str, "ms": float (wall time of ``call`` only), "nodes_added": int,
    "nodes_erased": int, "modified": bool}``. Node counts compare node identity before and after,
    so a pass that returns a new GraphModule counts every node as erased and added.

    Note: output verification calls the module, so a module whose forward mutates state (BatchNorm in
    training mode) should be verified with ``verify_outputs=False`` or put in eval mode first.

    Raises:
        TypeError: an entry of ``passes`` is neither a ``PassBase`` nor a callable.

    Source: torch/fx/passes/infra/pass_manager.py (PassManager).
    """

    def __init__(
        self,
        passes: Sequence[PassBase | Callable[[GraphModule], PassResult]],
        *,
        lint: bool = True,
        verify_outputs: bool | None = None,
        atol: float = 1e-5,
        rtol: float = 1e-5,
    ) -> None:
        self.passes = list(passes)
        for p in self.passes:
            if not callable(p):
                raise TypeError(f"PassManager: {p!r} is not a pass (expected a PassBase or a callable)")
            _pass_name(p)
        self.lint = lint
        self.verify_outputs = verify_outputs
        self.atol = atol
        self.rtol = rtol

    def run(
        self, gm: GraphModule, example_inputs: Sequence[Any] | None = None, *, in_place: bool = False
    ) -> PassResult:
        """Run every pass on a deep copy of ``gm`` and return ``PassResult(copy, any_modified)``.

        Args:
            gm: The module to transform; it is never mutated (unless ``in_place``).
            example_inputs: Positional inputs used to verify outputs (see ``verify_outputs``).
            in_place: Skip the deep copy and transform ``gm`` itself, for modules that cannot be
                deep-copied (e.g. holding RPC handles). A failing pass may then leave ``gm``
                half-transformed; the error note says so.

        Raises:
            ValueError: ``verify_outputs=True`` without ``example_inputs``.
            PassVerificationError: a pass reported ``modified=True`` and changed the outputs.
            Exception: whatever a pass or ``lint()`` raised, with a note naming the pass.
        """
        verify = self.verify_outputs if self.verify_outputs is not None else example_inputs is not None
        if verify and example_inputs is None:
            raise ValueError("PassManager.run: verify_outputs=True needs example_inputs")
        work = gm if in_place else copy.deepcopy(gm)
        records: list[dict[str, Any]] = list(work.meta.get("fxdist", {}).get("passes", []))
        expected = self._call(work, example_inputs) if verify else None
        any_modified = False
        for index, p in enumerate(self.passes):
            name = _pass_name(p)
            try:
                work, record = self._run_one(p, name, work, example_inputs if verify else None, expected)
            except Exception as e:
                e.add_note(
                    f"raised in pass {name!r} ({index + 1} of {len(self.passes)}) run by PassManager; "
                    + ("the module may be partly transformed (in_place=True)" if in_place else "the input module is unchanged")
                )
                raise
            records.append(record)
            any_modified |= record["modified"]
        work.meta.setdefault("fxdist", {})["passes"] = records
        return PassResult(work, any_modified)

    def __call__(self, gm: GraphModule, example_inputs: Sequence[Any] | None = None, **kwargs: Any) -> PassResult:
        """Same as ``run``."""
        return self.run(gm, example_inputs, **kwargs)

    def _run_one(
        self, p: Callable, name: str, gm: GraphModule, inputs: Sequence[Any] | None, expected: Any
    ) -> tuple[GraphModule, dict[str, Any]]:
        before = set(gm.graph.nodes)
        start = time.perf_counter()
        result = p(gm)
        ms = (time.perf_counter() - start) * 1e3
        if not isinstance(result, PassResult):
            raise TypeError(f"pass {name!r} returned {type(result).__name__}, expected PassResult(gm, modified)")
        out = result.graph_module
        if self.lint:
            out.graph.lint()
        out.recompile()
        if inputs is not None and result.modified:
            why = _compare_outputs(expected, self._call(out, inputs), self.atol, self.rtol)
            if why is not None:
                raise PassVerificationError(f"pass {name!r} changed the module's outputs: {why}")
        after = set(out.graph.nodes)
        record = {
            "name": name,
            "ms": ms,
            "nodes_added": len(after - before),
            "nodes_erased": len(before - after),
            "modified": bool(result.modified),
        }
        return out, record

    @staticmethod
    def _call(gm: GraphModule, inputs: Sequence[Any] | None) -> Any:
        with torch.no_grad():
            return gm(*(inputs or ()))
