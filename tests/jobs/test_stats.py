"""The job's comparison statistics: the interleaved gain, its interval, and the parity check."""

from __future__ import annotations

import math
import random

import pytest
import torch

from jobs.stats import auc, auc_standard_error, interleaved_gain, median_interval, parity_check


def test_median_interval_uses_sign_test_order_statistics():
    out = median_interval([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (out["median"], out["min"], out["max"], out["n"]) == (3.0, 1.0, 5.0, 5)
    assert out["low"] is None and out["high"] is None  # 5 values cannot give a 95 % interval
    out = median_interval(list(range(10)))
    assert (out["low"], out["high"]) == (1, 8)  # n = 10: x_(2) .. x_(9)
    # coverage: the interval holds the true median of a skewed distribution in >= 95 % of samples
    rng = random.Random(0)
    hits = 0
    for _ in range(400):
        xs = [rng.expovariate(1.0) for _ in range(15)]
        iv = median_interval(xs)
        hits += iv["low"] <= math.log(2) <= iv["high"]
    assert hits / 400 >= 0.93


def test_interleaved_gain_pairs_blocks_by_the_slowest_trainer_and_skips_the_warmup_block():
    blocks = [{"baseline": [2.0, 1.0, 1.0, 1.2], "optimized": [1.0, 0.8, 1.0, 1.0]},
              {"baseline": [1.0, 1.1, 0.9, 1.0], "optimized": [1.0, 1.0, 0.5, 1.0]}]
    gain = interleaved_gain(blocks)
    assert gain["block_gain_percent"] == pytest.approx([100.0, 10.0, 0.0, 20.0])
    assert gain["warmup_blocks"] == 1 and gain["blocks"] == 3
    assert gain["median_percent"] == pytest.approx(10.0)
    assert (gain["min_percent"], gain["max_percent"]) == pytest.approx((0.0, 20.0))
    single = interleaved_gain([{"baseline": [1.0], "optimized": [0.5]}])  # too few blocks to drop one
    assert single["warmup_blocks"] == 0 and single["median_percent"] == 100.0


def test_auc_standard_error_matches_the_spread_of_resampled_aucs():
    gen = torch.Generator().manual_seed(1)
    labels = (torch.rand(2000, generator=gen) < 0.3).float()
    scores = labels + torch.randn(2000, generator=gen) * 1.5
    value = auc(scores, labels)
    se = auc_standard_error(value, int(labels.sum()), 2000 - int(labels.sum()))
    boot = []
    for _ in range(200):
        idx = torch.randint(0, 2000, (2000,), generator=gen)
        boot.append(auc(scores[idx], labels[idx]))
    assert se == pytest.approx(float(torch.tensor(boot).std()), rel=0.25)


def _result(loss_series, loss, quality):
    """A phase's results as the launcher has them (``PhaseResult``): no timings, the loss curve and quality."""
    from jobs.results import PhaseResult

    return PhaseResult.from_json({"qps": None, "step_p50_ms": None, "step_p99_ms": None, "lookup_p50_ms": None,
                                  "lookup_p99_ms": None, "loss": loss, "loss_series": loss_series,
                                  "quality": quality})


def _phase(losses, auc_value, rows=1000, positives=250):
    tail = losses[-max(1, len(losses) // 10):]
    return _result(losses, sum(tail) / len(tail), {"auc": auc_value, "rows": rows, "positives": positives})


def test_parity_check_accepts_identical_and_close_runs_and_rejects_a_different_model():
    losses = [0.7 - 0.01 * i + 0.02 * math.sin(i) for i in range(40)]
    same = parity_check(_phase(losses, 0.71), _phase(list(losses), 0.71))
    assert same["ok"] and same["identical_losses"] and same["max_step_loss_diff"] == 0
    close = parity_check(_phase(losses, 0.71), _phase([x + 1e-4 for x in losses], 0.712))
    assert close["ok"] and not close["identical_losses"]
    assert 0 < close["auc"]["tolerance"] < 0.06 and close["auc"]["ok"]
    worse = parity_check(_phase(losses, 0.71), _phase([x + 0.2 for x in losses], 0.60))
    assert not worse["ok"] and not worse["auc"]["ok"] and not worse["loss"]["ok"]


def test_rmse_standard_error_matches_the_spread_of_resampled_rmses():
    from jobs.stats import regression_metrics

    gen = torch.Generator().manual_seed(2)
    targets = torch.randint(1, 6, (3000,), generator=gen).float()
    predictions = targets + torch.randn(3000, generator=gen) * 0.9
    r = regression_metrics(predictions, targets)
    boot = []
    for _ in range(200):
        idx = torch.randint(0, 3000, (3000,), generator=gen)
        boot.append(regression_metrics(predictions[idx], targets[idx])["rmse"])
    assert r["rmse"] == pytest.approx(0.9, rel=0.05)
    assert r["rmse_se"] == pytest.approx(float(torch.tensor(boot).std()), rel=0.25)


def test_parity_on_rmse_uses_the_baselines_standard_error():
    losses = [1.2 - 0.01 * i + 0.02 * math.sin(i) for i in range(40)]

    def phase(series, rmse):
        return _result(series, sum(series[-4:]) / 4, {"rmse": rmse, "rmse_se": 0.01})

    close = parity_check(phase(losses, 0.95), phase([x + 1e-4 for x in losses], 0.96))
    assert close["ok"] and close["metrics"] == ["rmse"] and "auc" not in close
    assert close["rmse"]["tolerance"] == pytest.approx(0.02) and close["rmse"]["ok"]
    worse = parity_check(phase(losses, 0.95), phase([x + 1e-4 for x in losses], 0.98))
    assert not worse["ok"] and not worse["rmse"]["ok"] and worse["loss"]["ok"]
    from jobs.launcher.report import parity_problem

    assert parity_problem(worse).startswith("differs from the baseline: rmse 0.9800 vs baseline 0.9500")
