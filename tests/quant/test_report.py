"""The per-layer SQNR report (:mod:`quant.report`)."""

from __future__ import annotations

import math

import pytest
import torch

import quant
from quant.report import format_report, sqnr


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
