"""Benchmark of the parameter-server transports: ``torch_rpc`` (TensorPipe, TCP) vs ``ray`` and ``socket``.

In one run, for each transport, against a :class:`scheduling.ps.LocalCluster` on loopback (no emulated
latency unless ``--latency-ms``):

1. round-trip latency of a small lookup (batch 8, one 16-float table) and of a small push (its gradient),
   the median of blocking calls over ``--budget`` seconds each;
2. throughput of large answers: a lookup answering 1 MiB and 16 MiB (``(B, 64)`` float32, B = 4096 and 65536
   bags of one id), in MB/s (answer bytes / median round trip, so it includes the server's gather);
3. a small job: torchrec's ``DLRM`` (26 tables of 20000 x 16) with its tables moved by the
   ``parameter_servers`` pass to 2 servers, one trainer, trained with blocking lookups and with
   ``async_rpc_prefetch``: QPS (samples/s) of each (the setup of benchmarks/placement.py).

It prints one table: each number for every transport (``--transports``, default all three: ``ray`` is Ray actor
calls, ``socket`` the lean TCP transport of ``scheduling.ps.transport.socket_transport``) and the ratio of each other one
to torch_rpc (for latencies lower is better, for MB/s and QPS higher is better).

Usage::

    .venv/bin/python benchmarks/transport.py [--steps 40] [--batch 256] [--budget 2.0] [--latency-ms 0]
        [--transports torch_rpc ray socket]

Allocator: runs with ``MALLOC_MMAP_THRESHOLD_=33554432`` (re-executes itself; glibc's defaults
page-fault on every batch). One torch thread
in the trainer and in each server.
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's `scheduling` package, not benchmarks/scheduling.py
TRANSPORTS = ("torch_rpc", "ray", "socket")
MIB = 1 << 20


def _kjt(batch: int, rows: int, seed: int = 0) -> Any:
    import torch
    from torchrec import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(seed)
    return KeyedJaggedTensor(keys=["f0"], values=torch.randint(0, rows, (batch,), generator=gen),
                             lengths=torch.ones(batch, dtype=torch.int32))


def _round_trips(cluster: Any, budget_s: float) -> dict[str, float]:
    """Lookup and push latency (ms) and the MB/s of 1 MiB and 16 MiB answers, on server 0."""
    import _bench
    import torch

    from scheduling.ps import PSClient, TableSpec

    out = {}
    small = PSClient([TableSpec("t", 1000, 16, ("f0",))], cluster.server_names[:1], name="rt_small", optimizer="sgd")
    try:
        kjt = _kjt(8, 1000)
        out["lookup latency (ms)"] = _bench.median_ms(lambda k: small.lookup(0, k), kjt, budget_s)
        grad = torch.ones(8, 16)
        out["push latency (ms)"] = _bench.median_ms(
            lambda k: small.finish_push(small.push_grad_async(0, k, grad), 0), kjt, budget_s)
    finally:
        small.close()
    big = PSClient([TableSpec("t", 100_000, 64, ("f0",))], cluster.server_names[:1], name="rt_big", optimizer="sgd")
    try:
        for mib in (1, 16):
            kjt = _kjt(mib * MIB // (64 * 4), 100_000, seed=mib)
            ms = _bench.median_ms(lambda k: big.lookup(0, k), kjt, budget_s)
            out[f"{mib} MiB answer (MB/s)"] = mib * MIB / 1e6 / (ms / 1e3)
    finally:
        big.close()
    return out


def _job_qps(steps: int, batch: int) -> dict[str, float]:
    """QPS of the DLRM with its tables on the servers: blocking lookups vs ``async_rpc_prefetch``."""
    import placement as bench_placement  # benchmarks/placement.py (this folder is on sys.path)
    import torch
    import torch.nn.functional as F

    import fxdist
    import scheduling
    from scheduling import placement

    batches = bench_placement._criteo_batches(steps + 1, batch)
    factory = bench_placement._criteo_models()["DLRM"]
    to_servers = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=0.05, verbose=False)

    def bce(out: Any, y: Any) -> Any:
        return F.binary_cross_entropy_with_logits(out.squeeze(-1), y)

    out = {}
    for label, passes in (("job QPS blocking", (to_servers,)), ("job QPS async_rpc_prefetch",
                                                                (to_servers, "async_rpc_prefetch"))):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = fxdist.optimize(factory(), passes=passes)
        names = bench_placement._next_names(module, len(batches[0][0])) if "async_rpc_prefetch" in passes else []
        try:
            r = bench_placement._train(module, batches, bce, tables_sgd=True, prefetch_names=names)
        finally:
            placement.close(module)
        out[label] = steps * batch / r["seconds"]
    return out


def measure(transport: str, args: argparse.Namespace) -> dict[str, float]:
    """Every number for one transport (its own LocalCluster; Ray is started and stopped for ``ray``)."""
    from scheduling.ps import LocalCluster

    with LocalCluster(2, transport=transport, fetch_delay_s=args.latency_ms / 1e3, timeout_s=60) as cluster:
        out = _round_trips(cluster, args.budget)
        out.update(_job_qps(args.steps, args.batch))
    print(f"  {transport}: done", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="timed training steps per schedule")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--budget", type=float, default=2.0, help="seconds per latency / throughput measure")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="emulated network latency per lookup")
    parser.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS,
                        help="which to measure (torch_rpc always, as the reference)")
    args = parser.parse_args()
    import _bench  # this folder is sys.path[0]

    _bench.reexec_with_fixed_allocator()
    import torch

    torch.set_num_threads(1)
    print(f"2 parameter servers on loopback, emulated latency {args.latency_ms} ms per lookup, 1 torch thread; "
          f"job: torchrec DLRM, 26 tables 20000 x 16, batch {args.batch}, {args.steps} steps", flush=True)
    names = ["torch_rpc"] + [t for t in args.transports if t != "torch_rpc"]
    results = {t: measure(t, args) for t in names}
    others = names[1:]
    print(f"{'':<30}" + "".join(f"{t:>12}" for t in names) + "".join(f"{t + '/torch_rpc':>20}" for t in others))
    for key in results["torch_rpc"]:
        base = results["torch_rpc"][key]
        print(f"{key:<30}" + "".join(f"{results[t][key]:>12.2f}" for t in names)
              + "".join(f"{results[t][key] / base:>20.3f}" for t in others))
    for t in names:
        r = results[t]
        print(f"{t}: prefetch/blocking {r['job QPS async_rpc_prefetch'] / r['job QPS blocking']:.3f}")


if __name__ == "__main__":
    main()
