"""Code generation for graphs traced with container-valued ``concrete_args`` (pytree inputs).

When ``concrete_args={"x": {"a": PH, "b": PH}}`` makes an argument a container, the tracer creates one
placeholder per leaf (``x_1``, ``x_2``) and traces a flattened function. This CodeGen keeps the
original signature: the generated ``forward(self, x)`` flattens its arguments against the traced
structure and rebuilds the traced output structure on return, in the text torch.fx prints::

    def forward(self, x):
        x_1, x_2, = fx_pytree.tree_flatten_spec([x], self._in_spec)
        add = x_1 + x_2;  x_1 = x_2 = None
        return pytree.tree_unflatten([add], self._out_spec)

``fx_pytree`` is :mod:`fxdist._pytree` (its ``tree_flatten_spec``, with the registry of container types),
``pytree`` is ``torch.utils._pytree``, and the
GraphModule keeps the specs as ``_in_spec``/``_out_spec`` (set by ``recompile``). Because containers are
taken apart by indexing (``x["a"]``), the generated ``forward`` can itself be traced again: a Proxy
argument gives ``getitem`` nodes.

Source: torch/fx/graph.py ``_PyTreeCodeGen``, torch/fx/_pytree.py ``tree_flatten_spec`` and
torch/fx/_symbolic_trace.py ``create_args_for_root``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils._pytree as pytree

from fxdist import _pytree as fx_pytree
from fxdist.codegen import CodeGen

__all__ = ["PyTreeCodeGen"]

class PyTreeCodeGen(CodeGen):
    """A CodeGen whose ``forward`` takes the original (nested) arguments and returns the original
    output structure, around a graph whose placeholders and output are flat.

    Args:
        orig_args: the traced function's parameter names (``self`` first for a module).
        in_spec: the structure of the arguments (including the root module for a method).
        out_spec: the structure of the output; set by the tracer once the output is known.
        args_kwargs: ``in_spec`` describes ``(args, kwargs)`` (``torch.export``'s convention: the
            first ``in_spec.child(0).num_children`` names are positional, the rest keyword arguments).
    """

    def __init__(self, orig_args: list[str], in_spec: pytree.TreeSpec,
                 out_spec: pytree.TreeSpec | None = None, *, args_kwargs: bool = False) -> None:
        super().__init__()
        self.orig_args = list(orig_args)
        self.in_spec = in_spec
        self.out_spec = out_spec
        self.args_kwargs = args_kwargs

    # override: torch.fx's PyTreeCodeGen signatures; CodeGen passes an override only the keywords it takes
    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str) -> str:  # type: ignore[override]
        leaves = [v.split(":")[0].split("=")[0].strip() for v in free_vars]
        if self.orig_args and self.orig_args[0] == "self":
            leaves.insert(0, "self")
        fn_def = super().gen_fn_def(list(self.orig_args), maybe_return_annotation)
        if leaves:
            fn_def += f"\n    {', '.join(leaves)}, = fx_pytree.tree_flatten_spec({self._flattened()}, self._in_spec)"
        return fn_def

    def _flattened(self) -> str:
        """The text of the value ``in_spec`` describes: ``[a, b]``, or ``([a], {'b':b})`` for (args, kwargs)."""
        if not self.args_kwargs:
            return f"[{', '.join(self.orig_args)}]"
        count = self.in_spec.child(0).num_children
        keywords = ", ".join(f"'{key}':{name}" for key, name in zip(self.in_spec.child(1).context,
                                                                     self.orig_args[count:]))
        return f"([{', '.join(self.orig_args[:count])}], {{{keywords}}})"

    def generate_output(  # type: ignore[override]
        self, output_args: Any, *, repr_fn: Callable[[Any], str] = repr
    ) -> str:
        if self.out_spec is None:
            return super().generate_output(output_args, repr_fn=repr_fn)
        return f"return pytree.tree_unflatten({repr_fn(output_args)}, self._out_spec)"

    def process_inputs(self, *inputs: Any) -> Any:
        return pytree.arg_tree_leaves(*inputs)

    def process_outputs(self, outputs: Any) -> Any:
        return outputs if self.out_spec is None else pytree.tree_unflatten(outputs, self.out_spec)

    def additional_globals(self) -> list[tuple[str, Any]]:
        return [("fx_pytree", fx_pytree), ("pytree", pytree)]
