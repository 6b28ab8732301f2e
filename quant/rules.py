"""What each op becomes under FBGEMM post-training quantization, and the local rewrites that lower it.

Three tables classify float ops (used by ``quant.prepare`` to decide where observers go):

* *compute* ops get their own output observer and lower to a quantized kernel
  (:data:`QUANTIZED_MODULES`, :data:`QUANTIZED_FUNCTIONS`);
* *same-scale* ops (ReLU, pooling, views, dropout) run on int8 directly and keep their input's scale and
  zero point, so they need no observer (:data:`SAME_SCALE_MODULES`, ``_FUNCTIONS``, ``_METHODS``);
* *weight-only* modules (embedding bags) quantize their weight row-wise and return float
  (:data:`WEIGHT_ONLY_MODULES`);

everything else stays in float. ``quant.convert`` first turns every observer into a
``quantize_per_tensor -> dequantize`` pair (the "reference" form: the program is still float), then applies
:data:`RULES` until none fires. Each rule is one local rewrite, documented as ``# before -> after``
(``q`` = ``quantize_per_tensor(-, scale, zero_point, dtype)``, ``dq`` = ``.dequantize()``).

Source: torch.fx paper §6.2.1; torch/ao/quantization/fx (pattern tables); tinygrad's rule tables (``PatternMatcher``).
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.ao.nn.intrinsic as nni
import torch.ao.nn.intrinsic.quantized as nniq
import torch.ao.nn.quantized as nnq
import torch.nn.functional as F
from torch import nn

from quant.fuse_patterns import add_relu

__all__ = [
    "QUANTIZED_MODULES", "QUANTIZED_FUNCTIONS", "SAME_SCALE_MODULES", "SAME_SCALE_FUNCTIONS", "SAME_SCALE_METHODS",
    "WEIGHT_ONLY_MODULES", "RULES", "Rule", "classify", "is_quantize", "is_dequantize", "qparams_of",
]

# values: quantized module classes, built with .from_float (torch's stubs give them no common base)
QUANTIZED_MODULES: dict[type[nn.Module], Any] = {
    nn.Linear: nnq.Linear,
    nn.Conv1d: nnq.Conv1d,
    nn.Conv2d: nnq.Conv2d,
    nn.Conv3d: nnq.Conv3d,
    nn.ConvTranspose1d: nnq.ConvTranspose1d,
    nn.ConvTranspose2d: nnq.ConvTranspose2d,
    nn.BatchNorm2d: nnq.BatchNorm2d,
    nn.BatchNorm3d: nnq.BatchNorm3d,
    nn.Hardswish: nnq.Hardswish,
    nni.LinearReLU: nniq.LinearReLU,
    nni.ConvReLU1d: nniq.ConvReLU1d,
    nni.ConvReLU2d: nniq.ConvReLU2d,
    nni.ConvReLU3d: nniq.ConvReLU3d,
}
"""Float module -> quantized module (built with its ``from_float``; FBGEMM packs the weight)."""

QUANTIZED_FUNCTIONS: dict[Callable, Callable] = {
    operator.add: torch.ops.quantized.add,
    torch.add: torch.ops.quantized.add,
    add_relu: torch.ops.quantized.add_relu,
    operator.mul: torch.ops.quantized.mul,
    torch.mul: torch.ops.quantized.mul,
    torch.cat: torch.ops.quantized.cat,
}
"""Float function -> quantized op taking the output ``scale, zero_point`` (``cat`` requantizes its inputs to
the output's shared scale)."""

SAME_SCALE_MODULES: tuple[type, ...] = (
    nn.ReLU, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.Dropout, nn.Identity, nn.Flatten,
)
SAME_SCALE_FUNCTIONS: frozenset[Callable] = frozenset({
    torch.relu, F.relu, torch.flatten, torch.reshape, torch.transpose, torch.squeeze, torch.unsqueeze,
    F.max_pool1d, F.max_pool2d, F.adaptive_avg_pool2d, F.dropout, operator.getitem,
})
SAME_SCALE_METHODS: frozenset[str] = frozenset({
    "relu", "flatten", "view", "reshape", "transpose", "permute", "squeeze", "unsqueeze", "contiguous",
})

WEIGHT_ONLY_MODULES: dict[type[nn.Module], Any] = {nn.EmbeddingBag: nnq.EmbeddingBag, nn.Embedding: nnq.Embedding}
"""Float module -> 8-bit row-wise quantized module (``float_qparams_weight_only_qconfig``; FBGEMM kernels)."""


def _tensor_inputs(node: Any) -> list[Any]:
    """The node's float-tensor operands, in order (list arguments such as ``cat``'s are flattened)."""
    out: list[Any] = []

    def visit(a: Any) -> None:
        if hasattr(a, "op"):
            if a.meta.get("quant_float_tensor"):
                out.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)

    for a in (*node.args, *node.kwargs.values()):
        visit(a)
    return out


