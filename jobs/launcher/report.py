"""A job's results: the printed table, ``results.json`` and ``qps.png``.

The results are a :class:`jobs.results.JobResults` (as returned by :func:`jobs.launcher.launch.launch`): its fields,
with their units, are the keys of ``results.json`` (:mod:`jobs.results`). The functions here read them with
``results.get(key)`` / ``results[key]``, so a results dict of the same keys (a test's fixture) reads the same.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from jobs import staleness
from jobs.cluster import placement_lines
from jobs.records import Parity, Within
from jobs.results import InferenceResult, JobResults, PhaseResult, strict_json
from jobs.stats import gain_percent
from jobs.trainer.lookups import prefetch_lines

__all__ = ["table", "write", "plot", "to_json", "parity_problem", "counted", "dynamic_line"]


def counted(n: Any, noun: str) -> str:
    """``"1 trainer"``, ``"2 trainers"``, ``"0 parameter servers"`` (``noun`` singular; plural adds an s)."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _fmt(value: Any, spec: str = ".1f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _gain(results: JobResults) -> float:
    """The reported QPS gain, percent: the median of the interleaved block pairs (``results["gain"]``), else
    the ratio of the two phases' QPS."""
    gain = results.get("gain") or {}
    if gain.get("median_percent") is not None:
        return gain["median_percent"]
    phases = results.get("phases", {})
    if "baseline" not in phases or "optimized" not in phases:
        return float("nan")
    return gain_percent(phases["baseline"]["qps"], phases["optimized"]["qps"])


def _gain_lines(results: JobResults) -> list[str]:
    gain = results.get("gain") or {}
    line = f"QPS gain, optimized vs baseline: {_fmt(_gain(results), '+.1f')} %"
    if gain.get("blocks"):
        line += (f" (median of {gain['blocks']} paired blocks of the same steps; range "
                 f"{_fmt(gain['min_percent'], '+.1f')} .. {_fmt(gain['max_percent'], '+.1f')} %")
        if gain.get("low_percent") is not None:
            line += (f", {100 * gain['confidence']:.0f} % interval {_fmt(gain['low_percent'], '+.1f')} .. "
                     f"{_fmt(gain['high_percent'], '+.1f')} %")
        line += ")"
    return [line]


def parity_problem(parity: Parity) -> str:
    """What the parity check found wrong, in words (for the error message)."""
    if parity.get("rule") == staleness.RULE:
        return staleness.parity_problem(parity)
    checked = {name: _checked(parity, name) for name in (*_metrics(parity), "loss")}
    bad = [f"{name} {c['optimized']:.4f} vs baseline {c['baseline']:.4f} (difference "
           f"{c['diff']:+.4f}, tolerance {_fmt(c['tolerance'], '.4f')})"
           for name, c in checked.items() if not c["ok"]]
    return "differs from the baseline: " + "; ".join(bad) if bad else "matches the baseline"


def _parity_lines(results: JobResults) -> list[str]:
    parity = results.get("parity")
    if not parity:
        return []
    verdict = "OK" if parity["ok"] else ("FAILED" if parity.get("mode") == "error" else "WARNING")
    if parity.get("rule") == staleness.RULE:  # [phases] max_staleness: held-out quality within a tolerance
        return [staleness.parity_line(parity, verdict)]
    same = ("per-step losses bit-identical" if parity["identical_losses"]
            else f"largest per-step loss difference {_fmt(parity['max_step_loss_diff'], '.2e')}")
    metric = _metrics(parity)[0]
    a, lo = _checked(parity, metric), parity["loss"]
    return [f"parity of the optimized phase ({', '.join(parity.get('passes', [])) or 'no passes'}): {verdict}: "
            f"{same}; {_LABELS.get(metric, metric)} diff {_fmt(a['diff'], '+.4f')} (tolerance "
            f"{_fmt(a['tolerance'], '.4f')}), loss diff {_fmt(lo['diff'], '+.4f')} (tolerance "
            f"{_fmt(lo['tolerance'], '.4f')}), tolerances 2 standard errors of the baseline's"]


_LABELS = {"auc": "AUC", "log_loss": "logloss", "rmse": "RMSE", "mae": "MAE", "eval_loss": "eval loss"}
_COLUMNS = {"auc": ("auc", "log_loss"), "rmse": ("rmse", "mae"), "eval_loss": ("eval_loss",)}
"""The held-out metric of a phase's quality -> the columns of the results table."""


