"""Numbers of a job: AUC, log loss, per-phase QPS and latency percentiles, QPS over time.

Pure functions over tensors and lists, so they are tested without Ray.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["auc", "log_loss", "binary_metrics", "percentile", "phase_summary", "qps_series"]


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


def binary_metrics(probabilities: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """``{"auc", "log_loss", "rows"}`` of click probabilities against labels."""
    return {"auc": auc(probabilities, labels), "log_loss": log_loss(probabilities, labels),
            "rows": int(labels.numel())}


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


def phase_summary(runs: Sequence[Any], batch_size: int) -> dict[str, Any]:
    """Combine the :class:`jobs.worker.PhaseRun` of every trainer into the phase's numbers.

    QPS is job-wide: all samples of all trainers divided by the slowest trainer's wall time of the
    phase (data batches come from memory, so this is training throughput). Latency percentiles pool
    every step of every trainer. ``loss`` averages the last 10% of steps over trainers.
    ``metrics_percent``: the largest share (in %) of a trainer's phase time spent updating its
    Prometheus metrics (``PhaseRun.metrics_seconds``). ``prefetched_lookups``: lookups of all trainers
    answered by a prefetch.
    """
    samples = sum(r.samples for r in runs)
    wall = max(r.wall_seconds for r in runs)
    steps = [s for r in runs for s in r.step_seconds]
    fetch = [s for r in runs for s in r.fetch_seconds]
    tail = max(1, len(runs[0].losses) // 10)
    losses = [sum(r.losses[-tail:]) / len(r.losses[-tail:]) for r in runs if r.losses]
    world = len(runs)
    return {
        "trainers": world,
        "steps": runs[0].steps,
        "samples": samples,
        "wall_seconds": wall,
        "qps": samples / wall if wall > 0 else float("nan"),
        "step_p50_ms": percentile(steps, 50) * 1e3,
        "step_p99_ms": percentile(steps, 99) * 1e3,
        "fetch_p50_ms": percentile(fetch, 50) * 1e3 if fetch else None,
        "fetch_p99_ms": percentile(fetch, 99) * 1e3 if fetch else None,
        "loss": sum(losses) / len(losses) if losses else float("nan"),
        "prefetched_lookups": sum(getattr(r, "prefetched_lookups", 0) for r in runs),
        # the trainer that spent the largest share of its phase time updating metrics
        "metrics_percent": max(100 * getattr(r, "metrics_seconds", 0.0) / r.wall_seconds if r.wall_seconds > 0
                               else 0.0 for r in runs),
        "qps_series": [(t, q * world) for t, q in qps_series(runs[0].times, batch_size)],
        "loss_series": list(runs[0].losses),
    }


def gain_percent(baseline: float, optimized: float) -> float:
    """``100 * (optimized / baseline - 1)``; NaN when the baseline is 0 or missing."""
    if not baseline or math.isnan(baseline):
        return float("nan")
    return 100.0 * (optimized / baseline - 1.0)
