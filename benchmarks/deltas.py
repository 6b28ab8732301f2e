"""What model deltas (``[export] every_steps``) cost a parameter server's training steps: QPS with deltas on / off.

The shape of ``benchmarks/peer.py``'s parameter-server steps, all in this process on one torch thread: 26 tables of
``--rows`` x ``--dim`` (one feature each, one id per table and sample, ids uniform) on one server
(:class:`~scheduling.ps.server.PSServer`), SGD or row-wise Adagrad (``--optimizer``); a step is what two trainers
and the server compute: per trainer, peer.py's dense part (``_peer_systems.dense_only_model``: the DLRM's dense and
over arches, forward, backward and SGD on ``--batch`` samples) and its requests (a lookup and a push of the batch's
26 ids per sample, as a prefetching trainer's ``push_lookup``). ``--no-dense`` leaves the dense part out: the
server's work alone, the ratio's lower bound. The delta's dense weights are that model's ``state_dict``.

Rounds of ``--steps`` steps alternate three ways of running the same steps (the order rotates every round, so each
sees the same machine load):

- **off**: no changed-row record (``[export] every_steps = 0``);
- **record**: the servers' record on (the push path marks its rows, :mod:`scheduling.ps.changes`), no delta taken;
- **deltas**: the record on, and every ``--every`` steps a delta as rank 0 of a job makes it while the other
  trainers wait at the barrier: the changes taken (the rows and their values gathered, the record cleared) and the
  dense weights copied; then handed to :class:`jobs.deltas.DeltaQueue`, which writes it
  into a temporary folder (``torch.save``, ``os.replace``) on its background thread while the steps go on (the
  round's time includes that thread's competition for the CPU, not the wait for its last write).

Measured per round: steps per second of this process's CPU time (``time.process_time``: every thread, the writer's
included), which another load on a shared machine hardly moves, and steps per wall second. Printed: both for each
mode, the ratios record/off and deltas/off (median of the per-round ratios, with min and max), the rows and CPU
milliseconds per delta (its cost beyond the steps', from the two modes' CPU times), and the load average at the
start and end. ``--json PATH`` writes the record (``benchmarks/_bench.py``).

Run: ``.venv/bin/python benchmarks/deltas.py [--rows 100000 --dim 16 --steps 200 --every 50 --rounds 5]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench  # noqa: E402  (benchmarks/ is sys.path[1] when run as a script)
import _peer_systems as peer  # noqa: E402

from jobs.deltas import Delta, DeltaQueue, TableDelta  # noqa: E402
from scheduling.ps.changes import start_tracking, stop_tracking, take_changes  # noqa: E402
from scheduling.ps.server import PSServer  # noqa: E402
from scheduling.ps.shard_plan import TableSpec, plan_shards  # noqa: E402

NS, NUM_TABLES, TRAINERS = "emb", 26, 2
MODES = ("off", "record", "deltas")


def _batches(args: argparse.Namespace, count: int, seed: int) -> list[tuple]:
    """``count`` KJT wire batches (26 keys, one id each per sample) and their gradients ``(B, 26 * D)``."""
    gen = torch.Generator().manual_seed(seed)
    keys = tuple(f"f{i}" for i in range(NUM_TABLES))
    out = []
    for _ in range(count):
        values = torch.randint(0, args.rows, (NUM_TABLES * args.batch,), generator=gen)
        lengths = torch.ones(NUM_TABLES * args.batch, dtype=torch.int32)
        grad = torch.randn(args.batch, NUM_TABLES * args.dim, generator=gen) * 0.01
        out.append(((keys, values, lengths, None), grad))
    return out


def _delta(server: PSServer, step: int, dense: dict[str, torch.Tensor], queue: DeltaQueue) -> int:
    """Take the server's changes and hand them over with a copy of the dense weights, as rank 0 does; the rows."""
    changes = take_changes(server, NS)
    tables = {f"{c['table']}.weight": TableDelta(c["rows"], c["values"]) for c in changes.values()}
    delta = Delta(step, {k: v.clone() for k, v in dense.items()}, tables)
    queue.put(delta)
    return delta.num_rows


def _round(server: PSServer, mode: str, batches: list[tuple], args: argparse.Namespace, trainer: Any,
           folder: str, rows: list[int]) -> tuple[float, float]:
    """``(steps per CPU second, steps per wall second)`` of ``args.steps`` steps in ``mode``."""
    (start_tracking if mode != "off" else stop_tracking)(server, NS)
    queue = DeltaQueue(folder)
    step0 = (queue.newest or 0) + 1
    t0, c0 = time.perf_counter(), time.process_time()
    for s in range(args.steps):
        for t in range(TRAINERS):
            batch, grad = batches[(s * TRAINERS + t) % len(batches)]
            server.lookup(NS, batch)
            if trainer is not None:
                trainer.step(t)
            server.push(NS, batch, grad)
        if mode == "deltas" and (s + 1) % args.every == 0:
            rows.append(_delta(server, step0 + s, trainer.dense() if trainer is not None else {}, queue))
    seconds = time.perf_counter() - t0
    queue.close()   # the last delta's write: CPU counted (it is work the deltas cost), wall not (it overlaps steps)
    return args.steps / (time.process_time() - c0), args.steps / seconds