def _metrics(parity: Parity) -> list[str]:
    return list(parity.get("metrics") or ["auc"])


def _checked(parity: Parity, name: str) -> Within:
    """The parity record's check of ``name`` (a held-out metric, or ``loss``)."""
    checks = {"auc": parity.get("auc"), "rmse": parity.get("rmse"), "eval_loss": parity.get("eval_loss"),
              "loss": parity.get("loss")}
    found = checks.get(name)
    if found is None:
        raise KeyError(name)
    return found


def _columns(results: JobResults) -> tuple[str, ...]:
    """The quality columns of the table: AUC and log loss, RMSE and MAE, or the held-out loss (and the AUC and
    log loss of a binary-label model with its own loss, :func:`jobs.entry.binary_score`)."""
    for p in results.get("phases", {}).values():
        q = p.get("quality") or {}
        if "eval_loss" in q:
            return _COLUMNS["eval_loss"] + (_COLUMNS["auc"] if "auc" in q else ())
        for key, columns in _COLUMNS.items():
            if key in q:
                return columns
    return _COLUMNS["auc"]


def table(results: JobResults) -> str:
    """The human-readable summary printed at the end of a job (``results``: a :class:`JobResults`, or a dict of its
    keys)."""
    cfg = results.get("config", {})
    c, j = cfg.get("cluster", {}), cfg.get("job", {})
    cols = _columns(results)
    heads = "".join(f" {_LABELS[k]:>8}" for k in cols)
    lines = [
        f"fxdist job {results.get('job')}: {counted(c.get('trainers'), 'trainer')}, "
        f"{counted(c.get('parameter_servers'), 'parameter server')}"
        f"{' (in the trainers)' if (results.get('servers_in_trainers') or {}).get('chosen') else ''}, "
        f"{j.get('steps')} steps per phase, "
        f"batch {j.get('batch_size')} per trainer"
        + (f", emulated server latency {c.get('server_fetch_delay_ms')} ms per lookup"
           if c.get("parameter_servers") and c.get("server_fetch_delay_ms") else ""),
        "",
        f"{'phase':<10} {'QPS':>10} {'step p50':>9} {'step p99':>9} {'lookup p50':>11} {'lookup p99':>11} "
        f"{'loss':>7}{heads}",
        f"{'':<10} {'samples/s':>10} {'ms':>9} {'ms':>9} {'ms':>11} {'ms':>11}",
    ]
    for name, p in results.get("phases", {}).items():
        q = p.get("quality", {})
        lines.append(
            f"{name:<10} {_fmt(p.get('qps')):>10} {_fmt(p.get('step_p50_ms'), '.2f'):>9} "
            f"{_fmt(p.get('step_p99_ms'), '.2f'):>9} {_fmt(p.get('lookup_p50_ms'), '.3f'):>11} "
            f"{_fmt(p.get('lookup_p99_ms'), '.3f'):>11} {_fmt(p.get('loss'), '.4f'):>7}"
            + "".join(f" {_fmt(q.get(k), '.4f'):>8}" for k in cols)
        )
    lines += _quality_notes(results, j.get("steps"), cols)
    shares = {name: p["metrics_percent"] for name, p in results.get("phases", {}).items()
              if p.get("metrics_percent") is not None}
    if shares and (cfg.get("metrics") or {}).get("enabled", True):
        lines.append("metrics updates in the training loop (largest trainer share of phase time): "
                     + ", ".join(f"{name} {_fmt(v, '.3f')} %" for name, v in shares.items()))
    lines += _dynamic_lines(results)
    lines += ["", *_gain_lines(results), *_parity_lines(results)]
    opt = results.get("phases", {}).get("optimized", {}).get("optimize", {})
    if opt:
        ran = ", ".join(f"{r['name']} ({counted(r.get('nodes_added', 0), 'graph node')} added, "
                        f"{r.get('nodes_erased', 0)} removed)" for r in opt.get("passes", [])) or "none"
        lines.append(f"passes run: {ran}" + (f"; FELL BACK TO EAGER: {opt['fallback']}" if opt.get("fallback") else ""))
        if opt.get("placement"):  # your model's tables, moved by the parameter_servers pass
            lines += opt["placement"].splitlines()
        # per lookup: prefetched, or why not (jobs.trainer.lookups)
        lines += prefetch_lines(results["phases"]["optimized"])
    lines += _inference_lines(results.get("inference"), cols)
    parse = (results.get("data") or {}).get("parse") or {}
    if parse:
        bad = sum(parse.get("malformed", {}).values())
        detail = ", ".join(f"{k}: {v}" for k, v in parse.get("malformed", {}).items())
        lines += ["", f"data: {parse.get('valid')} valid lines, {bad} malformed skipped" + (f" ({detail})" if bad else "")]
        lines += _reader_lines(results)
        epochs = next((p.get("epochs") for p in results.get("phases", {}).values() if p.get("epochs")), None)
        if epochs:
            lines.append(f"each phase passes {epochs:.1f} times over each trainer's shard")
    if results.get("restarts"):
        lines.append(f"restarts from checkpoint: {results['restarts']} (faults injected: {results.get('faults_fired')})")
    lines += placement_lines(results)  # where each trainer and server ran (jobs.cluster)
    return "\n".join(lines)


