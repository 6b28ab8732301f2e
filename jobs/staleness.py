"""Bounded staleness in a job: ``[phases] max_staleness`` and its quality-tolerance parity check.

With ``[phases] max_staleness = k`` (k >= 1) the optimized phase's ``async_rpc_prefetch`` pass runs as
``scheduling.async_rpc(gm, prefetch=True, max_staleness=k)`` (:func:`optimized_passes`): each step starts the
next step's lookups right after its own, before its gradient push, and pushes stay in flight past the end of the
step. Those prefetched lookups miss this step's push, so the optimized phase trains on embedding rows one step
stale. With the job's step-ordered servers (``scheduling.ps.ordering``: a lookup is answered after every push
issued before it, by every trainer) the staleness is exactly one step for any k >= 1, and deterministic; k bounds
the pushes a client leaves in flight. The baseline phase is unchanged and exact: its own tables and client,
blocking lookups, pushes waited in the step. "Exact" below is the baseline phase, trained over the same batches in
the alternating blocks of ``[phases] block_steps``.

The optimized phase's losses then differ from the baseline's from the second step on, so bit-identical losses
(``jobs.stats.parity_check``) no longer apply: :func:`staleness_parity` accepts the optimized phase when its
held-out AUC is within ``[phases] staleness_tolerance`` of the baseline's (RMSE, or the held-out mean loss, for
a job without an AUC). Its record, ``parity`` of results.json::

    {"rule": "quality_tolerance", "metric": "auc", "metrics": ["auc"], "max_staleness": 1,
     "exact": 0.7565, "stale": 0.7561, "abs_diff": 0.0004, "tolerance": 0.002, "ok": true,
     "loss_exact": 0.47, "loss_stale": 0.47, "max_step_loss_diff": 0.03, "identical_losses": false,
     "mode": "error", "passes": ["async_rpc_prefetch"]}

(``mode`` and ``passes`` are added by ``jobs.launcher.launch.compare_phases``, as for the exact check.)

Source: Ho et al., "More Effective Distributed ML via a Stale Synchronous Parallel Parameter Server" (NIPS 2013),
§2 (bounded staleness); Li et al., "Scaling Distributed Machine Learning with the Parameter Server" (OSDI 2014),
§4.2 (bounded delay); ``scheduling/async_rpc_pass.py``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from jobs.records import Parity

__all__ = ["PREFETCH_PASS", "RULE", "optimized_passes", "staleness_errors", "staleness_parity", "parity_line",
           "parity_problem"]

PREFETCH_PASS = "async_rpc_prefetch"
"""The pass of ``[phases] passes`` that ``max_staleness`` turns into a stale prefetch."""
RULE = "quality_tolerance"
"""``parity["rule"]`` of a staleness parity record (the exact check's record has no ``rule``)."""
_LABELS = {"auc": "AUC", "rmse": "RMSE", "eval_loss": "eval loss"}


def optimized_passes(passes: list[str], max_staleness: int) -> list[str | Callable]:
    """The optimized phase's passes for ``fxdist.optimize``: ``passes`` as named, except that with
    ``max_staleness >= 1`` the ``async_rpc_prefetch`` name becomes ``async_rpc(prefetch=True,
    max_staleness=max_staleness)`` (a callable whose pass record is named ``async_rpc_prefetch(max_staleness=k)``).

    >>> optimized_passes(["async_rpc_prefetch"], 0)
    ['async_rpc_prefetch']
    >>> optimized_passes(["async_rpc_prefetch"], 1)[0].name
    'async_rpc_prefetch(max_staleness=1)'
    """
    if max_staleness <= 0:
        return list(passes)
    from scheduling.async_rpc_pass import NO_RPC, async_rpc

    stale = functools.partial(async_rpc, prefetch=True, max_staleness=max_staleness)
    stale.name = f"{PREFETCH_PASS}(max_staleness={max_staleness})"  # type: ignore[attr-defined]
    stale.fxdist_no_op_reason = NO_RPC  # type: ignore[attr-defined]
    return [stale if p == PREFETCH_PASS else p for p in passes]


def staleness_errors(config: Any) -> list[str]:
    """What is wrong with ``[phases] max_staleness`` in a :class:`jobs.config.JobConfig` (none when it is 0): it
    needs parameter servers (staleness is in their lookups), ``async_rpc_prefetch`` in ``[phases] passes``,
    and a held-out quality metric to compare (not ``[data] eval_fraction = 0``)."""
    k = config.phases.max_staleness
    if k == 0:
        return []
    errors = []
    if config.cluster.parameter_servers == 0:
        errors.append(f"[phases] max_staleness = {k} needs parameter servers ([cluster] parameter_servers >= 1): "
                      "stale lookups are parameter-server lookups")
    if PREFETCH_PASS not in config.phases.passes:
        errors.append(f"[phases] max_staleness = {k} needs {PREFETCH_PASS!r} in [phases] passes (it runs as "
                      f"async_rpc(prefetch=True, max_staleness={k})); passes = {list(config.phases.passes)}")
    if config.data.eval_fraction == 0:
        errors.append(f"[phases] max_staleness = {k} needs held-out data for its parity check "
                      "([data] eval_fraction > 0)")
    return errors


def staleness_parity(baseline: Any, optimized: Any, *, max_staleness: int, tolerance: float) -> Parity:
    """Parity of a stale optimized phase: its held-out metric within ``tolerance`` of the exact baseline's.

    Args:
        baseline, optimized: phase summaries (``jobs.stats.phase_summary`` plus ``quality``, a
            :class:`jobs.results.PhaseResult` or its dict); ``quality`` holds ``auc``, else ``rmse`` or
            ``eval_loss``, the metric compared (a missing or NaN value fails the check).
        max_staleness: ``[phases] max_staleness`` (recorded).
        tolerance: largest accepted ``|optimized - baseline|`` of the metric, in its units (AUC: a fraction).

    Returns:
        The record of the module docstring: ``ok`` is ``abs_diff <= tolerance``; the losses are information only
        (the stale phase's per-step losses differ by design).

    Raises:
        ValueError: ``tolerance`` negative or not finite.
    """
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"staleness_parity: tolerance must be a finite number >= 0, got {tolerance!r}")
    qb, qo = baseline.get("quality") or {}, optimized.get("quality") or {}
    metric = next((m for m in ("auc", "rmse", "eval_loss") if m in qb), "auc")
    exact, stale = _number(qb.get(metric)), _number(qo.get(metric))
    diff = abs(stale - exact)
    series_b, series_o = baseline.get("loss_series") or [], optimized.get("loss_series") or []
    pairs = list(zip(series_b, series_o))
    return {"rule": RULE, "metric": metric, "metrics": [metric], "max_staleness": max_staleness,
            "exact": exact, "stale": stale, "abs_diff": diff, "tolerance": tolerance,
            "ok": bool(not math.isnan(diff) and diff <= tolerance),
            "loss_exact": _number(baseline.get("loss")), "loss_stale": _number(optimized.get("loss")),
            "max_step_loss_diff": max((abs(x - y) for x, y in pairs), default=float("nan")),
            "identical_losses": bool(pairs) and len(series_b) == len(series_o) and all(x == y for x, y in pairs)}


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else float("nan")


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def parity_line(parity: Parity, verdict: str) -> str:
    """The results table's parity line for a staleness record (``verdict``: "OK", "FAILED" or "WARNING").

    >>> parity_line({"metric": "auc", "stale": 0.7561, "exact": 0.7565, "abs_diff": 0.0004, "tolerance": 0.002,
    ...              "ok": True, "max_staleness": 1, "max_step_loss_diff": 0.0312, "passes": ["async_rpc_prefetch"]},
    ...             "OK")  # doctest: +NORMALIZE_WHITESPACE
    'parity of the optimized phase (async_rpc_prefetch): OK: AUC 0.7561 vs exact 0.7565
     (|diff| 0.0004 <= 0.002, max_staleness=1); largest per-step loss difference 3.12e-02 (stale lookups)'
    """
    passes = ", ".join(parity.get("passes", [])) or "no passes"
    return (f"parity of the optimized phase ({passes}): {verdict}: {_quality(parity)}; largest per-step loss "
            f"difference {_fmt(parity.get('max_step_loss_diff'), '.2e')} (stale lookups)")


def _quality(parity: Parity) -> str:
    label = _LABELS.get(parity.get("metric", "auc"), parity.get("metric", "auc"))
    return (f"{label} {_fmt(parity.get('stale'), '.4f')} vs exact {_fmt(parity.get('exact'), '.4f')} "
            f"(|diff| {_fmt(parity.get('abs_diff'), '.4f')} {'<=' if parity.get('ok') else '>'} "
            f"{_fmt(parity.get('tolerance'), 'g')}, max_staleness={parity.get('max_staleness')})")


def parity_problem(parity: Parity) -> str:
    """What a failed staleness parity check found, in words (for the job's error message).

    >>> parity_problem({"metric": "rmse", "stale": 0.99, "exact": 0.95, "abs_diff": 0.04, "tolerance": 0.002,
    ...                 "ok": False, "max_staleness": 2})
    'lost more quality than [phases] staleness_tolerance allows: RMSE 0.9900 vs exact 0.9500 (|diff| 0.0400 > 0.002, max_staleness=2)'
    """
    return f"lost more quality than [phases] staleness_tolerance allows: {_quality(parity)}"
