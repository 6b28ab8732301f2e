"""``make_fx``: capture the ATen operators a function actually runs, as an fxdist GraphModule.

A ``TorchDispatchMode`` sits at the Python dispatch key while the function runs (on real tensors, or
on FakeTensors with ``tracing_mode="fake"``). Every ATen call that reaches it is executed as usual and
recorded as a ``call_function`` node whose target is the ``torch.ops.aten.<op>.<overload>`` OpOverload.
A weak identity map remembers which node produced each tensor, so later calls name their inputs by
node; tensors that no node produced (parameters, buffers, ``torch.tensor`` literals, closed-over
tensors) become ``get_attr`` nodes ``_param_constant{i}`` / ``_tensor_constant{i}`` stored on the
GraphModule, as torch.fx's ``make_fx`` does. Works under ``torch.func.functionalize`` (the mode sees
the unwrapped tensors below the Functionalize key), which gives the functional ATen graphs that
``fxdist.passes.reinplace`` expects.

Example:

>>> import torch
>>> from fxdist.experimental.proxy_tensor import make_fx
>>> def f(x):
...     y = x.clone()
...     y.add_(1)
...     return y.relu()
>>> print(make_fx(torch.func.functionalize(f))(torch.randn(3)).code.strip())
def forward(self, x_1):
    clone = torch.ops.aten.clone.default(x_1);  x_1 = None
    add = torch.ops.aten.add.Tensor(clone, 1);  clone = None
    relu = torch.ops.aten.relu.default(add);  add = None
    return relu

Source: torch/fx/experimental/proxy_tensor.py (make_fx, ProxyTorchDispatchMode, track_tensor_tree).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, autograd_would_have_decomposed
from torch.utils.weak import WeakIdKeyDictionary

from fxdist.graph import Graph
from fxdist.graph_module import GraphModule
from fxdist.node import Node

__all__ = ["make_fx"]

_TRACING_MODES = ("real", "fake")
_aten = torch.ops.aten
# Metadata queries are never decomposed (torch.fx's make_fx has the same exclusion list).
_NEVER_DECOMPOSE = (_aten.size.default, _aten.stride.default, _aten.storage_offset.default)


def _tensor_metadata(t: torch.Tensor) -> Any:
    """``meta["tensor_meta"]`` for one tensor, in the format of fxdist's ShapeProp (TensorMetadata)."""
    from fxdist.passes.shape_prop import extract_tensor_metadata

    return extract_tensor_metadata(t)


