"""Benchmark of the job at scale: QPS and peak RSS per process vs table rows, parse vs training throughput,
and the parameter servers' storage forms (fp32, fp16, fused 8-bit).

Every point is one end-to-end ``fxdist launch`` (a subprocess, config overrides with ``--set``) whose
``results.json`` is read back, so the script measures what a user runs and keeps working while the job's
internals change. Each run trains only the optimized phase (``[phases] baseline = false``, passes
``async_rpc_prefetch``) of the built-in DLRM with the job's 2 trainers and 1 parameter server (Ray, this
host), no mid-phase checkpoints and no int8 comparison; QPS is the phase's samples/s over the timed
training steps (``phases.optimized.qps``). The data are ``fxdist data synth`` lines (Zipf ids over Criteo
Kaggle's per-feature cardinalities, seed 0), written once to a temporary folder and deleted at the end.

1. Rows: ``[model] table_size`` = 10^4, 10^5, 10^6 (26 tables each) and 10^7, rows held in fused 8-bit
   form (``[model] server_storage = "fused8bit"``). 26 tables x 10^7 rows cannot fit on a 24 GB machine in
   any storage form (the final checkpoint holds float32 copies of them), so the 10^7 point uses the
   Criteo Kaggle-like layout: ``[model] table_sizes`` = Criteo Kaggle's per-feature cardinalities capped at
   10^7 rows (5 features get millions of rows, C3 10^7), when the job has that key; it is skipped with the
   reason otherwise. Printed per point: job QPS, peak RSS of every process (``results.json`` ``processes``: each
   trainer, each server, the launcher; ``getrusage`` ``ru_maxrss``), and the bytes the server holds
   (``PSServer.memory()``, the ``fxdist_ps_bytes`` gauge: stored rows + row-wise Adagrad state); ratios
   against the smallest point. Then each cost's growth: the least-squares slope of log(cost) vs
   log(total rows held) and its factor per doubling of the rows (``2 ** slope``).
0. Reader: the launcher's first pass over all the lines (``recsys.criteo_shard.scan``, one process) with the
   strict numpy parser alone and with the Arrow fast path (``recsys.criteo_arrow``), interleaved rounds: lines/s
   and the ratio.
2. Parse vs train: the job on all the lines (1M; ``--quick``: 100k): the reader's parse throughput in
   lines/s (from ``results.json`` when the reader reports it, else timed here with the job's own parser,
   ``recsys.criteo_shard.CriteoShard``, on one core) against the job's training QPS (samples/s = lines/s).
3. Storage: fp32, fp16 and fused 8-bit server rows at 10^6 rows a table (``--quick``: 10^5), same data and
   seed: server bytes, the server's peak RSS, QPS and held-out AUC, with ratios against fp32.

Before each run the job's memory estimate (``jobs.launcher.checks.estimate_memory``, the same one ``fxdist
launch`` checks) plus a 4 GiB margin is compared with the memory available now (``psutil``); a point that
would not fit is skipped with the reason printed (the machine may be shared).

Usage::

    .venv/bin/python benchmarks/scale.py [--quick] [--steps N] [--metrics-port 9520] [--keep]

Allocator: runs with ``MALLOC_MMAP_THRESHOLD_=33554432`` (re-executes itself to set it: glibc's
defaults page-fault on every batch); the job's processes inherit it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's packages (jobs, scheduling), not the benchmark scripts

GIB, MIB = 2**30, 2**20
MARGIN_BYTES = 4 * GIB
"""Memory left free beside a run's estimate (the machine is shared)."""
BASE_SETS = {"job.progress": "false", "job.checkpoint_every": "0", "job.eval_epochs": "0",
             "job.batch_size": "256", "phases.baseline": "false", "phases.passes": '["async_rpc_prefetch"]',
             "quant.enabled": "false"}
"""Overrides of every run (see the module docstring)."""


def _ensure_allocator() -> None:
    import _bench  # this folder is sys.path[0] when run as a script

    _bench.reexec_with_fixed_allocator()


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def fxdist(args: list[str], timeout_s: float = 900) -> subprocess.CompletedProcess:
    """Run ``fxdist ARGS`` (``python -m jobs.launcher.cli``) from this checkout; returns the finished process."""
    return subprocess.run([sys.executable, "-m", "jobs.launcher.cli", *args], capture_output=True, text=True,
                          env=_env(), cwd=ROOT, timeout=timeout_s)