def _has_node(value: Any) -> bool:
    if hasattr(value, "op"):
        return True
    if isinstance(value, (list, tuple)):
        return any(_has_node(v) for v in value)
    if isinstance(value, slice):
        return any(_has_node(v) for v in (value.start, value.stop, value.step))
    return False


def classify(node: Any, modules: dict[str, nn.Module]) -> str:
    """``"compute"``, ``"same_scale"``, ``"weight_only"`` or ``"float"`` for a node of a value-recorded graph."""
    if node.op == "call_module":
        mod = type(modules.get(node.target))
        if mod in QUANTIZED_MODULES:
            return "compute"
        if mod in WEIGHT_ONLY_MODULES:
            return "weight_only"
        return "same_scale" if mod in SAME_SCALE_MODULES and len(_tensor_inputs(node)) == 1 else "float"
    if not node.meta.get("quant_float_tensor"):
        return "float"
    if node.op == "call_function" and node.target in QUANTIZED_FUNCTIONS:
        n_in = len(_tensor_inputs(node))
        if node.target is torch.cat:
            return "compute" if n_in == len(node.args[0]) and n_in > 0 else "float"
        return "compute" if n_in == 2 and not node.kwargs else "float"
    if node.target is operator.getitem and _has_node(node.args[1:]):
        return "float"  # indexing with tensors: keep it in float
    same = (node.op == "call_function" and node.target in SAME_SCALE_FUNCTIONS) or (
        node.op == "call_method" and node.target in SAME_SCALE_METHODS
    )
    return "same_scale" if same and len(_tensor_inputs(node)) == 1 else "float"


# ----------------------------------------------------------------------------------------------- matchers
def is_quantize(node: Any) -> bool:
    return hasattr(node, "op") and node.op == "call_function" and node.target is torch.quantize_per_tensor


def is_dequantize(node: Any) -> bool:
    return hasattr(node, "op") and node.op == "call_method" and node.target == "dequantize"


def _kind(node: Any) -> str:
    return node.meta.get("quant", {}).get("kind", "float")


def qparams_of(gm: nn.Module, node: Any) -> tuple[float, int, torch.dtype] | None:
    """``(scale, zero_point, dtype)`` of a quantized value in the converted graph, or None if unknown."""
    if is_quantize(node):
        return float(node.args[1]), int(node.args[2]), node.args[3]
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if isinstance(mod, tuple(QUANTIZED_MODULES.values())):
            qmod: Any = mod  # one of QUANTIZED_MODULES' values
            return float(qmod.scale), int(qmod.zero_point), torch.quint8
    if node.op == "call_function" and node.target in set(QUANTIZED_FUNCTIONS.values()):
        return float(node.args[-2]), int(node.args[-1]), torch.quint8
    if _kind(node) == "same_scale" and node.args and hasattr(node.args[0], "op"):
        return qparams_of(gm, node.args[0])
    return None


def _erase_if_dead(gm: Any, *nodes: Any) -> None:
    for n in nodes:
        if not n.users:
            gm.graph.erase_node(n)


def _observed_copy(mod: nn.Module, q: Any) -> nn.Module:
    """A copy of ``mod`` set up the way ``from_float`` expects: qconfig everywhere, activation observer."""
    observed = copy.deepcopy(mod)
    qconfig = q.meta["quant_qconfig"]
    for sub in observed.modules():
        sub.qconfig = qconfig
    observed.activation_post_process = q.meta["quant_observer"]
    return observed


# ---------------------------------------------------------------------------------------------- rewrites
def lower_module(gm: Any, q: Any) -> bool:
    # q(mod(dq(x))) -> qmod(x)   where mod is Linear/Conv/ConvReLU/LinearReLU/..., qmod its nnq/nniq twin
    if not is_quantize(q) or not hasattr(q.args[0], "op"):
        return False
    op = q.args[0]
    if op.op != "call_module" or _kind(op) != "compute" or len(op.users) != 1 or not is_dequantize(op.args[0]):
        return False
    mod = gm.get_submodule(op.target)
    qmod = QUANTIZED_MODULES[type(mod)].from_float(_observed_copy(mod, q))
    prefix, _, name = op.target.rpartition(".")
    setattr(gm.get_submodule(prefix) if prefix else gm, name, qmod)
    dq = op.args[0]
    op.args = (dq.args[0], *op.args[1:])
    q.replace_all_uses_with(op)
    gm.graph.erase_node(q)
    _erase_if_dead(gm, dq)
    return True


