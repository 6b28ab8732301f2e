"""Dynamic (collisionless) tables vs fixed hashed tables on one parameter server: speed and memory.

Two measurements, each a ratio against fixed tables measured in the same run:

* ``speed``: one in-process ``PSServer`` with 26 tables answers, per step, the lookup of a batch and the push
  of its gradient (what the trainers wait on). Fixed tables hash each raw id into ``C`` rows (``id % C``, as
  ``recsys.criteo_format.hash_ids`` does); dynamic tables (:mod:`scheduling.ps.dynamic`) keep at most ``C``
  admitted raw ids, LRU-evicted. Rounds alternate fixed and dynamic; the ratio is dynamic steps/s over fixed
  steps/s, the median over rounds, with the range. Defaults: the job's shape (capacity 3,000, dim 16, 2
  trainers x 128 samples).
* ``memory``: each variant in its own process streams ``--lines`` synthetic lines (26 categorical ids each)
  through one server with ``C`` rows per table and reports its peak RSS above the RSS after set-up is
  imported (``resource.getrusage``), and the ratio dynamic / fixed. Ids follow a long tail: each position is
  a new id with probability ``--new-fraction``, else a Zipf(1.2)-ranked earlier one, so about
  ``lines * 26 * new_fraction`` distinct ids (1e7 with the defaults) reach the server.

Run: ``.venv/bin/python benchmarks/dynamic_tables.py [speed|memory|all] [--capacity 3000 --dim 16 ...]``.
The machine's load is printed: on a busy 2-core box the speed ratio is noisy, the memory figures are not.

Source: Liu et al. 2022, "Monolith: Real Time Recommendation System With Collisionless Embedding Table" §2.1.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recsys.criteo_format import RAW_IDS, hash_ids  # noqa: E402
from scheduling.ps.dynamic import DynamicSpec  # noqa: E402
from scheduling.ps.server import PSServer  # noqa: E402
from scheduling.ps.shard_plan import TableSpec, plan_shards  # noqa: E402

TABLES = 26


def _server(kind: str, capacity: int, dim: int, min_count: int) -> PSServer:
    dyn = DynamicSpec(capacity, min_count) if kind == "dynamic" else None
    specs = [TableSpec(f"t{i}", capacity, dim, (f"C{i}",), dynamic=dyn) for i in range(TABLES)]
    server = PSServer("ps0")
    server.configure("ns", plan_shards(specs, 1), 0, "rowwise_adagrad", {"lr": 0.01}, seed=0)
    return server


class IdStream:
    """Raw 63-bit ids, ``(lines, 26)`` per call: a long tail of new ids plus Zipf-ranked repeats.

    Position ``p`` of feature ``j`` is a never-seen id with probability ``new_fraction``; else the id of rank
    ``r ~ Zipf(1.2)`` among that feature's ids so far, counted back from the newest. Ids are the raw ids
    (``recsys.criteo_format.hash_ids`` with ``RAW_IDS``) of those counters, as the job's reader gives them.
    """

    def __init__(self, new_fraction: float, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.new_fraction = new_fraction
        self.seen = np.zeros(TABLES, dtype=np.int64)   # ids made so far per feature

    def __call__(self, lines: int) -> torch.Tensor:
        new = self.rng.random((lines, TABLES)) < self.new_fraction
        new[:, self.seen == 0] = True
        counters = np.cumsum(new, axis=0) + self.seen - 1       # index of the newest id at each position
        back = self.rng.zipf(1.2, (lines, TABLES)) - 1
        index = np.where(new, counters, np.maximum(counters - back, 0))
        self.seen = self.seen + new.sum(axis=0)
        # as the job's reader gives a dynamic table's ids: the raw id of value `index` in feature j
        return torch.from_numpy(hash_ids(index.astype(np.uint64), np.ones_like(new), [RAW_IDS] * TABLES))


def _dynamic_counters(server: PSServer) -> dict[str, int]:
    """The dynamic tables' counters (``DynamicTable.stats``), summed over the server's tables."""
    total: dict[str, int] = {}
    for shard in server.shards.values():
        if shard.dynamic is not None:
            for k, v in shard.dynamic.stats().items():
                if k not in ("step", "capacity"):
                    total[k] = total.get(k, 0) + v
    return total


def _batch(ids: torch.Tensor, kind: str, capacity: int) -> tuple:
    """A server batch of ``ids`` ``(B, 26)``: raw for dynamic tables, ``id % capacity`` for fixed ones."""
    values = ids if kind == "dynamic" else ids % capacity
    keys = tuple(f"C{j}" for j in range(TABLES))
    return keys, values.t().reshape(-1).contiguous(), torch.ones(values.numel(), dtype=torch.long), None


def _step(server: PSServer, batch: tuple, grad: torch.Tensor) -> None:
    server.lookup("ns", batch)
    server.push("ns", batch, grad)


def speed(args: argparse.Namespace) -> None:
    servers = {k: _server(k, args.capacity, args.dim, args.min_count) for k in ("fixed", "dynamic")}
    stream = IdStream(args.new_fraction)
    steps = [stream(args.batch) for _ in range(args.steps * (args.rounds + 1))]
    grad = torch.randn(args.batch, TABLES * args.dim)
    per_round = {k: [] for k in servers}
    for r in range(args.rounds + 1):                      # round 0 warms up (and fills the dynamic tables)
        chunk = steps[r * args.steps:(r + 1) * args.steps]
        for kind, server in servers.items():
            batches = [_batch(ids, kind, args.capacity) for ids in chunk]
            start = time.perf_counter()
            for b in batches:
                _step(server, b, grad)
            if r:
                per_round[kind].append(len(batches) / (time.perf_counter() - start))
    ratios = [d / f for f, d in zip(per_round["fixed"], per_round["dynamic"])]
    stats = _dynamic_counters(servers["dynamic"])
    print(f"speed: 26 tables x capacity {args.capacity:,} x dim {args.dim}, batch {args.batch}, min_count "
          f"{args.min_count}, {args.rounds} rounds x {args.steps} steps (lookup + push), 1 thread, load "
          f"{os.getloadavg()[0]:.2f}")
    for kind, runs in per_round.items():
        print(f"  {kind:<8} {statistics.median(runs):>9,.0f} steps/s ({min(runs):,.0f}..{max(runs):,.0f})")
    print(f"  dynamic / fixed: {statistics.median(ratios):.2f}x ({min(ratios):.2f}..{max(ratios):.2f})")
    print("  dynamic tables, summed over the 26: " + ", ".join(f"{k} {v:,}" for k, v in stats.items()))


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_child(args: argparse.Namespace) -> None:
    """One variant's peak RSS (MB) over the stream, printed as JSON (run in its own process)."""
    stream = IdStream(args.new_fraction)
    grad = torch.randn(args.batch, TABLES * args.dim)
    _step(_server(args.kind, 8, args.dim, args.min_count), _batch(stream(4), args.kind, 8), grad[:4])
    base = _rss_mb()                                       # torch, numpy and a server's code paths loaded
    server = _server(args.kind, args.capacity, args.dim, args.min_count)
    stream = IdStream(args.new_fraction)
    done = distinct = 0
    while done < args.lines:
        ids = stream(min(args.batch, args.lines - done))
        _step(server, _batch(ids, args.kind, args.capacity), grad[:ids.shape[0]])
        done += ids.shape[0]
    peak = _rss_mb()
    distinct = int(stream.seen.sum())
    print(json.dumps({"kind": args.kind, "base_mb": base, "peak_mb": peak, "distinct": distinct}))


