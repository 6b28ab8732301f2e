"""Fuse Conv2d with its ReLU and residual add into one oneDNN kernel with a prepacked weight (float inference).

After BatchNorm folding (:class:`~quant.fuse_conv_bn.FuseConvBn`) a ResNet block is ``conv -> relu`` and
``conv -> add(shortcut) -> relu``. Each ReLU and add is a full extra pass over the activation in memory; oneDNN
applies them as post-ops while the conv's output is still in cache, and a weight reordered once into oneDNN's
blocked layout saves a reorder on every call. Rules (``# before -> after``)::

    relu(add(conv(x), y))   -> OneDNNConv2d[add, relu](x, y)     # also add(y, conv(x)); y same shape as conv(x)
    relu(conv(x))           -> OneDNNConv2d[relu](x)
    conv(x)                 -> OneDNNConv2d(x)                   # prepacked weight only
    identity(x)             -> x                                  # nn.Identity modules are dropped first

The fused module calls ``torch.ops.mkldnn._convolution_pointwise`` (the kernels behind Inductor's CPU conv
fusions). It is inference-only (no autograd) and float32 only.

Source: torch.fx paper §6.2.2 (fusion) and torch/fx/experimental/optimization.py (optimize_for_inference:
MKLDNN layout); torch/_inductor/fx_passes/mkldnn_fusion.py (which post-ops oneDNN fuses).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import torch
from torch import nn

from fxdist.passes.pass_base import PassBase, PassResult
from quant.fuse_patterns import is_relu

__all__ = ["OneDNNConv2d", "FuseConvPointwise"]


class OneDNNConv2d(nn.Module):
    """A Conv2d with optional post-ops: ``unary(conv(x) [+ other])``, weight prepacked per input shape.

    Shapes: ``x (B, C_in, H, W)``, ``other`` (binary only) the output's shape ``(B, C_out, H', W')``.
    """

    def __init__(self, conv: nn.Conv2d, *, unary: str = "none", binary: str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(conv.weight.detach(), requires_grad=False)
        self.bias = None if conv.bias is None else nn.Parameter(conv.bias.detach(), requires_grad=False)
        self.padding, self.stride = list(conv.padding), list(conv.stride)
        self.dilation, self.groups = list(conv.dilation), conv.groups
        self.unary, self.binary = unary, binary
        self._packed: dict[tuple[int, ...], torch.Tensor] = {}

    def _weight_for(self, x: torch.Tensor) -> torch.Tensor:
        key = tuple(x.shape)
        packed = self._packed.get(key)
        if packed is None:
            packed = self._packed[key] = torch.ops.mkldnn._reorder_convolution_weight(
                self.weight, self.padding, self.stride, self.dilation, self.groups, list(key)
            )
        return packed

    def forward(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        w = self._weight_for(x)
        if self.binary is None:
            return torch.ops.mkldnn._convolution_pointwise(
                x, w, self.bias, self.padding, self.stride, self.dilation, self.groups, self.unary, [], ""
            )
        unary = None if self.unary == "none" else self.unary
        return torch.ops.mkldnn._convolution_pointwise.binary(
            x, other, w, self.bias, self.padding, self.stride, self.dilation, self.groups, self.binary, None,
            unary, [], "",
        )

    def __getstate__(self) -> dict[str, Any]:  # packed oneDNN tensors cannot be copied or pickled: repack later
        state = self.__dict__.copy()
        state["_packed"] = {}
        return state

    def extra_repr(self) -> str:
        post = [p for p in (self.binary, None if self.unary == "none" else self.unary) if p]
        return f"{tuple(self.weight.shape)}, stride={self.stride}, padding={self.padding}, post_ops={post}"


def _fusable_conv(node: Any, modules: dict[str, nn.Module]) -> bool:
    """Matcher: a single-use call of a plain eval-mode float32 Conv2d with numeric padding."""
    if not hasattr(node, "op") or node.op != "call_module" or len(node.users) != 1:
        return False
    conv = modules.get(node.target)
    return (
        type(conv) is nn.Conv2d and not conv.training and conv.padding_mode == "zeros"
        and not isinstance(conv.padding, str) and conv.weight.dtype == torch.float32
    )


def _shape(node: Any) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta") if hasattr(node, "meta") else None
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def _replace(gm: Any, conv: Any, fused: nn.Module, modules: dict[str, nn.Module]) -> None:
    prefix, _, name = conv.target.rpartition(".")
    setattr(gm.get_submodule(prefix) if prefix else gm, name, fused)
    modules[conv.target] = fused


@dataclass(frozen=True)
class FuseConvPointwise(PassBase):
    """Rewrite Conv2d (+ add) (+ ReLU) chains into :class:`OneDNNConv2d` (see the module docstring's rules).

    Needs the shapes of a run on ``example_inputs`` (recorded with ``fxdist.passes.shape_prop.ShapeProp``) to
    check that a residual operand has exactly the conv output's shape (oneDNN's binary post-op does not
    broadcast). Run :class:`~quant.fuse_conv_bn.FuseConvBn` first. Outputs equal the unfused ones up to float32
    rounding (atol 1e-4 on ResNet-50 logits).
    """

    name: ClassVar[str] = "fuse-conv-pointwise"
    example_inputs: Sequence[Any] = field(default=())
    """Positional inputs for shape recording (required)."""

    def call(self, gm: Any) -> PassResult:
        """Rewrite the Conv2d (+ add) (+ ReLU) chains of ``gm`` in place (see the class docstring).

        Raises:
            ValueError: no ``example_inputs`` were given (the residual shapes cannot be checked).
        """
        if not self.example_inputs:
            raise ValueError("fuse-conv-pointwise needs example_inputs to check residual shapes")
        from fxdist.passes.shape_prop import ShapeProp

        modules = dict(gm.named_modules())
        graph = gm.graph
        before = {n.target for n in graph.nodes if n.op == "call_module"}
        for node in list(graph.nodes):  # identity(x) -> x
            if node.op == "call_module" and type(modules.get(node.target)) is nn.Identity:
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
        with torch.no_grad():
            ShapeProp(gm).propagate(*self.example_inputs)
        count = 0
        for node in list(graph.nodes):
            if node.op == "call_module" and type(modules.get(node.target)) is nn.Conv2d and node.users:
                count += self._fuse_at(gm, node, modules)
        for target in before - {n.target for n in graph.nodes if n.op == "call_module"}:  # orphaned ReLU/Identity
            prefix, _, name = target.rpartition(".")
            delattr(gm.get_submodule(prefix) if prefix else gm, name)
        return PassResult(gm, count > 0)

    def _fuse_at(self, gm: Any, conv: Any, modules: dict[str, nn.Module]) -> bool:
        if not _fusable_conv(conv, modules):
            return False
        graph, mod = gm.graph, cast(nn.Conv2d, modules[conv.target])  # _fusable_conv checked
        user = next(iter(conv.users))
        if is_relu(user, modules):  # relu(conv(x)) -> conv[relu](x)
            _replace(gm, conv, OneDNNConv2d(mod, unary="relu"), modules)
            user.replace_all_uses_with(conv)
            graph.erase_node(user)
            return True
        is_add = user.op == "call_function" and user.target in (operator.add, torch.add) and not user.kwargs
        if is_add and len(user.args) == 2:
            other = user.args[1] if user.args[0] is conv else user.args[0]
            if hasattr(other, "op") and other is not conv and _shape(other) == _shape(conv) is not None:
                relu = next(iter(user.users)) if len(user.users) == 1 else None
                fuse_relu = relu is not None and is_relu(relu, modules)
                # relu(add(conv(x), y)) -> conv[add, relu](x, y)
                _replace(gm, conv, OneDNNConv2d(mod, unary="relu" if fuse_relu else "none", binary="add"), modules)
                conv.args = (conv.args[0], other)
                user.prepend(conv)  # now reads `other`, which may come later in the graph: move it down
                last = relu if fuse_relu and relu is not None else user
                last.replace_all_uses_with(conv)
                if fuse_relu:
                    graph.erase_node(relu)
                graph.erase_node(user)
                return True
        _replace(gm, conv, OneDNNConv2d(mod), modules)  # conv(x) -> conv[prepacked](x)
        return True
