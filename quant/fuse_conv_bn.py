"""Fold eval-mode BatchNorm into the convolution or linear layer that feeds it.

Math (per output channel ``c``, shapes ``(C_out,)``)::

    g[c]  = gamma[c] / sqrt(running_var[c] + eps)
    w'[c] = w[c] * g[c]                       # the output-channel slice of the weight
    b'[c] = (b[c] - running_mean[c]) * g[c] + beta[c]

so ``bn(conv(x)) == conv'(x)`` in eval mode. The output channel is dim 0 of a Conv/Linear weight and dim 1 of a
ConvTranspose weight (``(C_in, C_out / groups, *k)``, folded group by group).

The BatchNorm may be a ``call_module`` (``nn.BatchNorm1d/2d/3d``) or a ``call_function`` to
``torch.nn.functional.batch_norm`` whose statistics are ``get_attr`` nodes or constants.

Source: torch.fx paper §6.2.2 (conv-BN fusion, "under 150 lines"); torch/fx/experimental/optimization.py (fuse).
"""

from __future__ import annotations

import copy
import inspect
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from fxdist.passes.pass_base import PassBase, PassResult
from quant.errors import FusionError, describe_node

__all__ = ["FuseConvBn", "BnStats", "fold_bn_weights", "fold_bn_into"]

_FOLDABLE = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Linear)
_BN_MODULES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_BN_SIGNATURE = inspect.signature(F.batch_norm)


@dataclass(frozen=True)
class BnStats:
    """The tensors of one BatchNorm, whichever way it was called. Shapes ``(C,)``."""

    running_mean: torch.Tensor | None
    running_var: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float
    training: bool
    module: nn.Module | None = None