class _DispatchTracer(TorchDispatchMode):
    """Records every ATen call that reaches the Python dispatch key into ``graph``.

    Attributes:
        graph: the fxdist Graph being built.
        root: module that receives constant tensors as parameters/buffers.
        fake_mode: FakeTensorMode used for ``meta["val"]`` (and for computing, when ``fake`` is True).
        fake: whether the traced values are FakeTensors (``tracing_mode="fake"``).
        decomposition_table: OpOverload -> Python function run (and traced through) instead of the op.
    """

    def __init__(
        self,
        graph: Graph,
        root: torch.nn.Module,
        fake_mode: FakeTensorMode,
        fake: bool,
        decomposition_table: Mapping[Any, Callable[..., Any]],
    ) -> None:
        super().__init__()
        self.graph = graph
        self.root = root
        self.fake_mode = fake_mode
        self.fake = fake
        self.decomposition_table = decomposition_table
        self.tensor_nodes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.constants: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensors whose value is known
        self._constant_count = {"_param_constant": 0, "_tensor_constant": 0}

    # -- bookkeeping ---------------------------------------------------------------------------
    def fake_of(self, t: torch.Tensor) -> torch.Tensor:
        """The FakeTensor standing for ``t`` in node metadata (``t`` itself in fake mode)."""
        if isinstance(t, FakeTensor):
            return t
        return self.fake_mode.from_tensor(t, static_shapes=True)

    def set_meta(self, node: Node, value: Any) -> None:
        """Set ``meta["val"]`` (FakeTensors for tensors) and, for a tensor, ``meta["tensor_meta"]``."""
        if isinstance(value, torch.Tensor):
            fake = self.fake_of(value)
            node.meta["val"] = fake
            node.meta["tensor_meta"] = _tensor_metadata(fake)
        else:
            node.meta["val"] = pytree.tree_map_only(torch.Tensor, self.fake_of, value)

    def node_of(self, t: torch.Tensor) -> Node:
        """The node that produced ``t``; an untracked tensor becomes a ``get_attr`` constant."""
        node = self.tensor_nodes.get(t)
        if node is None:
            node = self._add_constant(t)
        return node

    def _add_constant(self, t: torch.Tensor) -> Node:
        is_param = isinstance(t, torch.nn.Parameter)
        prefix = "_param_constant" if is_param else "_tensor_constant"
        name = f"{prefix}{self._constant_count[prefix]}"
        self._constant_count[prefix] += 1
        if is_param:
            self.root.register_parameter(name, cast(torch.nn.Parameter, t))
        else:
            self.root.register_buffer(name, t)
        node = self.graph.get_attr(name)
        node.meta["val"] = self.fake_of(t)
        self.tensor_nodes[t] = node
        self.constants[t] = None
        return node

    def track(self, value: Any, node: Node) -> None:
        """Remember that ``node`` produced ``value``; tuple/list outputs get ``getitem`` nodes."""
        if isinstance(value, torch.Tensor):
            self.tensor_nodes[value] = node
            self.set_meta(node, value)
            return
        self.set_meta(node, value)
        if isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                if isinstance(item, (torch.Tensor, tuple, list)):
                    getitem = self.graph.create_node(
                        "call_function", operator.getitem, (node, i), {}, name="getitem"
                    )
                    self.track(item, getitem)

    # -- the dispatch hook ---------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is torch.ops.prim.device.default:  # a metadata query with no graph value
            return func(*args, **kwargs)
        if func in self.decomposition_table:
            with self:
                return self.decomposition_table[func](*args, **kwargs)
        if self._should_decompose(func, (args, kwargs)):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if func is _aten.is_nonzero.default:  # bool(t): read the value through item(), as torch does
            with self:
                return bool((args[0] != 0).item())
        if func is _aten.lift_fresh.default:
            # lift_fresh returns its (constant) input; copy so later in-place ops can't mutate the constant.
            func = _aten.lift_fresh_copy.default
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        all_constant = bool(tensors) and all(t in self.constants or t not in self.tensor_nodes for t in tensors)
        if torch.Tag.data_dependent_output in func.tags:
            if all_constant and not self.fake:
                return func(*args, **kwargs)  # e.g. torch.tensor(3.0).item(): folded, nothing recorded
            raise RuntimeError(
                f"fxdist.make_fx: {func} reads the value of a traced tensor (.item(), bool(tensor) or "
                "data-dependent control flow); a graph cannot capture it. Compute that value outside the "
                "traced function and pass it in as an argument."
            )
        node_args, node_kwargs = pytree.tree_map_only(torch.Tensor, self.node_of, (args, kwargs))
        if self.fake:
            args, kwargs = pytree.tree_map_only(torch.Tensor, self.fake_of, (args, kwargs))
        out = func(*args, **kwargs)
        node = self.graph.create_node(
            "call_function", func, node_args, node_kwargs, name=func.overloadpacket.__name__
        )
        self.track(out, node)
        if all_constant and self._propagates_constant(func, out):
            self.constants[out] = None
        return out

    @staticmethod
    def _propagates_constant(func: Any, out: Any) -> bool:
        """Small results computed only from constants stay constants (torch's CONSTANT_NUMEL_LIMIT = 1)."""
        return (
            isinstance(out, torch.Tensor)
            and out.numel() <= 1
            and torch.Tag.nondeterministic_seeded not in func.tags
        )

    def _should_decompose(self, func: Any, args_kwargs: Any) -> bool:
        """Composite-implicit ops that still reach the Python key (autograd skipped) are traced through."""
        if func in _NEVER_DECOMPOSE or not isinstance(func, torch._ops.OpOverload):
            return False
        return autograd_would_have_decomposed(func, pytree.tree_leaves(args_kwargs))


def _input_names(fn: Callable[..., Any], args: tuple[Any, ...]) -> list[str]:
    """One base name per positional argument: the parameter name, or ``arg{i}`` (modules, *args)."""
    names = [f"arg{i}" for i in range(len(args))]
    if isinstance(fn, torch.nn.Module):
        return names
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return names
    for i, param in enumerate(params[: len(args)]):
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            names[i] = param.name
    return names


