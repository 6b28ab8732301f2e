"""Conv2d + ReLU/add fused into oneDNN convolutions (:mod:`quant.fuse_onednn`), after BatchNorm folding."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxdist as fx
import quant


def test_onednn_post_op_fusion_on_resnet_blocks():
    """After folding, conv -> add(shortcut) -> relu and conv -> relu become single oneDNN convolutions."""
    pytest.importorskip("transformers")
    from quant.fuse_onednn import OneDNNConv2d
    from quant.models.resnet import resnet50, trace_resnet

    model = resnet50(depths=[1, 1], hidden_sizes=[16, 32], embedding_size=8, num_labels=5)
    x = torch.randn(2, 3, 32, 32)
    fused = quant.fuse(trace_resnet(model), onednn_inputs=(x,))
    mods = dict(fused.named_modules())
    ops = [n for n in fused.graph.nodes if n.op in ("call_function", "call_method")]
    assert ops == []  # every add and every ReLU went into a conv's post-ops
    convs = [mods[n.target] for n in fused.graph.nodes if isinstance(mods.get(n.target), OneDNNConv2d)]
    assert len(convs) == 8  # 2 blocks x (3 convs + shortcut); the stem conv sits inside the leaf embeddings
    post_ops = [(c.binary, c.unary) for c in convs]
    assert post_ops.count(("add", "relu")) == 2 and post_ops.count((None, "relu")) == 4
    leftovers = [n for n, m in mods.items() if isinstance(m, (nn.ReLU, nn.Identity, nn.BatchNorm2d))]
    assert all(n.startswith("model.resnet.embedder.") for n in leftovers)  # only inside the leaf stem
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fused(x[:1]), model(x[:1]), atol=1e-4, rtol=1e-4)  # repacked for a new shape
    copy.deepcopy(fused)(x)  # packed weights are dropped on copy and rebuilt


def test_onednn_fusion_needs_example_inputs():
    from quant.fuse_onednn import FuseConvPointwise

    with pytest.raises(ValueError, match="example_inputs"):
        FuseConvPointwise()(fx.symbolic_trace(nn.Sequential(nn.Conv2d(3, 4, 3))))
