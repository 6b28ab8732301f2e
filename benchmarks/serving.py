"""``fxdist serve``'s cost: the Ray Serve deployment's latency and QPS against eager PyTorch on the same model.

A run folder of the bundled DLRM in the default job's shape (26 tables of ``[model] table_size`` x 16, the default
MLPs; random weights: speed does not depend on them) is written to a temporary folder and deployed with
:func:`jobs.launcher.serving.start` on a free loopback port (one replica). ``--clients`` client threads, each with its
own keep-alive HTTP connection, ``POST /predict`` batches of ``B`` Criteo lines for ``--seconds``; every request's
latency is recorded. The peer, in this process, by as many threads: the same lines parsed by the same reader
(:func:`jobs.launcher.serving_inputs.criteo_rows`) and scored by the eager model (``torch.inference_mode``), i.e. the
work of a request without HTTP, JSON and Ray Serve's proxy and router (the same concurrency, so that on a loaded
machine each gets a like share of the CPU: a single-threaded peer got about 3x less than the replica's threads). Rounds alternate the two (serve then eager,
for each batch size); the script prints per batch size the medians over rounds of p50 and p99 latency (ms) and of
QPS (rows/s), and the ratios serve / eager. Clients, proxy, replica and the eager peer share the machine's cores:
on a 2-core machine the figures are those of a box serving its own load generator, so read them with the load
average printed with them.

Run: ``.venv/bin/python benchmarks/serving.py [--rounds 3 --seconds 5 --clients 4 --batches 1,256] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))  # first: benchmarks/scheduling.py must not hide the scheduling package

import _bench  # noqa: E402


def _lines(n: int, folder: Path) -> list[str]:
    """``n`` Criteo lines: the shared sample's when present, else synthetic ones."""
    from recsys.shared_data import default_criteo_path

    path = default_criteo_path()
    if path is None or not Path(path).is_file():
        from recsys.criteo_synth import write_synthetic

        path = write_synthetic(folder / "synth", n, files=1)[0]
    with open(path, encoding="utf-8") as f:
        lines = [ln.rstrip("\n") for _, ln in zip(range(n), f)]
    return (lines * (n // len(lines) + 1))[:n]


def _run_folder(folder: Path, table_size: int):
    """A run folder of the bundled DLRM in the default job's shape (tables in the model); the config and model."""
    from jobs import criteo
    from jobs.config import JobConfig
    from jobs.launcher.model_export import write_model_dir

    config = JobConfig().replace(model={"table_size": table_size}, cluster={"parameter_servers": 0})
    model = criteo.dlrm(config).eval()
    write_model_dir(folder, config, {"model": model.state_dict(), "tables": {}, "step": 0, "phase": "optimized"})
    return config, model


def _client(port: int, route: str, body: bytes, stop_at: float, out: list[float]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json"}
    while time.perf_counter() < stop_at:
        t0 = time.perf_counter()
        conn.request("POST", route, body, headers)
        answer = conn.getresponse()
        answer.read()
        if answer.status != 200:
            raise RuntimeError(f"POST {route}: HTTP {answer.status}")
        out.append(time.perf_counter() - t0)
    conn.close()


def _served(port: int, route: str, lines: list[str], clients: int, seconds: float) -> dict[str, float]:
    """p50 / p99 (ms) and QPS (rows/s) of ``clients`` threads posting ``lines`` for ``seconds``."""
    body = json.dumps({"rows": lines}).encode()
    _client(port, route, body, time.perf_counter() + 0.5, [])  # warm-up
    latencies: list[list[float]] = [[] for _ in range(clients)]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=_client, args=(port, route, body, t0 + seconds, out)) for out in latencies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    flat = sorted(x for out in latencies for x in out)
    return _summary(flat, len(lines) * len(flat) / wall)


def _eager(config, model, lines: list[str], clients: int, seconds: float) -> dict[str, float]:
    """The same requests' work in this process, by as many threads as there are clients: parse with the same
    reader, score eagerly (the same concurrency, so that on shared cores both get a like share of the CPU)."""
    import torch

    from jobs import criteo
    from jobs.launcher.serving_inputs import criteo_rows
    from jobs.table_sizes import reader_sizes

    sizes = reader_sizes(config)

    def once() -> None:
        dense, ids = criteo_rows(lines, sizes)
        with torch.inference_mode():
            torch.sigmoid(model(dense, criteo.to_kjt(ids))).reshape(-1).tolist()

    def loop(stop_at: float, out: list[float]) -> None:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            once()
            out.append(time.perf_counter() - t0)

    once()
    latencies: list[list[float]] = [[] for _ in range(clients)]
    start = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(start + seconds, out)) for out in latencies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    flat = sorted(x for out in latencies for x in out)
    return _summary(flat, len(lines) * len(flat) / wall)


def _summary(sorted_s: list[float], qps: float) -> dict[str, float]:
    def q(p: float) -> float:
        return sorted_s[min(len(sorted_s) - 1, int(p * len(sorted_s)))] * 1e3

    return {"p50": q(0.5), "p99": q(0.99), "qps": qps, "n": len(sorted_s)}


def _medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rounds) for k in ("p50", "p99", "qps", "n")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    parser.add_argument("--clients", type=int, default=4, help="concurrent HTTP clients")
    parser.add_argument("--batches", default="1,256", help="rows per request")
    parser.add_argument("--table-size", type=int, default=20000, help="rows of each of the 26 tables")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the record (benchmarks/_bench.py)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    record = _bench.Record("serving", "fxdist serve (Ray Serve, HTTP) vs eager PyTorch in one process, bundled DLRM",
                           {"rounds": args.rounds, "seconds": args.seconds, "clients": args.clients,
                            "table_size": args.table_size})
    record.group("p50", "p50 latency", "eager", "ms")
    record.group("p99", "p99 latency", "eager", "ms")
    record.group("qps", "throughput", "eager", "rows/s", lower_is_better=False)
    print(f"machine: {_bench.machine()}; load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    import ray

    from jobs.launcher import serving
    from scheduling.ps.transport.ports import free_port

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        run.mkdir()
        config, model = _run_folder(run, args.table_size)
        lines = _lines(max(batches), Path(tmp))
        ray.init(include_dashboard=False, log_to_driver=False)
        port = free_port()
        served = serving.start(run, port=port, metrics_port=0, name="bench", route_prefix="/")
        print(f"deployed at {served.url} (step {served.step})", flush=True)
        results = {b: {"serve": [], "eager": []} for b in batches}
        for r in range(args.rounds):
            for b in batches:
                results[b]["serve"].append(_served(port, "/predict", lines[:b], args.clients, args.seconds))
                results[b]["eager"].append(_eager(config, model, lines[:b], args.clients, args.seconds))
            print(f"round {r + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.2f}", flush=True)
        serving.stop("bench")
        ray.shutdown()
    for b in batches:
        s, e = _medians(results[b]["serve"]), _medians(results[b]["eager"])
        print(f"batch {b:4d}: serve p50 {s['p50']:7.2f} ms  p99 {s['p99']:7.2f} ms  {s['qps']:9.0f} rows/s "
              f"({s['n']:.0f} requests/round, {args.clients} clients) | eager p50 {e['p50']:7.2f} ms  p99 "
              f"{e['p99']:7.2f} ms  {e['qps']:9.0f} rows/s | serve/eager: p50 {s['p50'] / e['p50']:.2f}x  p99 "
              f"{s['p99'] / e['p99']:.2f}x  QPS {s['qps'] / e['qps']:.2f}x")
        for key in ("p50", "p99", "qps"):
            record.row(key, f"batch {b}", s[key], e[key],
                       spread=[a[key] / c[key] for a, c in zip(results[b]["serve"], results[b]["eager"])])
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    record.note(f"{args.clients} HTTP clients (and {args.clients} eager threads) in the benchmark's process, on the "
                "same cores as the replica")
    record.write(args.json)


if __name__ == "__main__":
    _bench.reexec_with_fixed_allocator()
    main()