class _Trainer:
    """peer.py's dense part of one step (``_peer_systems.dense_only_model``), SGD, on ``batch`` samples."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.model = peer.dense_only_model(args.rows, args.dim, args.batch)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=peer.LR)
        self.data = peer.batches(0, 4, args.rows)[:TRAINERS] if args.batch == peer.BATCH else [
            (torch.rand(args.batch, 13), None, torch.rand(args.batch).round()) for _ in range(TRAINERS)]

    def step(self, t: int) -> None:
        dense, kjt, labels = self.data[t]
        self.opt.zero_grad(set_to_none=True)
        torch.nn.functional.binary_cross_entropy_with_logits(self.model(dense, kjt).squeeze(-1), labels).backward()
        self.opt.step()

    def dense(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.model.state_dict().items() if not v.is_meta}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=128, help="samples per trainer and step")
    ap.add_argument("--steps", type=int, default=200, help="steps per round")
    ap.add_argument("--every", type=int, default=50, help="steps between deltas ([export] every_steps)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-dense", action="store_true", help="no dense part: the server's work alone")
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "rowwise_adagrad"])
    ap.add_argument("--json", default=None, help="write the run's record to this path")
    args = ap.parse_args()
    _bench.reexec_with_fixed_allocator()
    torch.set_num_threads(1)
    record = _bench.Record("deltas", "Model deltas: QPS of parameter-server steps with deltas on / off",
                           {k: v for k, v in vars(args).items() if k != "json"})
    load = os.getloadavg()
    tables = [TableSpec(f"t{i}", args.rows, args.dim, (f"f{i}",)) for i in range(NUM_TABLES)]
    server = PSServer("ps0")
    server.configure(NS, plan_shards(tables, 1), 0, args.optimizer, {"lr": 0.05}, seed=0)
    batches = _batches(args, 64, seed=1)
    trainer = None if args.no_dense else _Trainer(args)
    dense_mb = 0.0 if trainer is None else sum(v.numel() * 4 for v in trainer.dense().values()) / 2**20
    rows: list[int] = []
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    wall: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as folder:
        _round(server, "off", batches, argparse.Namespace(**{**vars(args), "steps": 20}), trainer, folder, rows)  # warm
        for r in range(args.rounds):
            for mode in MODES[r % 3:] + MODES[:r % 3]:
                c, w = _round(server, mode, batches, args, trainer, folder, rows)
                cpu[mode].append(c)
                wall[mode].append(w)
            print(f"round {r + 1}: " + ", ".join(f"{m} {cpu[m][-1]:.0f} ({wall[m][-1]:.0f} wall)" for m in MODES)
                  + " steps/s", flush=True)
    end = os.getloadavg()
    print(f"\n26 tables x {args.rows:,} x {args.dim}, batch {args.batch} x {TRAINERS} trainers, {args.optimizer}, "
          f"{'the dense part' if trainer else 'no dense part'}, a delta every {args.every} steps ({dense_mb:.1f} MiB "
          f"dense); load average {load[0]:.1f} -> {end[0]:.1f} "
          f"on {os.cpu_count()} cores")
    for key, series, what in (("cpu", cpu, "per CPU second"), ("wall", wall, "per wall second")):
        record.group(key, f"Server steps {what}, deltas on vs off (one server, 2 trainers' requests a step)", "off",
                     "steps/s", lower_is_better=False)
        for mode in ("record", "deltas"):
            ratios = _bench.paired(series[mode], series["off"])
            med = statistics.median(ratios)
            print(f"{what:>15}: {mode:>6} / off {med:.3f}x (rounds {min(ratios):.3f}-{max(ratios):.3f}); "
                  f"{statistics.median(series[mode]):.0f} vs {statistics.median(series['off']):.0f} steps/s")
            record.row(key, mode, statistics.median(series[mode]), statistics.median(series["off"]), med, ratios)
    if rows:
        per = statistics.median(rows)
        step_ms = {m: 1e3 / statistics.median(cpu[m]) for m in MODES}
        delta_ms = (step_ms["deltas"] - step_ms["record"]) * args.every
        print(f"rows per delta: median {per:,.0f} of {NUM_TABLES * args.rows:,} ({per * args.dim * 4 / 2**20:.1f} MiB "
              f"of rows); CPU per step {step_ms['off']:.2f} ms off, {step_ms['record']:.2f} ms record; a delta "
              f"{delta_ms:.1f} ms of CPU ({1e3 * delta_ms / max(per, 1):.2f} us a row)")
        record.note(f"rows per delta: median {per:,.0f} of {NUM_TABLES * args.rows:,}; a delta {delta_ms:.1f} ms of CPU")
    record.note(f"load average {load[0]:.1f} at start, {end[0]:.1f} at end, {os.cpu_count()} cores")
    record.write(args.json)


if __name__ == "__main__":
    main()
