"""A parameter server's CPU per training step: FBGEMM's table-batched kernel vs fxdist's own stacked path.

One in-process ``PSServer`` holds 26 Criteo-layout tables (6 at 1e6 rows, ``--big-tables``; one feature each) and answers, per step,
the lookup of a batch and the push of its gradient (uniform ids), as it does for one trainer. The same server
runs with ``FXDIST_PS_KERNEL=fbgemm`` (:mod:`scheduling.ps.tbe`: FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen``
on the CPU, optimizer fused into its backward) and ``=fxdist`` (``index_select`` / ``index_add_`` on the stacked
rows, :mod:`scheduling.ps.fused`), in alternating rounds; it prints the median milliseconds per step (lookup +
push) of each, their ratio, and the spread over rounds, for row-wise Adagrad and SGD at 1e4 / 1e6 rows and
dimensions 16 / 64, one torch thread.

Run: ``.venv/bin/python benchmarks/server_kernel.py [--batch 256 --steps 30 --rounds 5]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduling.ps.server import PSServer  # noqa: E402
from scheduling.ps.shard_plan import TableSpec, plan_shards  # noqa: E402
from scheduling.ps.tbe import KERNEL_ENV  # noqa: E402

KERNELS = ("fbgemm", "fxdist")


def _server(kernel: str, rows: int, dim: int, optimizer: str, count: int) -> PSServer:
    os.environ[KERNEL_ENV] = kernel
    tables = [TableSpec(f"t{i}", rows, dim, (f"C{i}",)) for i in range(count)]
    server = PSServer("ps0")
    server.configure("ns", plan_shards(tables, 1), 0, optimizer, {"lr": 0.01}, seed=0)
    assert (server.fused["ns"].kernel is not None) == (kernel == "fbgemm")
    return server


def _batches(rows: int, batch: int, count: int, tables: int) -> list[tuple]:
    gen = torch.Generator().manual_seed(0)
    keys = tuple(f"C{i}" for i in range(tables))
    return [(keys, torch.randint(0, rows, (tables * batch,), generator=gen),
             torch.ones(tables * batch, dtype=torch.long), None) for _ in range(count)]


def _ms_per_step(server: PSServer, batches: list[tuple], grads: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for batch, grad in zip(batches, grads):
        server.lookup("ns", batch)
        server.push("ns", batch, grad)
    return (time.perf_counter() - start) / len(batches) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--big-tables", type=int, default=6,
                   help="tables at 1e6 rows (two servers of 26 x 1e6 x 64 would not fit in 24 GB)")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"26 tables, batch {args.batch}, one id per table and sample, {args.steps} steps x {args.rounds} rounds, "
          f"1 thread; ms per step (lookup + push); load {os.getloadavg()[0]:.2f}")
    print(f"{'optimizer':<16} {'tables':>6} {'rows':>9} {'dim':>4} {'fbgemm ms':>10} {'fxdist ms':>10} {'fxdist/fbgemm':>14} "
          f"{'spread (ratio)':>16}")
    for optimizer in ("rowwise_adagrad", "sgd"):
        for rows in (10_000, 1_000_000):
            for dim in (16, 64):
                count = 26 if rows < 1_000_000 else args.big_tables
                servers = {k: _server(k, rows, dim, optimizer, count) for k in KERNELS}
                batches = _batches(rows, args.batch, args.steps, count)
                grads = [torch.randn(args.batch, count * dim) for _ in batches]
                for s in servers.values():          # warm-up
                    _ms_per_step(s, batches[:3], grads[:3])
                runs = {k: [] for k in KERNELS}
                for _ in range(args.rounds):
                    for k in KERNELS:
                        runs[k].append(_ms_per_step(servers[k], batches, grads))
                ratios = [o / f for f, o in zip(runs["fbgemm"], runs["fxdist"])]
                med = {k: statistics.median(v) for k, v in runs.items()}
                print(f"{optimizer:<16} {count:>6} {rows:>9,} {dim:>4} {med['fbgemm']:>10.2f} {med['fxdist']:>10.2f} "
                      f"{statistics.median(ratios):>14.2f} {min(ratios):>7.2f}..{max(ratios):<7.2f}", flush=True)
                del servers


if __name__ == "__main__":
    main()
