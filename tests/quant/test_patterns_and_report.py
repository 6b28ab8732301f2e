"""Conv/Linear + ReLU pattern fusion, the rule table, and the per-layer SQNR report."""

from __future__ import annotations

import math

import pytest
import torch
import torch.ao.nn.intrinsic as nni
import torch.nn.functional as F
from torch import nn

import fxdist as fx
import quant
from quant.rules import RULES
from quant.report import format_report, sqnr


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


def test_rule_table_documents_each_rule():
    """Every rule has a name and its rewrite's source carries a ``# before -> after`` comment."""
    import inspect

    assert len({r.name for r in RULES}) == len(RULES) >= 5
    for rule in RULES:
        assert "->" in inspect.getsource(rule.rewrite), rule.name


def test_sqnr_values():
    x = torch.randn(1000)
    assert math.isinf(sqnr(x, x))
    assert sqnr(x, x + 0.1 * x) == pytest.approx(20.0, abs=1e-6)
    with pytest.raises(ValueError, match="shapes differ"):
        sqnr(x, x[:10])


def test_report_finds_the_layer_that_hurts(digits):
    """Make fc2's weights quantize badly: fc1's channel 0 is made dead (always 0 after its ReLU) and fc2 gets a
    huge weight on it, so fc2's per-channel weight scales round every other weight to 0 while its float output
    ignores that weight. The report must rank fc2 worst."""
    model, (x, *_) = digits
    import copy

    bad = copy.deepcopy(model)
    with torch.no_grad():
        bad.fc1.weight[0] = 0.0
        bad.fc1.bias[0] = -1.0  # channel 0 of relu(bn3(fc1(x))) is now 0 (BN folded below keeps the sign)
        bad.bn3.running_mean[0], bad.bn3.running_var[0] = 0.0, 1.0
        bad.bn3.weight[0], bad.bn3.bias[0] = 1.0, 0.0
        bad.fc2.weight[:, 0] = 1e4
    with torch.no_grad():  # the huge weight multiplies zeros only: float outputs are unaffected by its size
        before = bad(x[:64])
        bad.fc2.weight[:, 0] = 1e5
        torch.testing.assert_close(bad(x[:64]), before)
        bad.fc2.weight[:, 0] = 1e4
    prepared = quant.prepare(bad, None, (x[:8],))
    quant.calibrate(prepared, [x[:512]], progress=False)
    q = quant.convert(prepared)
    report = quant.sqnr_report(prepared, q, (x[:256],))
    assert [e.name for e in report][:2] == ["conv1", "conv2"]  # graph order
    worst = min(report, key=lambda e: e.own_sqnr_db)
    assert worst.name == "fc2"
    assert all(e.sqnr_db > 15 for e in report if e.name != "fc2")
    table = format_report(report, worst_first=True)
    assert table.splitlines()[1].startswith("fc2")
