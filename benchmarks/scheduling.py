"""Training QPS of a DLRM on 2 parameter servers: blocking fetches vs the async_rpc pass.

One trainer (this process, 1 torch thread) and 2 servers on loopback (TCP transport). For an added
server-side latency of 0, 1 and 5 ms per fetch, the same traced train step runs as is (baseline) and after
``scheduling.async_rpc`` (async), taking turns step by step, with the ideal overlap bound measured in the same
run. A third variant, ``async_rpc(max_staleness=1)``, leaves a step's pushes in flight while the next step
starts; the servers apply each client's requests in issue order, so its training is still exact:

- compute C: the train step with the fetches served from memory and the pushes dropped (no RPC);
- fetch F: the step's RPCs alone (2 fetches, then 2 pushes), blocking one after the other (F_seq, what the
  baseline pays: T_base ~ C + F_seq) and with the independent ones in flight together (F_par);
- ideal: an overlapped step cannot beat max(C, F_par), so the ideal gain is T_base / max(C, F_par) - 1.

Prints per latency: median step times, QPS, gain % = T_base / T_async - 1, and the share of the ideal gain
reached (gain / ideal gain). Timings are medians over steps, then over rounds; the spread (min..max of round medians)
shows the noise of a shared 2-core machine.

Run: ``.venv/bin/python benchmarks/scheduling.py [--steps 20 --rounds 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import scheduling  # noqa: E402
from scheduling.models import DLRMOnPS, PSTrainStep, criteo_batches, criteo_tables, trace_train_step  # noqa: E402
from scheduling.ps import LocalCluster, PSClient  # noqa: E402

CRITEO = REPO.parent / "shared" / "data" / "criteo" / "train_examples.txt"


class MemoryClient(PSClient):
    """Serves fetches from memory and drops pushes: the step's compute without any RPC."""

    def __init__(self, like: PSClient, name: str, answers: dict[int, torch.Tensor]) -> None:
        super().__init__(like.tables, like.servers, sharding={s.table.name: "row_wise" if s.num_rows <
                                                              s.table.num_embeddings else "table_wise"
                                                              for s in like.shards}, name=name, configure=False)
        self.answers = answers

    def fetch(self, server, kjt):
        return self.answers[server].clone().requires_grad_(torch.is_grad_enabled())

    def push(self, server, kjt, fetched):
        fetched.grad = None
        return 0


def build(name: str, args, dims: tuple[int, ...], servers: list[str], memory_of: PSClient | None = None,
          answers=None):
    if memory_of is None:
        PSClient(criteo_tables(1000, dims[-1]), servers, sharding=args.sharding, optimizer_kwargs={"lr": 0.01},
                 name=name, seed=0, compress=args.compress, ordered=not args.unordered)
    else:
        MemoryClient(memory_of, name, answers)
    torch.manual_seed(0)
    model = DLRMOnPS(name, dense_layers=dims, over_layers=(64, 1))
    step = PSTrainStep(model, torch.optim.SGD(model.parameters(), lr=0.01), f"{name}_opt")
    return trace_train_step(step)


