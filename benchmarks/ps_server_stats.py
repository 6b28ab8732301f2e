"""What a parameter server's own statistics cost per request (``scheduling/ps/server_stats.py``), against peers measured
in the same run.

Two measurements, interleaved (medians reported):

1. ``stats``: what each request adds on the server: ``ServerStats.track`` (pending) + ``timed`` (two
   ``perf_counter`` calls, a ``bisect`` and a lock) around a no-op, and the report; peer: the same done with
   prometheus client_python per request (a labelled ``Gauge.inc``/``dec`` for pending, ``Histogram.observe`` with
   the same two ``perf_counter`` calls), and a bare call of the no-op;
2. ``request``: a whole small lookup request through the ``torch_rpc`` handlers (``ServerEndpoints.submit``: the
   request order, the lookup of 4 tables, batch 64), with the server's stats and with a no-op stand-in for them:
   the ratio is the share of a request the statistics take.

Run: ``.venv/bin/python benchmarks/ps_server_stats.py [--blocks 7]``. Prints nanoseconds per call and ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's scheduling, not benchmarks/scheduling.py


class _NoStats:
    """A stand-in for ``ServerStats`` that measures nothing (the peer of measurement 2)."""

    def timed(self, kind: str, namespace: str, fn: Any) -> Any:
        return fn

    def track(self, done: Any) -> Any:
        return done


def _per_call_ns(fn: Any, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20000, help="calls per block of measurement 1")
    parser.add_argument("--requests", type=int, default=500, help="requests of each kind per block of measurement 2")
    args = parser.parse_args()

    from prometheus_client import CollectorRegistry, Gauge, Histogram

    from scheduling.ps.endpoints import ServerEndpoints
    from scheduling.ps.server import PSServer
    from scheduling.ps.server_stats import BUCKETS, ServerStats
    from scheduling.ps.shard_plan import TableSpec, plan_shards

    stats = ServerStats()
    child = Histogram("x_seconds", "x", ("job", "rank", "phase"), registry=CollectorRegistry(),
                      buckets=BUCKETS).labels(job="j", rank="ps0", phase="optimized")
    pending = Gauge("p", "p", ("job", "rank"), registry=CollectorRegistry()).labels(job="j", rank="ps0")

    def noop() -> None:
        return None

    def report(value: Any, error: Any) -> None:
        return None

    def ours() -> None:
        stats.track(report)(stats.timed("lookup", "ns", noop)(), None)

    def prometheus() -> None:
        pending.inc()
        t0 = time.perf_counter()
        noop()
        child.observe(time.perf_counter() - t0)
        pending.dec()

    tables = [TableSpec(f"t{i}", 1000, 16, (f"f{i}",)) for i in range(4)]
    server = PSServer("ps0")
    server.configure("ns", plan_shards(tables, 1), 0, "rowwise_adagrad", {"lr": 0.1}, seed=0)
    ends = ServerEndpoints(server)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 4, (4 * 64,), generator=gen)
    batch = (tuple(f"f{i}" for i in range(4)), torch.randint(0, 1000, (int(lengths.sum()),), generator=gen), lengths,
             None)
    seq = [0]

    def request() -> None:
        ends.submit("lookup", ("ns", batch, None, ("bench", seq[0], 10.0)), report)
        seq[0] += 1

    real, none = server.stats, _NoStats()
    results: dict[str, list[float]] = {k: [] for k in ("bare", "ours", "prometheus", "request", "request_nostats")}
    for _ in range(args.blocks):
        results["bare"].append(_per_call_ns(noop, args.calls))
        results["ours"].append(_per_call_ns(ours, args.calls))
        results["prometheus"].append(_per_call_ns(prometheus, args.calls))
        for i in range(2 * args.requests):  # alternating request by request: both see the same load
            key = "request" if i % 2 == 0 else "request_nostats"
            server.stats = real if key == "request" else none  # type: ignore[assignment]
            results[key].append(_per_call_ns(request, 1))
    med = {k: statistics.median(v) for k, v in results.items()}
    print("per call, medians (ns): " + ", ".join(f"{k} {v:.0f}" for k, v in med.items()))
    print(f"stats added per request: ServerStats {med['ours'] - med['bare']:.0f} ns vs prometheus_client (Gauge inc/dec + Histogram.observe) "
          f"{med['prometheus'] - med['bare']:.0f} ns: ratio {(med['ours'] - med['bare']) / (med['prometheus'] - med['bare']):.2f}")
    print(f"a lookup request (4 tables, batch 64) with / without the server's stats: ratio "
          f"{med['request'] / med['request_nostats']:.3f}")


if __name__ == "__main__":
    main()