def dynamic_line(tables: dict[str, dict[str, int]]) -> str:
    """One line of a phase's dynamic tables (``PhaseResult.dynamic_tables``): how many, their rows against their
    capacity, the evictions and ids turned away.

    >>> dynamic_line({"t_C1": {"rows": 2871, "capacity": 3000, "evictions": 41000, "rejected": 0},
    ...               "t_C2": {"rows": 3000, "capacity": 3000, "evictions": 233, "rejected": 5}})
    'dynamic tables: 2, rows 2,871-3,000 of capacity 3,000; 41,233 evictions, 5 lookups/pushes without a row'
    """
    rows = [t["rows"] for t in tables.values()]
    caps = sorted({t["capacity"] for t in tables.values()})
    cap = f"{caps[0]:,}" if len(caps) == 1 else f"{caps[0]:,}-{caps[-1]:,}"
    rejected = sum(t.get("rejected", 0) for t in tables.values())
    return (f"dynamic tables: {len(tables)}, rows {min(rows):,}-{max(rows):,} of capacity {cap}; "
            f"{sum(t.get('evictions', 0) for t in tables.values()):,} evictions"
            + (f", {rejected:,} lookups/pushes without a row" if rejected else ""))


def _dynamic_lines(results: JobResults) -> list[str]:
    """The last phase's dynamic tables (:func:`dynamic_line`); nothing without them."""
    phases = [p for p in results.get("phases", {}).values() if p.get("dynamic_tables")]
    return [dynamic_line(phases[-1]["dynamic_tables"])] if phases else []


def _reader_lines(results: JobResults) -> list[str]:
    """Parse throughput of the first pass and of the trainers' readers, next to the training QPS."""
    out = []
    scan = (results.get("data") or {}).get("scan") or {}
    if scan.get("lines_per_s"):
        out.append(f"first pass: {scan['lines']} lines in {scan['files']} file(s), {_fmt(scan['lines_per_s'], ',.0f')} "
                   f"lines/s (one process); shards {scan.get('sharding')}")
    phases = results.get("phases", {})
    reader = next((p["reader"] for p in phases.values() if p.get("reader")), None)
    if reader:
        qps = max((p.get("qps") or 0 for p in phases.values()), default=0)
        out.append(f"reader: {_fmt(reader['lines_per_s'], ',.0f')} lines/s per worker, {reader['workers']} worker(s) "
                   f"per trainer, {_fmt(reader['capacity_lines_per_s'], ',.0f')} lines/s in all vs training "
                   f"{_fmt(qps, ',.0f')} samples/s")
    return out