def memory(args: argparse.Namespace) -> None:
    table_mb = TABLES * args.capacity * (args.dim * 4 + 4) / 2**20
    print(f"memory: {args.lines:,} lines x 26 features, new-id fraction {args.new_fraction} (~"
          f"{args.lines * TABLES * args.new_fraction:,.0f} distinct ids), 26 tables x capacity {args.capacity:,} "
          f"x dim {args.dim} (rows + row-wise Adagrad state: {table_mb:,.0f} MB), batch {args.batch}")
    got = {}
    for kind in ("fixed", "dynamic"):
        cmd = [sys.executable, __file__, "memory-child", "--kind", kind] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k in ("capacity", "dim", "batch", "lines", "new_fraction", "min_count")]
        start = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        got[kind] = json.loads(out.strip().splitlines()[-1])
        g = got[kind]
        print(f"  {kind:<8} peak RSS {g['peak_mb']:,.0f} MB, {g['peak_mb'] - g['base_mb']:,.0f} MB above set-up; "
              f"{g['distinct']:,} distinct ids; {time.perf_counter() - start:.0f} s")
    grow = {k: g["peak_mb"] - g["base_mb"] for k, g in got.items()}
    print(f"  dynamic / fixed (above set-up): {grow['dynamic'] / grow['fixed']:.2f}x")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("speed", "memory", "all", "memory-child"), nargs="?", default="all")
    p.add_argument("--capacity", type=int, default=None, help="rows per table (speed: 3000, memory: 65536)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=None, help="lines per step (speed: 256, memory: 4096)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--lines", type=int, default=1_000_000)
    p.add_argument("--new-fraction", type=float, default=0.385, help="probability a position is a new id")
    p.add_argument("--min-count", type=int, default=1)
    p.add_argument("--kind", choices=("fixed", "dynamic"), default="fixed", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.what in ("speed", "all"):
        speed(argparse.Namespace(**{**vars(args), "capacity": args.capacity or 3000, "batch": args.batch or 256}))
    mem = argparse.Namespace(**{**vars(args), "capacity": args.capacity or 65536, "batch": args.batch or 4096})
    if args.what in ("memory", "all"):
        memory(mem)
    if args.what == "memory-child":
        memory_child(mem)


if __name__ == "__main__":
    main()