def _add_placeholders(tracer: _DispatchTracer, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Create one placeholder per pytree leaf of ``args`` (named ``{arg}_{k}``); return the traced args."""
    traced = []
    for base, arg in zip(_input_names(fn, args), args):
        leaves, spec = pytree.tree_flatten(arg)
        new_leaves = []
        for k, leaf in enumerate(leaves, start=1):
            node = tracer.graph.placeholder(f"{base}_{k}")
            if isinstance(leaf, torch.Tensor):
                if tracer.fake:
                    leaf = tracer.fake_mode.from_tensor(leaf, static_shapes=True)
                tracer.tensor_nodes[leaf] = node
            tracer.set_meta(node, leaf)
            new_leaves.append(leaf)
        traced.append(pytree.tree_unflatten(new_leaves, spec))
    return tuple(traced)


def _output_arg(tracer: _DispatchTracer, result: Any) -> Any:
    """The output node's argument: ``result`` with tensors replaced by their nodes."""

    def convert(value: Any) -> Any:
        if isinstance(value, torch.Size):
            return tuple(int(s) for s in value)
        if isinstance(value, torch.Tensor):
            return tracer.node_of(value)
        return value

    return pytree.tree_map(convert, result, is_leaf=lambda v: isinstance(v, torch.Size))


def _trace(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    tracing_mode: str,
    decomposition_table: Mapping[Any, Callable[..., Any]],
) -> GraphModule:
    graph = Graph()
    root = torch.nn.Module()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    tracer = _DispatchTracer(graph, root, fake_mode, tracing_mode == "fake", decomposition_table)
    traced_args = _add_placeholders(tracer, fn, args)
    # No Python dispatcher here (torch enables it only for symbolic/pre-dispatch tracing): with it,
    # Python-registered composite kernels would change which ops are recorded (batch_norm, ...).
    if tracer.fake:
        with fake_mode, tracer:
            result = fn(*traced_args)
    else:
        with tracer:
            result = fn(*traced_args)
    graph.output(_output_arg(tracer, result))
    name = type(fn).__name__ if isinstance(fn, torch.nn.Module) else getattr(fn, "__name__", "GraphModule")
    return GraphModule(root, graph, name if name.isidentifier() else "GraphModule")


def make_fx(
    f: Callable[..., Any],
    decomposition_table: Mapping[Any, Callable[..., Any]] | None = None,
    tracing_mode: str = "real",
    _allow_non_fake_inputs: bool = False,
    *,
    pre_dispatch: bool = False,
) -> Callable[..., GraphModule]:
    """Return a function that traces ``f`` at the ATen level into an fxdist ``GraphModule``.

    ``make_fx(f)(*args)`` runs ``f(*args)`` once and records the ATen OpOverloads that run, in order.
    Placeholders: one per pytree leaf of ``args``, named ``{param}_{k}`` (``arg{i}_{k}`` for a module),
    so nested inputs are passed flattened to the returned module. Tensors no node produced
    (parameters, buffers, literals) become ``get_attr`` nodes ``_param_constant{i}``/``_tensor_constant{i}``.
    Every node's ``meta["val"]`` is a FakeTensor (or the Python value); tensor nodes also get
    ``meta["tensor_meta"]``. Non-tensor outputs (ints, ``torch.Size``) are baked into the output node.

    Args:
        f: a function or ``nn.Module``; wrap it in ``torch.func.functionalize`` for a functional graph.
        decomposition_table: OpOverload -> Python function; matching ops are traced through that function.
        tracing_mode: ``"real"`` (run on the given tensors) or ``"fake"`` (run on FakeTensors of the
            same shapes; nothing is computed). ``"symbolic"`` is not supported.
        _allow_non_fake_inputs: accepted for signature compatibility; constants are always allowed.
        pre_dispatch: record above autograd; not supported (raises NotImplementedError).

    Returns:
        A callable taking the example inputs and returning the GraphModule.

    Raises:
        ValueError: ``tracing_mode`` is not one of ``"real"``, ``"fake"``.
        NotImplementedError: ``tracing_mode="symbolic"`` or ``pre_dispatch=True``.

    Source: torch/fx/experimental/proxy_tensor.py (make_fx).
    """
    if tracing_mode == "symbolic":
        raise NotImplementedError("fxdist.make_fx: tracing_mode='symbolic' is not supported; use 'real' or 'fake'")
    if tracing_mode not in _TRACING_MODES:
        raise ValueError(f"fxdist.make_fx: unknown tracing_mode {tracing_mode!r}; expected one of {_TRACING_MODES}")
    if pre_dispatch:
        # torch only lets its own mode classes sit on the PreDispatch key (torch._ops._set_mode_pre_dispatch),
        # and ProxyTorchDispatchMode lives in torch.fx, which fxdist must not import.
        raise NotImplementedError(
            "fxdist.make_fx: pre_dispatch=True is not supported (torch admits only its own modes at the "
            "PreDispatch key); trace after autograd with pre_dispatch=False"
        )
    table = dict(decomposition_table or {})

    def wrapped(*args: Any) -> GraphModule:
        return _trace(f, args, tracing_mode, table)

    return wrapped
