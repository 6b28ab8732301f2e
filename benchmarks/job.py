"""Benchmark of the main job: QPS of the baseline and optimized phases, and the cost of metrics export.

Part 1 runs the default job (``jobs/default.toml``, Ray, 2 trainers, 1 parameter server) with fewer
steps and prints the QPS of both phases, measured in the same run on the same batches, and their ratio.

Part 2 measures the Prometheus exporter's overhead without Ray: one process trains the default DLRM
(local tables) for ``--steps`` steps per trial, alternating trials with and without an exporter that is
being scraped every second, and compares the median QPS.

Usage::

    .venv/bin/python benchmarks/job.py [--steps 200] [--trials 7] [--skip-job]

Allocator: runs with ``MALLOC_MMAP_THRESHOLD_=33554432`` (re-executes itself to set it; see FACTS.md).
Goals: optimized/baseline QPS >= 1 + the scheduling benchmark's gain; export overhead < 1%.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ensure_allocator() -> None:
    import _bench  # this folder is sys.path[0]

    _bench.reexec_with_fixed_allocator()


def load_batch_size() -> int:
    from jobs.config import load_config

    return load_config().job.batch_size


def run_job(steps: int) -> dict:
    from jobs.config import load_config
    from jobs.launch import launch
    from jobs.metrics import free_port_block

    config = load_config().replace(job={"steps": steps, "progress": False, "checkpoint_every": 0,
                                        "run_dir": str(ROOT / "runs")},
                                   metrics={"port": free_port_block(3)}, quant={"enabled": False})
    return launch(config, quiet=True)


def _scraper(port: int, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()


def _trial(with_exporter: bool, steps: int, shard, config) -> float:
    import torch

    from jobs.metrics import Exporter
    from jobs.sparse import LocalTables
    from jobs.worker import build_model, run_phase

    exporter, stop, thread = None, threading.Event(), None
    if with_exporter:
        exporter = Exporter("bench", 0)
        port = exporter.serve(0)
        thread = threading.Thread(target=_scraper, args=(port, stop), daemon=True)
        thread.start()
    try:
        torch.manual_seed(0)
        model = build_model(config)
        run, _, _ = run_phase("baseline", model, LocalTables(), shard, config.replace(job={"steps": steps}),
                              exporter=exporter)
        return run.samples / sum(run.step_seconds)
    finally:
        stop.set()
        if exporter is not None:
            exporter.close()


def export_overhead(steps: int, trials: int) -> tuple[float, float]:
    """Median QPS (without, with) the exporter, over ``trials`` alternating trials each."""
    import torch

    from jobs.config import load_config
    from jobs.data import CriteoShard, resolve_data_path

    torch.set_num_threads(1)
    config = load_config()
    path, _ = resolve_data_path("", ROOT / "runs", config.data.synthetic_rows)
    shard = CriteoShard(path, config.model.table_size)
    _trial(False, 20, shard, config)  # warm-up
    without, with_ = [], []
    for i in range(trials):
        order = (False, True) if i % 2 == 0 else (True, False)
        for flag in order:
            (with_ if flag else without).append(_trial(flag, steps, shard, config))
    return statistics.median(without), statistics.median(with_)


def per_call_costs() -> tuple[float, float]:
    """(seconds per ``observe_step``, seconds per scrape of /metrics), measured on a fresh exporter."""
    from jobs.metrics import Exporter

    e = Exporter("bench", 0)
    e.touch(["baseline", "optimized"])
    n = 20000
    t0 = time.perf_counter()
    for i in range(n):
        e.observe_step("baseline", samples=128, step_seconds=0.01 + (i % 7) * 1e-3, fetch_seconds=0.001, loss=0.5)
    observe = (time.perf_counter() - t0) / n
    port = e.serve(0)
    try:
        t0 = time.perf_counter()
        for _ in range(50):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        scrape = (time.perf_counter() - t0) / 50
    finally:
        e.close()
    return observe, scrape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--skip-job", action="store_true", help="only measure the export overhead")
    args = parser.parse_args()
    _ensure_allocator()
    print(f"allocator: MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_')}; torch threads per trainer: 1")
    if not args.skip_job:
        results = run_job(args.steps)
        base, opt = results["phases"]["baseline"], results["phases"]["optimized"]
        print(f"job {results['job']}: {args.steps} steps per phase, passes {results['config']['phases']['passes']}")
        print(f"  baseline  QPS {base['qps']:10.1f}  step p50 {base['step_p50_ms']:.2f} ms  "
              f"p99 {base['step_p99_ms']:.2f} ms")
        print(f"  optimized QPS {opt['qps']:10.1f}  step p50 {opt['step_p50_ms']:.2f} ms  "
              f"p99 {opt['step_p99_ms']:.2f} ms")
        print(f"  optimized/baseline QPS ratio: {opt['qps'] / base['qps']:.3f} "
              f"(gain {100 * (opt['qps'] / base['qps'] - 1):+.1f} %)")
    without, with_ = export_overhead(args.steps, args.trials)
    print(f"metrics export ({args.trials} alternating trials x {args.steps} steps, exporter scraped every 1 s):")
    print(f"  QPS without exporter {without:10.1f}   with exporter {with_:10.1f}")
    print(f"  with/without ratio: {with_ / without:.4f} (overhead {100 * (1 - with_ / without):+.2f} %)")
    observe, scrape = per_call_costs()
    steps_per_s = without / load_batch_size()
    share = observe * steps_per_s + scrape / 1.0  # CPU seconds per second of training, scraped every 1 s
    print(f"  per-call costs: observe_step {observe * 1e6:.1f} us, one scrape {scrape * 1e3:.2f} ms; at "
          f"{steps_per_s:.0f} steps/s that is {100 * share:.3f} % of one core (estimate from per-call costs)")


if __name__ == "__main__":
    main()
