"""Conv/Linear + ReLU pattern fusion (:mod:`quant.fuse_patterns`)."""

from __future__ import annotations

import pytest
import torch
import torch.ao.nn.intrinsic as nni
import torch.nn.functional as F
from torch import nn

import fxdist as fx
import quant


class ReluFlavours(nn.Module):
    """ReLU as a module, as ``torch.relu``, as ``F.relu`` and as a method; one conv output used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(4, 4, 1)
        self.fc = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 6)
        self.fc3 = nn.Linear(6, 2)
        self.shared = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        x = self.relu(self.bn(self.conv(x)))
        x = torch.relu(self.conv2(x))
        s = self.shared(x)
        x = F.relu(s) + s  # s has two users: must not be fused
        v = self.fc(x.mean((2, 3))).relu()
        return self.fc3(F.relu(self.fc2(v)))


@pytest.mark.parametrize("seed", [0, 1])
def test_relu_patterns_fuse_into_intrinsic_modules(seed):
    torch.manual_seed(seed)
    model = ReluFlavours().eval()
    fused = quant.fuse(fx.symbolic_trace(model), patterns=True)
    kinds = {n.target: type(fused.get_submodule(n.target)) for n in fused.graph.nodes if n.op == "call_module"}
    assert kinds == {
        "conv": nni.ConvReLU2d, "conv2": nni.ConvReLU2d, "shared": nn.Conv2d, "fc": nni.LinearReLU,
        "fc2": nni.LinearReLU, "fc3": nn.Linear,
    }
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-5)
    assert not any(m.training for m in fused.modules()), "an eval-mode model must stay in eval mode"
    passes = [r["name"] for r in fused.meta["fxdist"]["passes"]]
    assert passes == ["fuse-conv-bn", "fuse-relu-patterns"]
