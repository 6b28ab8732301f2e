"""Numbers of a job: AUC, log loss, per-phase QPS and latency percentiles, QPS over time.

Pure functions over tensors and lists, so they are tested without Ray.
"""

from __future__ import annotations

import math
import resource
import sys
from collections.abc import Sequence
from typing import Any

import torch

from jobs.records import Gain, MedianInterval, Parity, Quality, Within
from jobs.results import PhaseResult

__all__ = ["auc", "auc_standard_error", "log_loss", "binary_metrics", "regression_metrics", "percentile", "phase_summary", "qps_series",
           "gain_percent", "median_interval", "interleaved_gain", "parity_check", "peak_rss_bytes"]


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties); NaN if one class is absent.

    Shapes: ``scores (N,)``, ``labels (N,)`` in {0, 1}.
    """
    scores = scores.detach().double().flatten()
    labels = labels.detach().flatten() > 0.5
    n_pos = int(labels.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    # average the ranks of tied scores
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts + 1
    average = (first + first + counts - 1).double() / 2
    ranks[order] = average[inverse]
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def log_loss(probabilities: torch.Tensor, labels: torch.Tensor, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of click probabilities, clipped to ``[eps, 1 - eps]``, in nats."""
    p = probabilities.detach().double().flatten().clamp(eps, 1 - eps)
    y = labels.detach().double().flatten()
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def auc_standard_error(value: float, positives: int, negatives: int) -> float:
    """Standard error of an AUC measured on ``positives`` + ``negatives`` rows (Hanley & McNeil, Radiology
    1982, eq. 2): the spread the same model's AUC shows over resamplings of the held-out set."""
    if not positives or not negatives or math.isnan(value):
        return float("nan")
    q1, q2 = value / (2 - value), 2 * value**2 / (1 + value)
    var = (value * (1 - value) + (positives - 1) * (q1 - value**2) + (negatives - 1) * (q2 - value**2))
    return math.sqrt(max(var, 0.0) / (positives * negatives))


def binary_metrics(probabilities: torch.Tensor, labels: torch.Tensor) -> Quality:
    """``{"auc", "log_loss", "rows", "positives"}`` of click probabilities against labels."""
    return {"auc": auc(probabilities, labels), "log_loss": log_loss(probabilities, labels),
            "rows": int(labels.numel()), "positives": int((labels.flatten() > 0.5).sum())}


def regression_metrics(predictions: torch.Tensor, targets: torch.Tensor) -> Quality:
    """``{"rmse", "rmse_se", "mae", "rows"}`` of predictions against targets (e.g. ratings).

    ``rmse_se`` is the standard error of the RMSE over resamplings of the rows, by the delta method: with the
    per-row squared errors ``e_i``, ``se(mean e) = std(e) / sqrt(n)`` and ``se(sqrt(m)) = se(m) / (2 sqrt(m))``.

    Shapes: ``predictions (N,)``, ``targets (N,)``.

    >>> r = regression_metrics(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 2.0, 3.0, 6.0]))
    >>> round(r["rmse"], 4), round(r["rmse_se"], 4), r["mae"], r["rows"]
    (1.0, 0.5, 0.5, 4)
    """
    err = predictions.detach().double().flatten() - targets.detach().double().flatten()
    sq = err**2
    n = sq.numel()
    mse = float(sq.mean()) if n else float("nan")
    rmse = math.sqrt(mse) if n else float("nan")
    se_mse = float(sq.std() / math.sqrt(n)) if n > 1 else float("nan")
    return {"rmse": rmse, "rmse_se": se_mse / (2 * rmse) if rmse > 0 else float("nan"),
            "mae": float(err.abs().mean()) if n else float("nan"), "rows": int(n)}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q / 100))


