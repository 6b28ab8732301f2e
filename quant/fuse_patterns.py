"""Pattern fusion for quantized kernels: Conv/Linear (+ BatchNorm) + ReLU into ``torch.ao.nn.intrinsic`` modules.

FBGEMM has fused kernels for ``linear+relu``, ``conv+relu`` and ``add+relu``. In float, the fused forms compute
exactly what the unfused graph did; ``quant.convert`` then lowers them to ``nniq.LinearReLU``,
``nniq.ConvReLU{1,2,3}d`` and ``torch.ops.quantized.add_relu``. A preceding BatchNorm is folded first
(:class:`quant.fuse_conv_bn.FuseConvBn`), which covers Conv + BN + ReLU.

Rules (``# before -> after``) are in :data:`quant.rules.FUSION_RULES`.

Source: torch.fx paper §6.2.1; torch/ao/quantization/fuser_method_mappings.py (which pairs FBGEMM fuses).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.ao.nn.intrinsic as nni
import torch.nn.functional as F
from torch import nn

from fxdist.passes.pass_base import PassBase, PassResult

__all__ = ["FuseReluPatterns", "add_relu", "is_relu", "fuse_module_relu", "fuse_add_relu"]

RELU_MODULE_FUSIONS: dict[type, type] = {
    nn.Linear: nni.LinearReLU,
    nn.Conv1d: nni.ConvReLU1d,
    nn.Conv2d: nni.ConvReLU2d,
    nn.Conv3d: nni.ConvReLU3d,
}
"""Float module type -> the intrinsic module that holds it together with its ReLU."""


def add_relu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``relu(a + b)`` as one graph node (the float twin of ``torch.ops.quantized.add_relu``)."""
    return torch.relu(a + b)


def is_relu(node: Any, modules: dict[str, nn.Module]) -> bool:
    """Whether ``node`` is a ReLU: ``nn.ReLU`` module, ``torch.relu``/``F.relu`` call or ``.relu()`` method."""
    if node.op == "call_module":
        return type(modules.get(node.target)) is nn.ReLU
    if node.op == "call_function":
        return node.target in (torch.relu, F.relu)
    return node.op == "call_method" and node.target == "relu"


def _single_input(node: Any) -> Any | None:
    arg = node.args[0] if node.args else None
    return arg if arg is not None and hasattr(arg, "op") and len(arg.users) == 1 else None


def fuse_module_relu(gm: Any, relu: Any, modules: dict[str, nn.Module]) -> bool:
    """Rewrite ``relu(mod(x))`` as ``fused(x)``, ``fused = nni.*ReLU(mod, ReLU())``; False if no match."""
    producer = _single_input(relu)
    if producer is None or producer.op != "call_module":
        return False
    mod = modules.get(producer.target)
    fused_type = RELU_MODULE_FUSIONS.get(type(mod))
    if mod is None or fused_type is None or mod.training:
        return False
    if sum(1 for n in gm.graph.nodes if n.op == "call_module" and n.target == producer.target) != 1:
        return False  # the module is called elsewhere without the ReLU
    fused = fused_type(mod, nn.ReLU()).train(mod.training)  # nni modules start in training mode
    prefix, _, name = producer.target.rpartition(".")
    setattr(gm.get_submodule(prefix) if prefix else gm, name, fused)
    modules[producer.target] = fused
    relu.replace_all_uses_with(producer)
    gm.graph.erase_node(relu)
    return True


def fuse_add_relu(gm: Any, relu: Any) -> bool:
    """Rewrite ``relu(a + b)`` (two float tensors) as ``add_relu(a, b)``; False if no match.

    Needs ``node.meta["quant_float_tensor"]`` on both operands (set by ``quant.prepare``'s value recording).
    """
    add = _single_input(relu)
    if add is None or add.op != "call_function" or add.target not in (operator.add, torch.add) or add.kwargs:
        return False
    if len(add.args) != 2 or not all(hasattr(a, "op") and a.meta.get("quant_float_tensor") for a in add.args):
        return False
    with gm.graph.inserting_before(add):
        fused = gm.graph.call_function(add_relu, tuple(add.args))
    fused.meta.update(relu.meta)
    relu.replace_all_uses_with(fused)
    gm.graph.erase_node(relu)
    gm.graph.erase_node(add)
    return True


@dataclass(frozen=True)
class FuseReluPatterns(PassBase):
    """Fuse ``Conv/Linear -> ReLU`` into ``nni.ConvReLU*/LinearReLU`` and ``relu(a + b)`` into ``add_relu``.

    Run :class:`~quant.fuse_conv_bn.FuseConvBn` first to cover ``Conv -> BN -> ReLU``. Modules in training mode
    and producers with other users are left alone (fusing them would change what those users see).
    Postcondition: same outputs, bit for bit (the fused forms run the same float ops).

    Source: torch/ao/quantization/fx/fuse.py (pattern table), torch.fx paper §6.2.1.
    """

    name: ClassVar[str] = "fuse-relu-patterns"

    def call(self, gm: Any) -> PassResult:
        modules = dict(gm.named_modules())
        modified = False
        for node in list(gm.graph.nodes):
            if is_relu(node, modules):
                modified |= fuse_module_relu(gm, node, modules) or fuse_add_relu(gm, node)
        return PassResult(gm, modified)