def lower_function(gm: Any, q: Any) -> bool:
    # q(add(dq(a), dq(b)))       -> quantized.add(a, b, scale, zero_point)       (also mul, add_relu)
    # q(cat([dq(a), dq(b)], d))  -> cat([a, b], d)   when a, b already have the output's qparams (shared observer)
    # q(cat([dq(a), dq(b)], d))  -> quantized.cat([a, b], d, scale, zero_point)  otherwise (requantizes a, b)
    if not is_quantize(q) or not hasattr(q.args[0], "op"):
        return False
    op = q.args[0]
    if op.op != "call_function" or _kind(op) != "compute" or len(op.users) != 1:
        return False
    is_cat = op.target is torch.cat
    operands = list(op.args[0]) if is_cat else list(op.args)
    if not operands or not all(is_dequantize(a) for a in operands):
        return False
    if is_cat and any(k != "dim" for k in op.kwargs):
        return False
    scale, zero_point = q.args[1], q.args[2]
    inner = [a.args[0] for a in operands]
    if is_cat:
        dim = op.kwargs.get("dim", op.args[1] if len(op.args) > 1 else 0)
        shared = all(qparams_of(gm, x) == (float(scale), int(zero_point), q.args[3]) for x in inner)
        # inputs already at the output's scale (shared observer): a plain cat of int8 tensors
        op.args, op.kwargs = ((inner, dim), {}) if shared else ((inner, dim, scale, zero_point), {})
        op.target = torch.cat if shared else torch.ops.quantized.cat
    else:
        op.args = (*inner, scale, zero_point)
        op.target = QUANTIZED_FUNCTIONS[op.target]
    q.replace_all_uses_with(op)
    gm.graph.erase_node(q)
    _erase_if_dead(gm, *dict.fromkeys(operands))
    return True


def sink_dequantize(gm: Any, op: Any) -> bool:
    # same_scale(dq(x), *rest) -> dq(same_scale(x, *rest))   e.g. relu, max_pool2d, flatten, view, dropout
    if _kind(op) != "same_scale" or not op.args or not is_dequantize(op.args[0]):
        return False
    dq = op.args[0]
    users = list(op.users)
    op.args = (dq.args[0], *op.args[1:])
    with gm.graph.inserting_after(op):
        new_dq = gm.graph.call_method("dequantize", (op,))
    for user in users:
        user.replace_input_with(op, new_dq)
    _erase_if_dead(gm, dq)
    return True


def fold_dequantize_quantize(gm: Any, q: Any) -> bool:
    # q(dq(x), s, z, dtype) -> x   when x is already quantized with exactly (s, z, dtype)
    if not is_quantize(q) or not is_dequantize(q.args[0]):
        return False
    dq = q.args[0]
    x = dq.args[0]
    if qparams_of(gm, x) != (float(q.args[1]), int(q.args[2]), q.args[3]):
        return False
    q.replace_all_uses_with(x)
    gm.graph.erase_node(q)
    _erase_if_dead(gm, dq)
    return True


def lower_weight_only(gm: Any, op: Any) -> bool:
    # embedding_bag(idx, offsets) -> quantized.EmbeddingBag(idx, offsets)   (8-bit row-wise weight, float out)
    if op.op != "call_module" or _kind(op) != "weight_only":
        return False
    mod = gm.get_submodule(op.target)
    if type(mod) not in WEIGHT_ONLY_MODULES:
        return False
    observed = copy.deepcopy(mod)
    observed.qconfig = op.meta["quant"]["qconfig"]
    qmod = WEIGHT_ONLY_MODULES[type(mod)].from_float(observed)
    prefix, _, name = op.target.rpartition(".")
    setattr(gm.get_submodule(prefix) if prefix else gm, name, qmod)
    op.meta["quant"] = {**op.meta["quant"], "kind": "lowered"}
    return True


class Rule(NamedTuple):
    name: str
    rewrite: Callable[[Any, Any], bool]
    """``rewrite(gm, node) -> bool``: rewrites around ``node`` and returns True, or returns False (no match)."""


RULES: list[Rule] = [
    Rule("sink-dequantize", sink_dequantize),  # same_scale(dq(x)) -> dq(same_scale(x))
    Rule("lower-module", lower_module),  # q(mod(dq(x))) -> qmod(x)
    Rule("lower-function", lower_function),  # q(f(dq(a), dq(b))) -> quantized.f(a, b, s, z)
    Rule("fold-dequantize-quantize", fold_dequantize_quantize),  # q(dq(x)) -> x   (same qparams)
    Rule("lower-weight-only", lower_weight_only),  # embedding_bag(i) -> quantized.EmbeddingBag(i)
]
"""The convert pass applies these to every node until none fires."""