def _inference_lines(inf: InferenceResult | None, cols: tuple[str, ...]) -> list[str]:
    """The fp32-vs-int8 comparison (or why there is none)."""
    if not inf:
        return []
    if inf.get("skipped"):
        return ["", f"int8 comparison: {inf['skipped']}"]
    at = f", model after step {inf['model_step']}" if inf.get("model_step") is not None else ""
    lines = ["", f"inference on {inf['rows']} held-out rows (batch {inf['batch_size']}, {inf['threads']} thread{at}): "
                 f"{inf['method']}",
             f"{'':<10} {'QPS':>10}" + "".join(f" {_LABELS[k]:>8}" for k in cols)]
    for name in ("fp32",) if inf.get("kept_fp32") else ("fp32", "int8"):
        r = inf[name]
        lines.append(f"{name:<10} {_fmt(r['qps']):>10}" + "".join(f" {_fmt(r.get(k), '.4f'):>8}" for k in cols))
    if inf.get("layers") is not None:  # quant.select_int8 (main's jobs.launcher.inference): per-layer µs per call
        lines.append(f"int8 layer selection on this CPU ({inf.get('isa')}), µs per call fp32 / int8: " + "; ".join(
            f"{x['target']} {_fmt(x['fp32_us'])} / {_fmt(x['int8_us'])} -> {'int8' if x['chosen'] else 'fp32'}"
            for x in inf["layers"]))
    note = f" ({inf['note']})" if inf.get("note") else ""
    lines.append(f"int8 speed-up: {_fmt(inf['speedup'], '.2f')}x{note}")
    if inf.get("output_max_abs_diff") is not None and not inf.get("kept_fp32"):
        lines.append(f"int8 outputs differ from fp32 by at most {inf['output_max_abs_diff']:.3g} (every output leaf)")
    if inf.get("device_note"):
        lines.append(f"int8 comparison: {inf['device_note']}")
    return lines


def _quality_notes(results: JobResults, steps: Any, cols: tuple[str, ...] = _COLUMNS["auc"]) -> list[str]:
    """What the quality columns (AUC / logloss, or RMSE / MAE...) refer to, and the end-of-phase values when
    those differ."""
    phases = results.get("phases", {})
    first: PhaseResult | None = next(iter(phases.values()), None)
    if first is None or "quality_step" not in first:
        return []
    rows = (first.get("quality") or {}).get("rows")
    step, epochs = first["quality_step"], first.get("quality_epochs")
    lines = [f"{', '.join(_LABELS[k] for k in cols)}: {rows} held-out rows, model after step {step} of {steps}"
             + (f" ({epochs:.2f} epochs over each trainer's shard)" if epochs is not None else "")]
    if step != steps:
        ends = ", ".join(f"{name} " + " ".join(f"{_LABELS[k]} {_fmt((p.get('quality_end') or {}).get(k), '.4f')}"
                                               for k in cols)
                         for name, p in phases.items())
        lines.append(f"  at the phase end (step {steps}, {_fmt(first.get('epochs'), '.1f')} epochs): {ends}")
    q = first.get("quality") or {}
    if q.get("score") or q.get("score_note"):  # a binary-label model with its own loss (jobs.entry.binary_score)
        lines.append(f"  AUC, logloss: the score is {q['score']}" if q.get("score") else f"  {q['score_note']}")
    for name, p in phases.items():
        mine = (p.get("quality") or {}).get("metric")
        if mine:
            lines.append(f"  [train] metric, {name}: " + ", ".join(f"{k} {_fmt(v, '.4f')}" for k, v in mine.items()))
    return lines


to_json = strict_json
"""``value`` with NaN/inf floats as None and tuples as lists (strict JSON): :func:`jobs.results.strict_json`."""


def plot(results: JobResults, path: Path) -> Path:
    """PNG of job QPS over time (seconds since each phase started), one line per phase, and the loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_qps, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
    for name, p in results.get("phases", {}).items():
        series = p.get("qps_series") or []
        if series:
            t, q = zip(*series)
            ax_qps.plot(t, q, label=f"{name} (mean {_fmt(p.get('qps'), '.0f')} samples/s)")
        losses = p.get("loss_series") or []
        ax_loss.plot(range(1, len(losses) + 1), losses, label=name)
    ax_qps.set(title=f"{results.get('job')}: training QPS", xlabel="seconds since phase start",
               ylabel="samples/s (all trainers)")
    ax_loss.set(title="training loss (rank 0)", xlabel="step", ylabel=(results.get("config", {}).get("train") or {}).get("loss", "bce_with_logits"))
    for ax in (ax_qps, ax_loss):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write(results: JobResults | dict[str, Any], run_dir: Path) -> JobResults:
    """Write ``results.json`` and ``qps.png`` into ``run_dir``: ``results`` (a dict is read by
    :meth:`JobResults.from_json`) with ``gain_percent`` (%, :func:`_gain`) set.

    Returns:
        The results written.

    Raises:
        jobs.results.ResultsError: a results dict with a key the schema does not know, or without a required one.
    """
    read = JobResults.from_json(results)
    typed = dataclasses.replace(read, gain_percent=_gain(read))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "results.json").write_text(json.dumps(typed.to_json(), indent=2) + "\n")
    plot(typed, run_dir / "qps.png")
    return typed
