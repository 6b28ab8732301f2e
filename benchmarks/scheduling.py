"""Training QPS of a DLRM on 2 parameter servers: blocking fetches vs the async_rpc pass.

One trainer (this process, 1 torch thread) and 2 servers on loopback (TCP transport). For an added
server-side latency of 0, 1 and 5 ms per fetch, the same traced train step runs as is (baseline) and after
``scheduling.async_rpc`` (async), in alternating blocks, with the ideal overlap bound measured in the same
run:

- compute C: the train step with the fetches served from memory and the pushes dropped (no RPC);
- fetch F: the step's RPCs alone, blocking, in the baseline's order (2 fetches + 2 pushes);
- ideal: a step cannot beat max(C, F), so the ideal gain is (C + F) / max(C, F) - 1.

Prints per latency: median step times, QPS, gain % = T_base / T_async - 1, and the share of the ideal gain
reached. Timings are medians over blocks; the spread (min..max of block medians) shows the noise of a
shared 2-core machine.

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
        super().__init__(like.tables, like.servers, sharding={t.name: "row_wise" for t in like.tables},
                         name=name, configure=False)
        self.answers = answers

    def fetch(self, server, kjt):
        return self.answers[server].clone().requires_grad_(torch.is_grad_enabled())

    def push(self, server, kjt, fetched):
        fetched.grad = None
        return 0


def build(name: str, batch_size: int, dims: tuple[int, ...], servers: list[str], memory_of: PSClient | None = None,
          answers=None):
    if memory_of is None:
        PSClient(criteo_tables(1000, dims[-1]), servers, sharding="row_wise", optimizer_kwargs={"lr": 0.01},
                 name=name, seed=0)
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


def rpc_only(client: PSClient, batches) -> float:
    """Median seconds of the baseline's RPCs alone: blocking fetch per server, then push per server."""
    times = []
    for _, kjt, _ in batches:
        t0 = time.perf_counter()
        parts = [client.fetch(s, kjt) for s in range(len(client.servers))]
        for s, part in enumerate(parts):
            part.grad = torch.zeros_like(part)
            client.push(s, kjt, part)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=15, help="steps per block")
    ap.add_argument("--rounds", type=int, default=5, help="alternating blocks per variant and latency")
    ap.add_argument("--delays-ms", type=float, nargs="*", default=[0.0, 1.0, 5.0])
    ap.add_argument("--dense-layers", type=int, nargs="*", default=[512, 256, 16])
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not CRITEO.is_file():
        sys.exit(f"Criteo sample not found at {CRITEO}")
    batches = list(criteo_batches(CRITEO, args.batch_size, num_embeddings=1000,
                                  limit=args.batch_size * args.steps))
    dims = tuple(args.dense_layers)
    print(f"DLRM on PS: batch {args.batch_size}, 26 tables x 1000 x {dims[-1]} row-wise on 2 servers, "
          f"dense arch {list(dims)}, over arch [64, 1]; {args.steps} steps/block, {args.rounds} rounds; "
          f"torch threads 1; transport uv (loopback)")
    with LocalCluster(2, timeout_s=60) as cluster:
        base = build("base", args.batch_size, dims, cluster.server_names)
        fast = scheduling.async_rpc(build("async", args.batch_size, dims, cluster.server_names))
        base_client = scheduling.ps.get_client("base")
        answers = {s: base_client.fetch(s, batches[0][1]).detach() for s in range(2)}
        local = build("memory", args.batch_size, dims, cluster.server_names, base_client, answers)
        mem_batches = [batches[0]] * len(batches)
        for gm in (base, fast, local):  # warm-up
            time_block(gm, batches[:3] if gm is not local else mem_batches[:3])
        print(f"{'delay':>6} {'base ms':>8} {'async ms':>9} {'QPS base':>9} {'QPS async':>10} {'gain %':>7} "
              f"{'C ms':>6} {'F ms':>6} {'ideal %':>8} {'share':>6}  spread base/async ms")
        for delay in args.delays_ms:
            base_client.set_delays(fetch_delay_s=delay / 1000)
            t = {"base": [], "async": [], "C": [], "F": []}
            for _ in range(args.rounds):
                t["base"].append(time_block(base, batches))
                t["async"].append(time_block(fast, batches))
                t["C"].append(time_block(local, mem_batches))
                t["F"].append(rpc_only(base_client, batches))
            m = {k: statistics.median(v) for k, v in t.items()}
            gain = m["base"] / m["async"] - 1
            ideal = (m["C"] + m["F"]) / max(m["C"], m["F"]) - 1
            print(f"{delay:>5.0f}m {m['base'] * 1e3:>8.2f} {m['async'] * 1e3:>9.2f} "
                  f"{args.batch_size / m['base']:>9.0f} {args.batch_size / m['async']:>10.0f} {gain * 100:>7.1f} "
                  f"{m['C'] * 1e3:>6.2f} {m['F'] * 1e3:>6.2f} {ideal * 100:>8.1f} {gain / ideal:>6.0%}  "
                  f"{min(t['base']) * 1e3:.1f}..{max(t['base']) * 1e3:.1f} / "
                  f"{min(t['async']) * 1e3:.1f}..{max(t['async']) * 1e3:.1f}", flush=True)
        base_client.set_delays(0.0)
        for name in ("base", "async", "memory"):
            scheduling.ps.get_client(name).close()


if __name__ == "__main__":
    main()