def model_keys() -> set[str]:
    """The ``[model]`` keys of the job's config (``fxdist config``)."""
    out, keys, table = fxdist(["config"], 120).stdout, set(), ""
    for line in out.splitlines():
        if line.startswith("["):
            table = line.strip("[]")
        elif table == "model" and "=" in line:
            keys.add(line.partition("=")[0].strip())
    return keys


def synthesize(lines: int, out: Path) -> Path:
    """``fxdist data synth --lines LINES --out OUT`` (one plain file); returns the file."""
    t0 = time.perf_counter()
    proc = fxdist(["data", "synth", "--lines", str(lines), "--out", str(out), "--seed", "0"], 1800)
    if proc.returncode != 0:
        raise RuntimeError(f"fxdist data synth failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    (path,) = sorted(out.glob("train_*"))
    print(f"data: {lines:,} synthetic Criteo lines (fxdist data synth, seed 0) in {time.perf_counter() - t0:.0f} s: "
          f"{path.stat().st_size / MIB:.0f} MiB")
    return path


def head(src: Path, dst: Path, lines: int) -> Path:
    """The first ``lines`` lines of ``src`` as ``dst``."""
    with src.open("rb") as f, dst.open("wb") as g:
        for _, line in zip(range(lines), f):
            g.write(line)
    return dst


def _sets(sets: dict[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in sets.items()]


def estimate_bytes(sets: dict[str, str]) -> int | None:
    """The job's own peak-memory estimate for these overrides (``jobs.launcher.checks.estimate_memory``), or
    None when it cannot be computed here."""
    try:
        from jobs.config import load_config
        from jobs.launcher import checks
        from jobs.launcher.cli import apply_overrides

        return int(checks.estimate_memory(apply_overrides(load_config(), _sets(sets))).total_bytes)
    except Exception as e:  # noqa: BLE001 - the estimate only decides whether to skip
        print(f"  (no memory estimate: {type(e).__name__}: {e})")
        return None


def available_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def run_job(sets: dict[str, str], work: Path, label: str) -> dict | str:
    """One ``fxdist launch`` with ``BASE_SETS`` and ``sets``; returns its results, or why it was skipped or
    failed (its run folder is deleted either way)."""
    all_sets = {**BASE_SETS, **sets}
    need, free = estimate_bytes(all_sets), available_bytes()
    if need is not None and need + MARGIN_BYTES > free:
        return (f"skipped: the job's estimate {need / GIB:.1f} GiB + {MARGIN_BYTES / GIB:.0f} GiB margin > "
                f"{free / GIB:.1f} GiB available now")
    run_dir = work / f"run-{label}"
    args = ["launch", "--quiet", "--run-dir", str(run_dir)] + [a for s in _sets(all_sets) for a in ("--set", s)]
    t0 = time.perf_counter()
    try:
        proc = fxdist(args)
        results_path = run_dir / "results.json"
        if proc.returncode != 0 or not results_path.exists():
            tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-3:]
            return f"failed (exit {proc.returncode}): " + " | ".join(tail)
        results = json.loads(results_path.read_text())
        results["bench_wall_seconds"] = time.perf_counter() - t0
        results["bench_estimate_bytes"] = need
        return results
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def processes(results: dict) -> dict[str, dict]:
    """``results.json`` ``processes`` in the order trainers, servers, launcher."""
    procs = results.get("processes") or {}
    order = {"trainer": 0, "ps": 1, "launcher": 2}
    return dict(sorted(procs.items(), key=lambda kv: (order.get(kv[0].rstrip("0123456789"), 3),
                                                       int("0" + "".join(c for c in kv[0] if c.isdigit())))))


def qps(results: dict) -> float:
    return results["phases"]["optimized"]["qps"]


def total_rows(results: dict) -> int:
    """Rows held: the servers' own count (``processes.ps<i>.rows``), else 26 x ``table_size``."""
    rows = sum(p.get("rows", 0) for n, p in processes(results).items() if n.startswith("ps"))
    return rows or 26 * int(results["config"]["model"]["table_size"])


def server_bytes(results: dict) -> int:
    return sum(p.get("bytes", 0) for n, p in processes(results).items() if n.startswith("ps"))


def fit_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log2(y) vs log2(x) (NaN with fewer than 2 points)."""
    if len(xs) < 2:
        return float("nan")
    lx, ly = [math.log2(x) for x in xs], [math.log2(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((x - mx) ** 2 for x in lx)
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / den if den else float("nan")


def _secs(t: float | None) -> str:
    return "-" if t is None else f"{t:.0f} s"


def kaggle_layout(cap: int) -> list[int]:
    """Criteo Kaggle's per-feature cardinalities capped at ``cap`` rows (:data:`recsys.criteo_synth.CRITEO_KAGGLE_CARDINALITIES`)."""
    from recsys.criteo_synth import CRITEO_KAGGLE_CARDINALITIES

    return [max(2, min(c, cap)) for c in CRITEO_KAGGLE_CARDINALITIES]


def rows_section(data: Path, sizes: list[int], steps: int, port: int, work: Path, keys: set[str]) -> list[dict]:
    """Part 1: one run per table size; prints a row per run; returns the results of the runs that ran."""
    print(f"\n1. QPS and peak RSS per process vs rows a table (server_storage fused8bit, {steps} steps, "
          f"data {data.name})")
    done = []
    for size in sizes:
        sets = {"data.path": f'"{data}"', "model.server_storage": '"fused8bit"', "job.steps": str(steps),
                "metrics.port": str(port), "model.table_size": str(size)}
        layout = f"26 x {size:,}"
        if size > 10**6:  # 26 x 10^7 rows: a float32 checkpoint copy alone is ~17 GiB
            if "table_sizes" not in keys:
                print(f"  10^{round(math.log10(size))}: skipped: 26 tables x {size:,} rows need ~"
                      f"{26 * size * 68 / GIB:.0f} GiB per float32 checkpoint copy, and this job has no "
                      "[model] table_sizes key for the Criteo Kaggle-like layout")
                continue
            sizes_list = kaggle_layout(size)
            sets["model.table_sizes"] = "[" + ", ".join(map(str, sizes_list)) + "]"
            layout = (f"Kaggle-like: min(cardinality, {size:,}), {sum(n > 10**6 for n in sizes_list)} tables "
                      f"over 10^6")
        results = run_job(sets, work, f"rows{size}")
        if isinstance(results, str):
            print(f"  10^{round(math.log10(size))} ({layout}): {results}")
            continue
        results["bench_size"], results["bench_layout"] = size, layout
        done.append(results)
        _print_rows_line(results, done[0])
    return done


def load_seconds(results: dict) -> float | None:
    """Seconds rank 0 spent reading its data and creating the tables (the job's timeline), or None."""
    times = {}
    for t, what in results.get("timeline", []):
        for key in ("training loop started", "data loaded"):
            if key in what and key not in times:
                times[key] = t
    return times["data loaded"] - times["training loop started"] if len(times) == 2 else None


def _print_rows_line(r: dict, first: dict) -> None:
    procs = processes(r)
    rss = "  ".join(f"{n} {p['peak_rss_bytes'] / MIB:.0f}" for n, p in procs.items())
    total = sum(p["peak_rss_bytes"] for p in procs.values())
    estimate = "-" if r["bench_estimate_bytes"] is None else f"{r['bench_estimate_bytes'] / MIB:.0f}"
    print(f"  10^{round(math.log10(r['bench_size']))} ({r['bench_layout']}): rows held {total_rows(r):,}, "
          f"server holds {server_bytes(r) / MIB:.0f} MiB, run {r['bench_wall_seconds']:.0f} s "
          f"(data + tables {_secs(load_seconds(r))})\n"
          f"      QPS {qps(r):7.0f} (x{qps(r) / qps(first):.2f})   peak RSS MiB: {rss}   all {total / MIB:.0f} "
          f"(x{total / sum(p['peak_rss_bytes'] for p in processes(first).values()):.2f}; job's estimate {estimate})")


def growth(done: list[dict]) -> None:
    """Print each cost's log-log slope vs rows held and its factor per doubling."""
    if len(done) < 2:
        print("  growth: fewer than 2 points ran")
        return
    xs = [total_rows(r) for r in done]
    costs = {"QPS (samples/s)": [qps(r) for r in done],
             "server bytes held": [server_bytes(r) for r in done]}
    names = list(processes(done[0]))
    for name in names:
        if all(name in processes(r) for r in done):
            costs[f"peak RSS {name}"] = [processes(r)[name]["peak_rss_bytes"] for r in done]
    costs["peak RSS, all processes"] = [sum(p["peak_rss_bytes"] for p in processes(r).values()) for r in done]
    lo, hi = min(xs), max(xs)
    print(f"  growth vs rows held ({len(done)} points, {lo:,} .. {hi:,} rows; least-squares log-log slope):")
    print(f"    {'cost':28s} {'at fewest':>12s} {'at most':>12s} {'exponent':>9s} {'per doubling':>13s}")
    for name, ys in costs.items():
        if min(ys) <= 0:
            continue
        s = fit_slope(xs, ys)
        unit = (lambda v: f"{v:12.0f}") if name.startswith("QPS") else (lambda v: f"{v / MIB:8.0f} MiB")
        print(f"    {name:28s} {unit(ys[0])} {unit(ys[-1])} {s:9.3f} {2 ** s:12.3f}x")


def _find_rates(tree: dict, where: str) -> list[tuple[str, float]]:
    """Every ``*lines_per_s`` number in ``tree`` (depth first), with its path in results.json."""
    found = []
    for key, value in tree.items():
        if isinstance(value, dict):
            found += _find_rates(value, f"{where}.{key}")
        elif isinstance(value, (int, float)) and "lines_per_s" in key and value > 0:
            found.append((f"{where}.{key}", float(value)))
    return found


def parse_rates(results: dict, data: Path) -> list[tuple[str, float]]:
    """The reader's parse throughputs (lines/s) that results.json reports (the data's first pass, the
    trainers' readers), else one timed here with the job's reader on one core."""
    found = _find_rates(results.get("data") or {}, "data")
    found += _find_rates(results["phases"]["optimized"], "phases.optimized")
    if found:
        return found
    from recsys.criteo_shard import CriteoShard

    lines = sum(1 for _ in data.open("rb"))
    t0 = time.perf_counter()  # every line is parsed; every 1000th is kept
    CriteoShard(data, int(results["config"]["model"]["table_size"]), eval_fraction=0.001, split="eval")
    return [("timed here (results.json has no rate): recsys.criteo_shard.CriteoShard, one core",
             lines / (time.perf_counter() - t0))]


def reader_section(data: Path, lines: int, rounds: int = 3) -> None:
    """Part 0: the first pass over the data (:func:`recsys.criteo_shard.scan`, one process, as the launcher
    runs it) with the strict numpy parser alone vs the Arrow fast path, in interleaved rounds."""
    from recsys.criteo_shard import scan

    print(f"\n0. reader: the first pass over {lines:,} lines, numpy parser vs Arrow fast path "
          f"(median of {rounds} interleaved rounds)")
    for cap, label in ((None, "lines and shares"), (10**6, "+ distinct ids per feature")):
        rates: dict[str, list[float]] = {"numpy": [], "auto": []}
        for _ in range(rounds):
            for engine in rates:
                plan = scan(data, 2, 0.1, distinct_cap=cap, engine=engine)
                rates[engine].append(plan.lines_per_s)
        before, after = (sorted(r)[len(r) // 2] for r in rates.values())
        print(f"  {label:28s} numpy {before:10,.0f} lines/s   arrow {after:10,.0f} lines/s   "
              f"= {after / before:5.2f}x (min {min(rates['auto']) / max(rates['numpy']):.2f}x, "
              f"max {max(rates['auto']) / min(rates['numpy']):.2f}x)")


def parse_section(data: Path, lines: int, size: int, steps: int, port: int, work: Path) -> None:
    """Part 2: the job on every line; parse lines/s vs training samples/s."""
    print(f"\n2. parse throughput vs training QPS at {lines:,} lines (table_size {size:,}, fused8bit, {steps} steps)")
    sets = {"data.path": f'"{data}"', "model.server_storage": '"fused8bit"', "model.table_size": str(size),
            "job.steps": str(steps), "metrics.port": str(port)}
    results = run_job(sets, work, "parse")
    if isinstance(results, str):
        print(f"  {results}")
        return
    parse = (results.get("data") or {}).get("parse") or {}
    print(f"  {parse.get('valid', 0):,} valid lines, {sum((parse.get('malformed') or {}).values()):,} malformed; "
          f"training {qps(results):.0f} samples/s (job QPS, 2 trainers)")
    for source, rate in parse_rates(results, data):
        print(f"  parse {rate:10.0f} lines/s = {rate / qps(results):6.2f} x training QPS   ({source})")


def storage_section(data: Path, size: int, steps: int, port: int, work: Path, reuse: dict | None) -> None:
    """Part 3: fp32 vs fp16 vs fused 8-bit server rows at ``size`` rows a table."""
    print(f"\n3. server storage at {size:,} rows a table (same data {data.name}, seed 0, {steps} steps)")
    runs: dict[str, dict | str] = {}
    for storage in ("fp32", "fp16", "fused8bit"):
        if storage == "fused8bit" and reuse is not None:
            print("  (fused8bit: part 1's run at this size)")
            runs[storage] = reuse
            continue
        sets = {"data.path": f'"{data}"', "model.server_storage": f'"{storage}"', "model.table_size": str(size),
                "job.steps": str(steps), "metrics.port": str(port)}
        runs[storage] = run_job(sets, work, f"storage-{storage}")
    peer = runs["fp32"] if not isinstance(runs["fp32"], str) else None
    print(f"  {'storage':10s} {'server MiB':>10s} {'x fp32':>7s} {'ps0 peak RSS MiB':>17s} {'QPS':>8s} {'x fp32':>7s} "
          f"{'AUC':>7s} {'- fp32':>8s}")
    for storage, r in runs.items():
        if isinstance(r, str):
            print(f"  {storage:10s} {r}")
            continue
        auc = r["phases"]["optimized"]["quality"].get("auc", float("nan"))
        ps0 = processes(r).get("ps0", {})
        rel = (lambda a, b: f"{a / b:7.3f}") if peer else (lambda a, b: "      -")
        print(f"  {storage:10s} {server_bytes(r) / MIB:10.1f} {rel(server_bytes(r), server_bytes(peer or r))} "
              f"{ps0.get('peak_rss_bytes', 0) / MIB:17.0f} {qps(r):8.0f} {rel(qps(r), qps(peer or r))} {auc:7.4f} "
              f"{auc - peer['phases']['optimized']['quality'].get('auc', float('nan')) if peer else float('nan'):+8.4f}")


def _machine() -> str:
    try:
        model = next(line.partition(":")[2].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        model, flags = platform.processor(), []
    isa = "AVX-512 VNNI" if "avx512_vnni" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{os.cpu_count()} cores, {model} ({isa}), {available_bytes() / GIB:.1f} GiB available at start"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10^4..10^6 rows, 100k lines, fewer steps")
    parser.add_argument("--steps", type=int, help="training steps per run (default 150; --quick 40)")
    parser.add_argument("--metrics-port", type=int, default=9520, help="base of the job's metrics ports")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic data (printed path)")
    parser.add_argument("--parts", default="0123", help="which parts to run, e.g. 13 (default: all)")
    args = parser.parse_args()
    _ensure_allocator()
    steps = args.steps or (40 if args.quick else 150)
    lines, head_lines = (100_000, 50_000) if args.quick else (1_000_000, 100_000)
    sizes = [10**4, 10**5, 10**6] if args.quick else [10**4, 10**5, 10**6, 10**7]
    storage_size = 10**5 if args.quick else 10**6
    print(f"scale benchmark {time.strftime('%Y-%m-%d %H:%M')}: {_machine()}")
    print(f"each point: fxdist launch, 2 trainers + 1 parameter server (Ray, this host), optimized phase only "
          f"(async_rpc_prefetch), batch 256, {steps} steps; allocator MALLOC_MMAP_THRESHOLD_="
          f"{os.environ.get('MALLOC_MMAP_THRESHOLD_')}")
    work = Path(tempfile.mkdtemp(prefix="fxdist-scale-"))
    try:
        full = synthesize(lines, work / "data")
        small = head(full, work / "head.tsv", head_lines)
        if "0" in args.parts:
            reader_section(full, lines)
        done = rows_section(small, sizes, steps, args.metrics_port, work, model_keys()) if "1" in args.parts else []
        if "1" in args.parts:
            growth(done)
        if "2" in args.parts:
            parse_section(full, lines, 10**5, steps, args.metrics_port, work)
        if "3" in args.parts:
            reuse = {r["bench_size"]: r for r in done}.get(storage_size)
            storage_section(small, storage_size, steps, args.metrics_port, work, reuse)
    finally:
        if args.keep:
            print(f"data kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