def qps_series(times: Sequence[float], samples_per_step: int, *, window: int = 10) -> list[tuple[float, float]]:
    """(seconds since phase start, samples/s) over sliding windows of ``window`` steps of one rank."""
    series = []
    for i in range(window, len(times), max(1, window // 2)):
        dt = times[i] - times[i - window]
        if dt > 0:
            series.append((times[i], window * samples_per_step / dt))
    return series


def phase_summary(runs: Sequence[Any], batch_size: int, **after: Any) -> PhaseResult:
    """Combine the :class:`jobs.trainer.pipeline.PhaseRun` of every trainer into the phase's numbers (units: the fields
    of :class:`jobs.results.PhaseResult`); ``after``: its other fields (``quality``, ``optimize``...), set by the
    trainers after evaluation.

    QPS is job-wide: all samples of all trainers divided by the slowest trainer's wall time of the
    phase (data batches come from memory, so this is training throughput). Latency percentiles pool
    every step of every trainer. ``loss`` averages the last 10% of steps over trainers.
    ``metrics_percent``: the largest share (in %) of a trainer's phase time spent updating its
    Prometheus metrics (``PhaseRun.metrics_seconds``). ``prefetched_lookups``: lookups of all trainers
    answered by a prefetch.

    Raises:
        TypeError: a key of ``after`` that is not a field of :class:`jobs.results.PhaseResult`.
    """
    samples = sum(r.samples for r in runs)
    wall = max(r.wall_seconds for r in runs)
    steps = [s for r in runs for s in r.step_seconds]
    fetch = [s for r in runs for s in r.lookup_seconds]
    tail = max(1, len(runs[0].losses) // 10)
    losses = [sum(r.losses[-tail:]) / len(r.losses[-tail:]) for r in runs if r.losses]
    world = len(runs)
    return PhaseResult(
        trainers=world,
        steps=runs[0].steps,
        samples=samples,
        wall_seconds=wall,
        qps=samples / wall if wall > 0 else float("nan"),
        step_p50_ms=percentile(steps, 50) * 1e3,
        step_p99_ms=percentile(steps, 99) * 1e3,
        lookup_p50_ms=percentile(fetch, 50) * 1e3 if fetch else None,
        lookup_p99_ms=percentile(fetch, 99) * 1e3 if fetch else None,
        loss=sum(losses) / len(losses) if losses else float("nan"),
        prefetched_lookups=sum(getattr(r, "prefetched_lookups", 0) for r in runs),
        # the trainer that spent the largest share of its phase time updating metrics
        metrics_percent=max(100 * getattr(r, "metrics_seconds", 0.0) / r.wall_seconds if r.wall_seconds > 0
                            else 0.0 for r in runs),
        qps_series=[(t, q * world) for t, q in qps_series(runs[0].times, batch_size)],
        loss_series=list(runs[0].losses),
        **after,
    )


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes (``getrusage(RUSAGE_SELF).ru_maxrss``: KiB on
    Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def gain_percent(baseline: float, optimized: float) -> float:
    """``100 * (optimized / baseline - 1)``; NaN when the baseline is 0 or missing."""
    if not baseline or math.isnan(baseline):
        return float("nan")
    return 100.0 * (optimized / baseline - 1.0)


def median_interval(values: Sequence[float], confidence: float = 0.95) -> MedianInterval:
    """Median of ``values`` with its range and a distribution-free confidence interval.

    The interval is ``(x_(k), x_(n+1-k))`` of the sorted values, with the largest ``k`` such that a
    Binomial(n, 1/2) falls below ``k`` with probability at most ``(1 - confidence) / 2`` (the sign-test
    interval for a median; Hollander & Wolfe, Nonparametric Statistical Methods, §3.6). With fewer than 6
    values no 95 % interval exists: ``low``/``high`` are then None and the range is the honest spread.

    Returns:
        ``{"median", "min", "max", "low", "high", "confidence", "n"}``.
    """
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "low": None, "high": None,
                "confidence": confidence, "n": 0}
    median = float(torch.tensor(xs, dtype=torch.float64).quantile(0.5))
    k, tail = 0, 0.0
    while True:  # P(Binomial(n, 1/2) <= k) for growing k
        tail += math.comb(n, k) / 2**n
        if tail > (1 - confidence) / 2:
            break
        k += 1
    low, high = (xs[k - 1], xs[n - k]) if k >= 1 else (None, None)
    return {"median": median, "min": xs[0], "max": xs[-1], "low": low, "high": high, "confidence": confidence, "n": n}


def interleaved_gain(blocks: Sequence[dict[str, Sequence[float]]], baseline: str = "baseline",
                     optimized: str = "optimized", warmup: int = 1) -> Gain:
    """QPS gain of ``optimized`` over ``baseline`` from interleaved blocks of the same steps.

    Args:
        blocks: per trainer, ``{phase: [seconds of block 0, block 1, ...]}``; both phases trained the same
            batches in each block, one right after the other.
        warmup: leading blocks left out when at least ``warmup + 2`` blocks exist (first-step costs:
            DDP bucket set-up, the first call of generated code).

    Returns:
        ``{"block_gain_percent": [...], "median_percent", "min_percent", "max_percent", "low_percent",
        "high_percent", "confidence", "blocks", "warmup_blocks"}``: each block's gain is
        ``100 * (T_baseline / T_optimized - 1)`` with ``T`` the slowest trainer's time for the block (the
        job's QPS ratio for those steps); the median is the reported gain.
    """
    count = min(len(b.get(baseline, ())) for b in blocks) if blocks else 0
    count = min(count, min(len(b.get(optimized, ())) for b in blocks)) if blocks else 0
    gains = []
    for i in range(count):
        t_base = max(b[baseline][i] for b in blocks)
        t_opt = max(b[optimized][i] for b in blocks)
        gains.append(100.0 * (t_base / t_opt - 1.0) if t_opt > 0 else float("nan"))
    skip = warmup if count >= warmup + 2 else 0
    summary = median_interval([g for g in gains[skip:] if not math.isnan(g)])
    return {"block_gain_percent": gains, "median_percent": summary["median"], "min_percent": summary["min"],
            "max_percent": summary["max"], "low_percent": summary["low"], "high_percent": summary["high"],
            "confidence": summary["confidence"], "blocks": summary["n"], "warmup_blocks": skip}


def parity_check(baseline: PhaseResult, optimized: PhaseResult, *, sigmas: float = 2.0) -> Parity:
    """Compare the optimized phase's model with the baseline's: its held-out quality metric and training loss.

    Tolerances come from the baseline's own spread: for the AUC, ``sigmas`` standard errors of the
    baseline AUC on its held-out rows (:func:`auc_standard_error`); for an RMSE (regression jobs, see
    :func:`regression_metrics`) or a held-out mean loss (``eval_loss``, your own loss), ``sigmas`` of its
    standard error (``rmse_se`` / ``eval_loss_se``); for the loss, ``sigmas`` standard errors
    of the baseline's mean loss over its last 10 % of steps (the batch-to-batch spread of that mean). The
    per-step loss curves of rank 0 are compared too: ``max_step_loss_diff`` is 0 when the two phases trained
    bit-identically (what step-ordered parameter servers give; see ``scheduling.ps.ordering``).

    Args:
        baseline, optimized: phase summaries (:func:`phase_summary` plus ``quality``).

    Returns:
        ``{"ok", "metrics", <metric>: {...}, "loss": {...}, "max_step_loss_diff", "identical_losses"}`` where
        ``metrics`` names the held-out metric checked (``["auc"]``, ``["rmse"]`` or ``["eval_loss"]``, from the
        baseline's quality) and each of ``<metric>``/``loss`` is ``{"baseline", "optimized", "diff",
        "tolerance", "ok"}``.
    """
    qb: Quality = baseline.quality or {}
    qo: Quality = optimized.quality or {}
    metric = "rmse" if "rmse" in qb else "eval_loss" if "eval_loss" in qb else "auc"
    out: Parity = {"metrics": [metric]}
    if metric == "auc":
        a_b, a_o = qb.get("auc", float("nan")), qo.get("auc", float("nan"))
        pos = qb.get("positives")
        se = auc_standard_error(a_b, pos, qb.get("rows", 0) - pos) if pos is not None else float("nan")
        checked = out["auc"] = _within(a_b, a_o, sigmas * se)
    elif metric == "rmse":
        checked = out["rmse"] = _within(qb["rmse"], qo.get("rmse", float("nan")), sigmas * qb.get("rmse_se", float("nan")))
    else:
        checked = out["eval_loss"] = _within(qb["eval_loss"], qo.get("eval_loss", float("nan")),
                                             sigmas * qb.get("eval_loss_se", float("nan")))
    series_b, series_o = baseline.get("loss_series") or [], optimized.get("loss_series") or []
    tail = series_b[-max(1, len(series_b) // 10):]
    spread = float(torch.tensor(tail, dtype=torch.float64).std()) if len(tail) > 1 else float("nan")
    out["loss"] = _within(baseline.get("loss", float("nan")), optimized.get("loss", float("nan")),
                          sigmas * spread / math.sqrt(len(tail)) if tail else float("nan"))
    pairs = list(zip(series_b, series_o))
    out["max_step_loss_diff"] = max((abs(x - y) for x, y in pairs), default=float("nan"))
    out["identical_losses"] = bool(pairs) and len(series_b) == len(series_o) and all(x == y for x, y in pairs)
    out["ok"] = out["identical_losses"] or (checked["ok"] and out["loss"]["ok"])
    return out


def _within(base: float, opt: float, tolerance: float) -> Within:
    diff = opt - base
    ok = (not math.isnan(diff)) and (diff == 0 or (not math.isnan(tolerance) and abs(diff) <= tolerance))
    return {"baseline": base, "optimized": opt, "diff": diff, "tolerance": tolerance, "ok": ok}