def fold_bn_weights(
    weight: torch.Tensor, bias: torch.Tensor | None, bn: BnStats, *, transpose: bool = False, groups: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(w', b')`` with the BatchNorm folded in (per-channel factors in float64, result in ``weight.dtype``).

    Args:
        weight: ``(C_out, ...)``, or ``(C_in, C_out / groups, *k)`` when ``transpose``.
        bias: ``(C_out,)`` or None (treated as zeros).
        bn: the BatchNorm's statistics; ``running_mean``/``running_var`` must be set.
        transpose: the weight belongs to a ConvTranspose.
        groups: the ConvTranspose's groups.
    """
    assert bn.running_mean is not None and bn.running_var is not None
    dt = weight.dtype
    mean, var = bn.running_mean.double(), bn.running_var.double()
    g = torch.rsqrt(var + bn.eps)  # per-channel vectors in float64; the big weight multiply stays in dt
    if bn.weight is not None:
        g = g * bn.weight.double()
    b = bias.double() if bias is not None else torch.zeros_like(mean)
    new_bias = (b - mean) * g + (bn.bias.double() if bn.bias is not None else 0.0)
    g = g.to(dt)
    if not transpose:
        new_w = weight * g.reshape(-1, *([1] * (weight.dim() - 1)))
    else:
        c_in, c_out_g, *k = weight.shape
        grouped = weight.reshape(groups, c_in // groups, c_out_g, *k)
        new_w = (grouped * g.reshape(groups, 1, c_out_g, *([1] * len(k)))).reshape(weight.shape)
    return new_w, new_bias.to(dt)


def fold_bn_into(module: nn.Module, bn: BnStats) -> nn.Module:
    """A copy of ``module`` (Conv/ConvTranspose/Linear) whose weight and bias include ``bn``."""
    # deep-copy everything but the weight and bias, which are replaced anyway
    memo = {id(p): p for p in (module.weight, module.bias) if p is not None}
    fused = copy.deepcopy(module, memo)
    transpose = isinstance(module, nn.modules.conv._ConvTransposeNd)
    groups = getattr(module, "groups", 1)
    weight, bias = cast(torch.Tensor, module.weight), cast("torch.Tensor | None", module.bias)
    w, b = fold_bn_weights(weight.detach(), _detach(bias), bn, transpose=transpose, groups=groups)
    fused.weight = nn.Parameter(w, weight.requires_grad)
    fused.bias = nn.Parameter(b, weight.requires_grad)
    return fused


def _detach(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def _out_channels(module: nn.Module) -> int:
    return module.out_features if isinstance(module, nn.Linear) else cast(int, module.out_channels)


@dataclass(frozen=True)
class _Match:
    conv: Any  # Node feeding the BatchNorm
    bn: Any  # the BatchNorm Node
    stats: BnStats


def _fetch(gm: nn.Module, value: Any) -> Any:
    """A get_attr node's tensor, or the constant itself; raises KeyError for any other node."""
    if hasattr(value, "op"):
        if value.op != "get_attr":
            raise KeyError(value.name)
        obj: Any = gm
        for part in str(value.target).split("."):
            obj = getattr(obj, part)
        return obj
    return value


def _bn_stats(gm: nn.Module, node: Any, modules: dict[str, nn.Module]) -> BnStats | None:
    """Matcher: the BatchNorm statistics of ``node``, or None if it is no BatchNorm we can read."""
    m = modules.get(node.target) if node.op == "call_module" else None
    if isinstance(m, _BN_MODULES):
        return BnStats(m.running_mean, m.running_var, m.weight, m.bias, m.eps, m.training, m)
    if node.op == "call_function" and node.target is F.batch_norm:
        try:
            bound = _BN_SIGNATURE.bind(*node.args, **node.kwargs)
            bound.apply_defaults()
            a = {k: _fetch(gm, v) for k, v in bound.arguments.items() if k != "input"}
        except (TypeError, KeyError, AttributeError):
            return None
        training = a["training"] if isinstance(a["training"], bool) else True
        return BnStats(a["running_mean"], a["running_var"], a["weight"], a["bias"], float(a["eps"]), training)
    return None


def match_conv_bn(gm: nn.Module, node: Any, modules: dict[str, nn.Module]) -> _Match | None:
    """Matcher: ``bn(conv(x))`` with ``conv`` a call_module Conv/ConvTranspose/Linear; None if no match."""
    stats = _bn_stats(gm, node, modules)
    if stats is None or not node.args or not hasattr(node.args[0], "op"):
        return None
    conv = node.args[0]
    if conv.op != "call_module" or type(modules.get(conv.target)) not in _FOLDABLE:
        return None
    return _Match(conv, node, stats)


def _refusal(m: _Match, modules: dict[str, nn.Module]) -> str | None:
    """Why folding ``m`` would change the program, or None if it is safe."""
    conv_mod = modules[m.conv.target]
    where = f"{describe_node(m.bn)} after {describe_node(m.conv)}"
    if m.stats.training:
        return f"{where}: the BatchNorm is in training mode (batch statistics); call model.eval() before fusing"
    if conv_mod.training:
        return f"{where}: module {m.conv.target!r} is in training mode; call model.eval() before fusing"
    if m.stats.running_mean is None or m.stats.running_var is None:
        return f"{where}: the BatchNorm has no running statistics (track_running_stats=False), nothing to fold"
    others = [u.name for u in m.conv.users if u is not m.bn]
    if others:
        return (
            f"{where}: the conv output is also used by {', '.join('%' + o for o in others)}, which need the "
            "un-normalized value; fold only single-use conv outputs (or pass strict=False to skip this pair)"
        )
    if m.stats.running_mean.numel() != _out_channels(conv_mod):
        return f"{where}: BatchNorm has {m.stats.running_mean.numel()} channels, the conv {_out_channels(conv_mod)}"
    return None


def _set_submodule(gm: nn.Module, target: str, module: nn.Module) -> None:
    prefix, _, name = target.rpartition(".")
    setattr(gm.get_submodule(prefix) if prefix else gm, name, module)


def _delete_submodule(gm: nn.Module, target: str) -> None:
    prefix, _, name = target.rpartition(".")
    delattr(gm.get_submodule(prefix) if prefix else gm, name)


def _apply(gm: Any, m: _Match, modules: dict[str, nn.Module]) -> None:
    graph = gm.graph
    fused = fold_bn_into(modules[m.conv.target], m.stats)
    sharers = [n for n in graph.nodes if n.op == "call_module" and n.target == m.conv.target]
    if len(sharers) == 1:
        _set_submodule(gm, m.conv.target, fused)
    else:  # the conv module is called elsewhere too: give this call site its own folded copy
        base, k = f"{m.conv.target}_fused", 0
        while f"{base}_{k}" in modules:
            k += 1
        m.conv.target = f"{base}_{k}"
        _set_submodule(gm, m.conv.target, fused)
    modules[m.conv.target] = fused
    m.bn.replace_all_uses_with(m.conv)
    graph.erase_node(m.bn)


@dataclass(frozen=True)
class FuseConvBn(PassBase):
    """Fold every eval-mode BatchNorm that follows a Conv{1,2,3}d, ConvTranspose{1,2,3}d or Linear.

    Precondition: the graph lints; the model is in eval mode. Postcondition: it lints, computes the same outputs
    (float32 rounding only: atol 1e-5 on unit-scale activations), and has no BatchNorm node after a foldable layer.
    All pairs are checked before anything is mutated, so a refusal leaves the module as it was.

    Returns: ``PassResult(gm, modified)``; ``modified`` is False when there was nothing to fold.

    Raises:
        FusionError: (``strict=True``) a BatchNorm or conv is in training mode, or the conv output has other users;
            the message names the nodes and the fix. With ``strict=False`` such pairs are skipped with a warning.

    Source: torch.fx paper §6.2.2; torch/fx/experimental/optimization.py (fuse, matches_module_pattern).
    """

    name: ClassVar[str] = "fuse-conv-bn"
    strict: bool = True
    """Raise on a pair that cannot be folded (else skip it with a warning)."""

    def call(self, gm: Any) -> PassResult:
        """Fold every foldable conv/linear + BatchNorm pair of ``gm`` in place (see the class docstring).

        Raises:
            FusionError: (``strict=True``) a pair cannot be folded; nothing was changed.
        """
        modules = dict(gm.named_modules())
        matches = [m for n in list(gm.graph.nodes) if (m := match_conv_bn(gm, n, modules)) is not None]
        refusals = {id(m): why for m in matches if (why := _refusal(m, modules)) is not None}
        if refusals and self.strict:
            raise FusionError("cannot fold BatchNorm:\n  " + "\n  ".join(refusals.values()))
        for why in refusals.values():
            warnings.warn(f"fuse-conv-bn: skipped {why}", stacklevel=2)
        folded = [m for m in matches if id(m) not in refusals]
        bn_targets = {m.bn.target for m in folded if m.bn.op == "call_module"}
        for m in folded:
            _apply(gm, m, modules)
        for node in list(gm.graph.nodes):  # statistics of functional batch_norm calls, now unused
            if node.op == "get_attr" and not node.users:
                gm.graph.erase_node(node)
        still_used = {n.target for n in gm.graph.nodes if n.op in ("call_module", "get_attr")}
        for target in bn_targets - still_used:
            _delete_submodule(gm, target)
        return PassResult(gm, bool(folded))
