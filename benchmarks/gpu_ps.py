"""A GPU trainer with its embedding tables on CPU parameter servers: QPS and the share of each step spent
waiting for rows.

The model is torchrec's ``DLRM`` over 26 Criteo-layout tables (13 dense features, one id per table and
sample; ids drawn uniformly). The trainer is this process on one GPU (``--device``); the servers are
``LocalCluster`` processes on the CPU. Three variants of the same training step (BCE loss, backward, SGD on
the dense part and on the tables: sparse gradients locally, ``"sgd"`` on the servers), measured in interleaved
rounds for 1 and 2 servers and an added server latency of 0 and 1 ms per lookup:

- ``local``: the tables in GPU memory (torchrec's ``EmbeddingBagCollection`` on the device), no server;
- ``blocking``: ``scheduling.parameter_servers``: each step's lookups are blocking RPCs, the rows copied to
  the GPU when they arrive;
- ``prefetch``: plus ``async_rpc_prefetch``: the next batch's lookup rides on this step's push, and its rows'
  host-to-device copy is issued on a side CUDA stream as soon as they arrive (:mod:`scheduling.ps.device`).

Prints per setting: QPS (samples/s), the ratio to ``local`` and to ``blocking``, and ``wait %``: the share of
the step the trainer's host thread spent blocked in ``PSClient.finish_lookup`` (waiting for a lookup's answer).
The spread is min..max over rounds.

Run: ``python benchmarks/gpu_ps.py [--rows 100000 --dim 64 --batch 2048 --steps 20 --rounds 3]``; without CUDA
it stops with a message unless ``--device cpu`` (the same comparison with a CPU trainer).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import fxdist  # noqa: E402
import scheduling  # noqa: E402
from recsys.criteo import criteo_dlrm, criteo_kjt  # noqa: E402
from scheduling import placement  # noqa: E402
from scheduling.ps import LocalCluster, get_client  # noqa: E402
from scheduling.ps.client import PSClient  # noqa: E402

VARIANTS = ("local", "blocking", "prefetch")
WAITED = {"s": 0.0}


def _timed_finish_fetch(original):
    @functools.wraps(original)
    def finish_lookup(self, fut, server):
        t0 = time.perf_counter()
        try:
            return original(self, fut, server)
        finally:
            WAITED["s"] += time.perf_counter() - t0
    return finish_lookup


PSClient.finish_lookup = _timed_finish_fetch(PSClient.finish_lookup)


def batches(args, device: torch.device, count: int) -> list[tuple]:
    """``count`` batches ``(dense (B, 13), kjt, labels (B,))``: dense and labels on ``device``, the ids on the
    CPU for the servers' variants (the trainer sends them there) and a copy on ``device`` for ``local``."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(0, args.rows, (args.batch, 26), generator=gen)
        kjt = criteo_kjt(ids)
        out.append((torch.rand(args.batch, 13, generator=gen).to(device), kjt, kjt.to(device),
                    torch.rand(args.batch, generator=gen).round().to(device)))
    return out


def build(variant: str, args, device: torch.device):
    torch.manual_seed(0)
    model = criteo_dlrm(args.rows, args.dim, dense_layers=(512, 256, args.dim), over_layers=(512, 256, 1),
                        sparse_grad=variant == "local").to(device)
    if variant == "local":
        return model
    ps = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=0.01, verbose=False,
                           client=f"bench-{variant}")
    return fxdist.optimize(model, passes=(ps, "async_rpc_prefetch") if variant == "prefetch" else (ps,))


def run(variant: str, model, data: list[tuple], device: torch.device, steps: int) -> tuple[float, float]:
    """(samples/s, share of the time blocked on lookups) over ``steps`` steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    local = variant == "local"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    WAITED["s"] = 0.0
    start = time.perf_counter()
    for i in range(steps):
        dense, kjt, kjt_dev, labels = data[i % len(data)]
        extra = {}
        if variant == "prefetch":
            extra = {"next_sparse_features": data[(i + 1) % len(data)][1] if i + 1 < steps else None}
        logits = model(dense, kjt_dev if local else kjt, **extra).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if not local:
        placement.flush(model)
    sync()
    seconds = time.perf_counter() - start
    return steps * data[0][0].shape[0] / seconds, WAITED["s"] / seconds


def measure(args, device: torch.device, latency_ms: float, models: dict) -> dict[str, list]:
    """Per variant, ``[(QPS, wait share)]`` of each round (the variants take turns within a round)."""
    for name in ("blocking", "prefetch"):   # the servers are shared: one client sets their delay for all
        get_client(placement.client_names(models[name])[0]).set_delays(fetch_delay_s=latency_ms / 1e3)
    data = batches(args, device, len(VARIANTS) + args.steps)
    found: dict[str, list] = {v: [] for v in models}
    for name, model in models.items():  # warm-up (allocator, kernels, RPC connections)
        run(name, model, data, device, args.warmup)
    for _ in range(args.rounds):
        for name, model in models.items():
            found[name].append(run(name, model, data, device, args.steps))
    return found


def report(servers: int, latency_ms: float, found: dict[str, list]) -> None:
    qps = {v: statistics.median(q for q, _ in runs) for v, runs in found.items()}
    for v, runs in found.items():
        lo, hi = min(q for q, _ in runs), max(q for q, _ in runs)
        wait = statistics.median(w for _, w in runs) * 100
        print(f"{servers:>7} {latency_ms:>6.0f} {v:<9} {qps[v]:>10,.0f} {lo:>9,.0f}..{hi:<9,.0f} "
              f"{qps[v] / qps['local']:>7.2f} {qps[v] / qps['blocking']:>10.2f} {wait:>7.1f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=100_000, help="rows per table")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--servers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 1.0])
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_ps.py: no CUDA device here (torch.cuda.is_available() is False); this benchmark measures a "
                 "GPU trainer. Run it on a GPU machine, or with --device cpu for the same comparison on the CPU.")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torchrec DLRM, 26 tables x {args.rows:,} x {args.dim}, batch {args.batch}, trainer on {device} "
          f"({name}), torch {torch.__version__}; servers on CPU processes; {args.rounds} rounds x {args.steps} steps")
    print(f"{'servers':>7} {'ms':>6} {'variant':<9} {'QPS':>10} {'spread':>20} {'/local':>7} {'/blocking':>10} "
          f"{'wait %':>7}")
    for servers in args.servers:
        with LocalCluster(servers, timeout_s=120):
            models = {v: build(v, args, device) for v in VARIANTS}
            try:
                for latency in args.latency_ms:
                    report(servers, latency, measure(args, device, latency, models))
            finally:
                for v in ("blocking", "prefetch"):
                    placement.close(models[v])


if __name__ == "__main__":
    main()
