"""Checkpoint of a row-wise table on 2 parameter servers: by shard with ``torch.distributed.checkpoint`` (each
server writes its own rows, :mod:`scheduling.placement.sharded`) against the gather (the trainer receives every
row and its Adagrad state, joins them, ``torch.save``; what job checkpoints did before).

Per size, rounds alternate the two ways on the same servers (a fresh folder each time) and report, in seconds:

* ``gather``: ``PSClient.server_states`` + ``reshard.gather_tables`` + ``torch.save`` of the whole table; training
  is blocked all along (the trainer does it);
* ``dcp``: ``PSClient.save_shards`` (each server copies its shard, under the lock the pushes take, and answers:
  the ``blocked`` time) until every server reports its background write finished and the metadata is merged
  (``total``).

The ratio is gather / dcp total (and gather / dcp blocked), medians over the rounds with their range. The CPU
model, its cores and the load average are printed: on a shared 2-core box the servers' writes compete with
everything else.

Run: ``.venv/bin/python benchmarks/checkpoint.py [--rows 1000000 10000000] [--dim 16] [--rounds 3]
[--json PATH]``.

Source: ``torch.distributed.checkpoint`` (``async_save``'s split: a blocking copy, a background write); torchrec's
row-wise sharded checkpoints.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench  # noqa: E402

from scheduling.ps import LocalCluster, PSClient  # noqa: E402
from scheduling.ps.dcp_shards import merge_metadata  # noqa: E402
from scheduling.ps.reshard import gather_tables  # noqa: E402
from scheduling.ps.shard_plan import TableSpec  # noqa: E402


def _gather(client: PSClient, folder: Path) -> float:
    start = time.perf_counter()
    tables = gather_tables(client.server_states())
    torch.save({"t.weight": tables["bench"]["t"]["weight"], "t.momentum": tables["bench"]["t"]["state"]},
               folder / "state.pt")
    return time.perf_counter() - start


def _dcp(client: PSClient, folder: Path) -> tuple[float, float]:
    start = time.perf_counter()
    client.save_shards(folder, {"t": "t"})
    blocked = time.perf_counter() - start
    client.save_status(folder, wait=True)
    merge_metadata(folder)
    return blocked, time.perf_counter() - start


def _size(rows: int, dim: int, rounds: int, record: _bench.Record) -> None:
    with LocalCluster(num_servers=2, timeout_s=120.0):
        client = PSClient([TableSpec("t", rows, dim, ("f",))], ["ps0", "ps1"], sharding="row_wise",
                          optimizer="rowwise_adagrad", name="bench", seed=0, timeout_s=600.0)
        try:
            gathers, blocked, totals = [], [], []
            for _ in range(rounds):
                for way in ("gather", "dcp"):
                    folder = Path(tempfile.mkdtemp(prefix="fxdist-ckpt-"))
                    try:
                        if way == "gather":
                            gathers.append(_gather(client, folder))
                        else:
                            b, t = _dcp(client, folder)
                            blocked.append(b)
                            totals.append(t)
                    finally:
                        shutil.rmtree(folder, ignore_errors=True)
        finally:
            client.close(flush=False)
    ratios = [g / t for g, t in zip(gathers, totals)]
    g, t, b = statistics.median(gathers), statistics.median(totals), statistics.median(blocked)
    mb = rows * (dim + 1) * 4 / 2**20
    print(f"{rows:>10,} x {dim} ({mb:,.0f} MiB with Adagrad state): gather + torch.save {g:7.3f} s | dcp by shard "
          f"{t:7.3f} s (training blocked {b * 1e3:8.1f} ms) | gather / dcp {statistics.median(ratios):.2f}x "
          f"[{min(ratios):.2f}, {max(ratios):.2f}], gather / blocked {g / b:,.0f}x")
    record.row("total", f"{rows:,} x {dim}", t, g, ratio=statistics.median([t_ / g_ for g_, t_ in
                                                                           zip(gathers, totals)]),
               spread=[t_ / g_ for g_, t_ in zip(gathers, totals)])
    record.row("blocked", f"{rows:,} x {dim}", b, g, ratio=b / g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10**6, 10**7])
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the measured rows as a JSON record here")
    args = parser.parse_args()
    _bench.reexec_with_fixed_allocator()
    m = _bench.machine()
    print(f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}; load average at start "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}; 2 servers, row-wise table, rowwise Adagrad, "
          f"{args.rounds} rounds")
    record = _bench.Record("checkpoint", "Table checkpoints: DCP by shard vs gather + torch.save",
                           {"dim": args.dim, "rounds": args.rounds, "servers": 2})
    record.group("total", "checkpoint until written (s)", "gather + torch.save", "s")
    record.group("blocked", "training blocked (s)", "gather + torch.save", "s")
    for rows in args.rows:
        _size(rows, args.dim, args.rounds, record)
    print(f"load average at end {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    record.write(args.json)


if __name__ == "__main__":
    main()
