"""Code generation for graphs traced with container-valued ``concrete_args`` (pytree inputs).

When ``concrete_args={"x": {"a": PH, "b": PH}}`` makes an argument a container, the tracer creates one
placeholder per leaf (``x_1``, ``x_2``) and traces a flattened function. This CodeGen keeps the
original signature: the generated ``forward(self, x)`` flattens its arguments against the traced
structure (a ``TypeError`` if they differ) and rebuilds the traced output structure on return::

    def forward(self, x):
        x_1, x_2, = _fxdist_flatten_as((x,), _fxdist_in_spec)
        add = x_1 + x_2;  x_1 = x_2 = None
        return _fxdist_unflatten([add], _fxdist_out_spec)

Source: torch/fx/graph.py ``_PyTreeCodeGen`` and torch/fx/_symbolic_trace.py ``create_args_for_root``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils._pytree as pytree

from fxdist.codegen import CodeGen

__all__ = ["PyTreeCodeGen"]


def _flatten_as(values: tuple[Any, ...], spec: pytree.TreeSpec) -> list[Any]:
    """The leaves of ``values``, which must have the structure ``spec``.

    Raises:
        TypeError: the structure differs from the one traced with.
    """
    leaves, got = pytree.tree_flatten(values)
    if got != spec:
        raise TypeError(f"inputs do not have the structure the module was traced with: expected {spec}, "
                        f"got {got}")
    return leaves


class PyTreeCodeGen(CodeGen):
    """A CodeGen whose ``forward`` takes the original (nested) arguments and returns the original
    output structure, around a graph whose placeholders and output are flat.

    Args:
        orig_args: the traced function's parameter names (``self`` first for a module).
        in_spec: the structure of the arguments (including the root module for a method).
        out_spec: the structure of the output; set by the tracer once the output is known.
    """

    def __init__(self, orig_args: list[str], in_spec: pytree.TreeSpec,
                 out_spec: pytree.TreeSpec | None = None) -> None:
        super().__init__()
        self.orig_args = list(orig_args)
        self.in_spec = in_spec
        self.out_spec = out_spec

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str) -> str:
        leaves = [v.split(":")[0].split("=")[0].strip() for v in free_vars]
        if self.orig_args and self.orig_args[0] == "self":
            leaves.insert(0, "self")
        fn_def = super().gen_fn_def(list(self.orig_args), maybe_return_annotation)
        if leaves:
            values = "".join(f"{a}, " for a in self.orig_args)
            fn_def += f"\n    {', '.join(leaves)}, = _fxdist_flatten_as(({values}), _fxdist_in_spec)"
        return fn_def

    def generate_output(self, output_args: Any, *, repr_fn: Callable[[Any], str] = repr) -> str:
        if self.out_spec is None:
            return super().generate_output(output_args, repr_fn=repr_fn)
        return f"return _fxdist_unflatten({repr_fn(output_args)}, _fxdist_out_spec)"

    def process_inputs(self, *inputs: Any) -> Any:
        return pytree.arg_tree_leaves(*inputs)

    def process_outputs(self, outputs: Any) -> Any:
        return outputs if self.out_spec is None else pytree.tree_unflatten(outputs, self.out_spec)

    def additional_globals(self) -> list[tuple[str, Any]]:
        return [("_fxdist_flatten_as", _flatten_as), ("_fxdist_in_spec", self.in_spec),
                ("_fxdist_unflatten", pytree.tree_unflatten), ("_fxdist_out_spec", self.out_spec)]
