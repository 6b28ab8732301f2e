"""Conv/Linear/ConvTranspose + BatchNorm folding (quant.fuse), differential against eager and torch.fx's fuse."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.optimization import fuse as torch_fx_fuse

import fxdist as fx
import quant
from quant import FusionError
from quant.fuse_conv_bn import FuseConvBn


def _randomize_bn(model: nn.Module) -> nn.Module:
    """Non-trivial statistics, so that a fold that ignored any of them would be caught."""
    gen = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=gen))
            m.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
            if m.affine:
                m.weight.data.copy_(torch.randn(n, generator=gen))
                m.bias.data.copy_(torch.randn(n, generator=gen))
    return model.eval()


def _bn_nodes(gm) -> list:
    mods = dict(gm.named_modules())
    return [
        n for n in gm.graph.nodes
        if (n.op == "call_module" and isinstance(mods.get(n.target), nn.modules.batchnorm._BatchNorm))
        or (n.op == "call_function" and n.target is F.batch_norm)
    ]


CASES = {
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(3, 6, 3), nn.BatchNorm1d(6)), (2, 3, 10)),
    "conv2d": (lambda: nn.Sequential(nn.Conv2d(3, 6, 3, bias=False), nn.BatchNorm2d(6)), (2, 3, 8, 8)),
    "conv3d": (lambda: nn.Sequential(nn.Conv3d(2, 4, 3), nn.BatchNorm3d(4)), (1, 2, 5, 5, 5)),
    "conv2d_groups": (lambda: nn.Sequential(nn.Conv2d(4, 8, 3, groups=2), nn.BatchNorm2d(8)), (2, 4, 7, 7)),
    "linear_bn1d": (lambda: nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7)), (4, 5)),
    "convtranspose1d": (lambda: nn.Sequential(nn.ConvTranspose1d(3, 5, 3), nn.BatchNorm1d(5)), (2, 3, 6)),
    "convtranspose2d_groups": (
        lambda: nn.Sequential(nn.ConvTranspose2d(4, 6, 3, groups=2, stride=2), nn.BatchNorm2d(6)), (2, 4, 5, 5)
    ),
    "bn_no_affine": (lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, affine=False)), (2, 3, 4, 4)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fold_matches_eager_and_removes_bn(case):
    make, shape = CASES[case]
    torch.manual_seed(0)
    model = _randomize_bn(make())
    x = torch.randn(shape)
    gm = fx.symbolic_trace(model)
    fused = quant.fuse(gm)
    assert len(_bn_nodes(gm)) == 1 and _bn_nodes(fused) == []
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in fused.modules())
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-5)
    fused.graph.lint()
    assert len(_bn_nodes(gm)) == 1, "the caller's module must not change"


class FunctionalBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3)
        self.register_buffer("mean", torch.randn(5))
        self.register_buffer("var", torch.rand(5) + 0.5)
        self.gamma = nn.Parameter(torch.randn(5))
        self.beta = nn.Parameter(torch.randn(5))

    def forward(self, x):
        return F.batch_norm(self.conv(x), self.mean, self.var, self.gamma, self.beta, False, 0.1, 1e-3)


def test_fold_follows_functional_batch_norm():
    torch.manual_seed(0)
    model = FunctionalBN().eval()
    gm = fx.symbolic_trace(model)
    fused = quant.fuse(gm)
    x = torch.randn(2, 3, 6, 6)
    assert _bn_nodes(fused) == []
    assert [n.op for n in fused.graph.nodes] == ["placeholder", "call_module", "output"]  # get_attrs gone
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-5)


def test_digits_cnn_matches_torch_fx_fuse():
    from quant.models import DigitsCNN

    torch.manual_seed(0)
    model = _randomize_bn(DigitsCNN())
    x = torch.rand(8, 1, 8, 8)
    ours = quant.fuse(fx.symbolic_trace(model))
    ref = torch_fx_fuse(torch.fx.symbolic_trace(model), no_trace=True)
    # the same nodes survive (op, target), in the same order
    assert [(n.op, str(n.target)) for n in ours.graph.nodes if n.op == "call_module"] == [
        (n.op, str(n.target)) for n in ref.graph.nodes if n.op == "call_module"
    ]
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours(x), model(x), atol=1e-5, rtol=1e-5)
    record = ours.meta["fxdist"]["passes"][0]
    assert record["name"] == "fuse-conv-bn" and record["nodes_erased"] == 3 and record["modified"]


def test_small_resnet_from_transformers():
    pytest.importorskip("transformers")
    from quant.models.resnet import fold_leaf_stem, resnet50, trace_resnet

    model = resnet50(depths=[1, 1], hidden_sizes=[16, 32], embedding_size=8, num_labels=5)
    gm = trace_resnet(model)
    fused = quant.fuse(gm)
    assert _bn_nodes(fused) == [] and len(_bn_nodes(gm)) > 0
    assert fold_leaf_stem(fused) == 1
    x = torch.randn(2, 3, 32, 32)
    ref = torch_fx_fuse(trace_resnet(model, fx=torch.fx), no_trace=True)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(fused(x), ref(x), atol=1e-4, rtol=1e-5)


def test_refuses_training_mode_with_clear_message():
    model = _randomize_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))).train()
    gm = fx.symbolic_trace(model)
    with pytest.raises(FusionError, match=r"training mode.*model\.eval\(\)"):
        quant.fuse(gm)


class SharedOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y  # the raw conv output is needed too


def test_refuses_conv_output_with_other_users():
    model = _randomize_bn(SharedOutput())
    gm = fx.symbolic_trace(model)
    with pytest.raises(FusionError, match=r"%conv .*also used by %add"):
        quant.fuse(gm)
    with pytest.warns(UserWarning, match="skipped"):
        kept = quant.fuse(gm, strict=False)
    assert len(_bn_nodes(kept)) == 1
    x = torch.randn(1, 3, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(kept(x), model(x))


def test_refusal_leaves_inplace_module_untouched():
    """All pairs are checked before any is folded: a refusal mutates nothing even when run in place."""
    model = _randomize_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), SharedOutput()))
    gm = fx.symbolic_trace(model)
    before = [(n.op, str(n.target)) for n in gm.graph.nodes]
    with pytest.raises(FusionError):
        FuseConvBn()(gm)
    assert [(n.op, str(n.target)) for n in gm.graph.nodes] == before


class SharedConv(nn.Module):
    """One conv module called twice, each call followed by a different BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn_a = nn.BatchNorm2d(4)
        self.bn_b = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn_a(self.conv(x)) - self.bn_b(self.conv(x * 2))


def test_shared_conv_module_gets_one_folded_copy_per_call_site():
    model = _randomize_bn(SharedConv())
    gm = fx.symbolic_trace(model)
    fused = quant.fuse(gm)
    targets = [n.target for n in fused.graph.nodes if n.op == "call_module"]
    assert len(targets) == 2 and len(set(targets)) == 2
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-5)
    assert torch.equal(copy.deepcopy(model).conv.weight, model.conv.weight)