def time_block(fn, batches) -> float:
    """Median seconds per call of ``fn(*batch)`` over ``batches``."""
    times = []
    for batch in batches:
        t0 = time.perf_counter()
        fn(*batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rpc_step(client: PSClient, kjt, parallel: bool) -> None:
    """One step's RPCs alone: a fetch per server, then a push per server; blocking one by one, or
    (``parallel``) the fetches in flight together, then the pushes."""
    servers = range(len(client.servers))
    if parallel:
        futs = [client.fetch_async(s, kjt) for s in servers]
        parts = [client.finish_fetch(f, s) for s, f in zip(servers, futs)]
    else:
        parts = [client.fetch(s, kjt) for s in servers]
    for part in parts:
        part.grad = torch.zeros_like(part)
    if parallel:
        futs = [client.push_async(s, kjt, part) for s, part in zip(servers, parts)]
        for s, f in zip(servers, futs):
            client.finish_push(f, s)
    else:
        for s, part in zip(servers, parts):
            client.push(s, kjt, part)


def interleaved(variants: dict, batches) -> dict[str, list[float]]:
    """Seconds per step of every variant, the variants taking turns step by step (so that load from
    other processes hits them alike)."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    for batch in batches:
        for key, fn in variants.items():
            t0 = time.perf_counter()
            fn(batch)
            times[key].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=15, help="steps per block")
    ap.add_argument("--rounds", type=int, default=5, help="alternating blocks per variant and latency")
    ap.add_argument("--delays-ms", type=float, nargs="*", default=[0.0, 1.0, 5.0])
    ap.add_argument("--dense-layers", type=int, nargs="*", default=[512, 256, 16])
    ap.add_argument("--sharding", choices=["table_wise", "row_wise"], default="table_wise")
    ap.add_argument("--compress", choices=["fused8bit"], default=None)
    ap.add_argument("--unordered", action="store_true", help="servers do not order a client's requests")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not CRITEO.is_file():
        sys.exit(f"Criteo sample not found at {CRITEO}")
    batches = list(criteo_batches(CRITEO, args.batch_size, num_embeddings=1000,
                                  limit=args.batch_size * args.steps))
    dims = tuple(args.dense_layers)
    print(f"DLRM on PS: batch {args.batch_size}, 26 tables x 1000 x {dims[-1]} {args.sharding} on 2 servers, "
          f"compress={args.compress}, "
          f"dense arch {list(dims)}, over arch [64, 1]; {args.steps} steps/block, {args.rounds} rounds; "
          f"torch threads 1; transport uv (loopback)")
    with LocalCluster(2, timeout_s=60) as cluster:
        base = build("base", args, dims, cluster.server_names)
        fast = scheduling.async_rpc(build("async", args, dims, cluster.server_names))
        stale = scheduling.async_rpc(build("stale1", args, dims, cluster.server_names), max_staleness=1)
        base_client = scheduling.ps.get_client("base")
        answers = {s: base_client.fetch(s, batches[0][1]).detach() for s in range(2)}
        local = build("memory", args, dims, cluster.server_names, base_client, answers)
        mem_batches = [batches[0]] * len(batches)
        for gm in (base, fast, stale, local):  # warm-up
            time_block(gm, batches[:3] if gm is not local else mem_batches[:3])
        print(f"{'delay':>6} {'base ms':>8} {'async ms':>9} {'QPS base':>9} {'QPS async':>10} {'gain %':>7} "
              f"{'C ms':>6} {'Fseq ms':>8} {'Fpar ms':>8} {'ideal %':>8} {'share':>6}  spread base/async ms"
              f"  | deferred pushes (max_staleness=1, exact): ms, gain %, share")
        for delay in args.delays_ms:
            base_client.set_delays(fetch_delay_s=delay / 1000)
            variants = {"base": lambda b: base(*b), "async": lambda b: fast(*b),
                        "C": lambda b: local(*batches[0]),
                        "F": lambda b: rpc_step(base_client, b[1], parallel=False),
                        "Fpar": lambda b: rpc_step(base_client, b[1], parallel=True)}
            t: dict[str, list[float]] = {k: [] for k in [*variants, "stale"]}
            for _ in range(args.rounds):
                for key, values in interleaved(variants, batches).items():
                    t[key].append(statistics.median(values))
                t["stale"].append(time_block(stale, batches))  # in blocks: its pushes outlive a step
                scheduling.ps.get_client("stale1").flush()
            m = {k: statistics.median(v) for k, v in t.items()}
            gain = m["base"] / m["async"] - 1
            ideal = m["base"] / max(m["C"], m["Fpar"]) - 1
            stale_gain = m["base"] / m["stale"] - 1
            print(f"{delay:>5.0f}m {m['base'] * 1e3:>8.2f} {m['async'] * 1e3:>9.2f} "
                  f"{args.batch_size / m['base']:>9.0f} {args.batch_size / m['async']:>10.0f} {gain * 100:>7.1f} "
                  f"{m['C'] * 1e3:>6.2f} {m['F'] * 1e3:>8.2f} {m['Fpar'] * 1e3:>8.2f} {ideal * 100:>8.1f} {gain / ideal:>6.0%}  "
                  f"{min(t['base']) * 1e3:.1f}..{max(t['base']) * 1e3:.1f} / "
                  f"{min(t['async']) * 1e3:.1f}..{max(t['async']) * 1e3:.1f}"
                  f"  | {m['stale'] * 1e3:.2f} {stale_gain * 100:.1f} {stale_gain / ideal:.0%}", flush=True)
        base_client.set_delays(0.0)
        for name in ("base", "async", "stale1", "memory"):
            scheduling.ps.get_client(name).close()


if __name__ == "__main__":
    main()
