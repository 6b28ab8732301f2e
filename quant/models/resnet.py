"""ResNet-50 from transformers' own model definition (random weights), traceable by fxdist.

torchvision does not import beside the CPU torch 2.13 build here, so the canonical ResNet-50 comes from
``transformers.ResNetForImageClassification(ResNetConfig())`` (depths 3-4-6-3, bottleneck blocks,
``nn.BatchNorm2d`` after every conv inside ``ResNetConvLayer``).

``ResNetEmbeddings`` checks the channel count of its input (Python control flow on a shape), so it is traced
as a leaf; its stem conv + BN is folded at module level (:func:`fold_leaf_stem`) since the graph cannot see
inside it.

Shapes: ``pixel_values (B, 3, H, W)`` -> logits ``(B, num_labels)`` (1000 for the default config).

Source: torch.fx paper §6.2.2 (conv-BN fusion on ResNet-50); transformers/models/resnet/modeling_resnet.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["ResNetLogits", "resnet50", "trace_resnet", "fold_leaf_stem"]


class ResNetLogits(nn.Module):
    """Wraps a transformers ``ResNetForImageClassification`` so ``forward(pixel_values)`` returns logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values, output_hidden_states=False, return_dict=True).logits


def resnet50(**config: Any) -> ResNetLogits:
    """A randomly initialised ResNet-50 (or a smaller one: pass ``ResNetConfig`` fields) in eval mode."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    model = ResNetForImageClassification(ResNetConfig(**config))
    for m in model.modules():  # non-trivial BatchNorm statistics, so folding is really tested
        if isinstance(m, nn.BatchNorm2d):
            assert m.running_mean is not None and m.running_var is not None  # track_running_stats=True
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.1, 0.1)
    return ResNetLogits(model).eval()


def _leaf_tracer(base: type) -> type:
    """A subclass of ``base`` (an FX ``Tracer`` class) that keeps ``ResNetEmbeddings`` as a leaf."""
    from transformers.models.resnet.modeling_resnet import ResNetEmbeddings

    class ResNetTracer(base):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return isinstance(m, ResNetEmbeddings) or super().is_leaf_module(m, qualname)

    return ResNetTracer


def trace_resnet(model: nn.Module, *, fx: Any = None) -> Any:
    """Trace ``model`` with the embeddings as a leaf.

    Args:
        model: e.g. :func:`resnet50`.
        fx: the FX package to trace with: ``fxdist`` (default), or ``torch.fx`` for a reference in tests.
    """
    if fx is None:
        import fxdist as fx
    tracer = _leaf_tracer(fx.Tracer)()
    graph = tracer.trace(model)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def fold_leaf_stem(gm: Any) -> int:
    """Fold the conv + BN inside every leaf ``ResNetConvLayer``-style module (``.convolution`` + ``.normalization``)
    that the graph cannot see into (the embeddings' stem). Returns how many were folded.

    Raises:
        quant.FusionError: a BatchNorm is in training mode.
    """
    from quant.errors import FusionError
    from quant.fuse_conv_bn import BnStats, fold_bn_into

    leaves = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    count = 0
    for name in leaves:
        for sub in gm.get_submodule(name).modules():
            conv, bn = getattr(sub, "convolution", None), getattr(sub, "normalization", None)
            if isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d):
                if bn.training:
                    raise FusionError(f"fold_leaf_stem: {name}'s BatchNorm is in training mode; call model.eval()")
                stats = BnStats(bn.running_mean, bn.running_var, bn.weight, bn.bias, bn.eps, False, bn)
                sub.convolution = fold_bn_into(conv, stats)
                sub.normalization = nn.Identity()
                count += 1
    return count
