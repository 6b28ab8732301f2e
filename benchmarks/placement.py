"""Benchmark of the ``parameter_servers`` pass on users' own models: local tables vs servers, blocking vs prefetch.

For torchrec's ``DLRM`` and ``DLRM_DCN`` (26 Criteo-shaped tables) and a MovieLens-100K matrix-factorization
model (user and item tables; ``../shared/data/movielens-100k/u.data`` when present, else ratings drawn from
the same ranges), one trainer process trains, in the same run and on the same batches:

1. ``local``: the model as written, tables in the process (torch.optim.SGD on the tables, Adam on the rest;
   torchrec's EmbeddingBagCollection and a default ``nn.Embedding`` give dense table gradients, so for
   large tables the local step pays a full-table update);
2. ``ps blocking``: ``fxdist.optimize(model, passes=(parameter_servers(sgd),))``: every lookup is a blocking
   ``ps_lookup`` to the servers of a :class:`scheduling.ps.LocalCluster` (2 servers, loopback, with an
   emulated network latency of ``--latency-ms`` per lookup);
3. ``ps + prefetch``: the same plus ``async_rpc_prefetch`` (each step's push carries the next batch's lookup).

It prints QPS (samples/s) of each, the ratios prefetch/blocking and blocking/local, and the share of each
step the trainer spends waiting on fetches (time in ``PSClient.finish_lookup``).

Usage::

    .venv/bin/python benchmarks/placement.py [--steps 60] [--batch 256] [--latency-ms 1.0]

Allocator: runs with ``MALLOC_MMAP_THRESHOLD_=33554432`` (re-executes itself; glibc's defaults
page-fault on every batch). One torch thread.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's `scheduling` package, not benchmarks/scheduling.py
MOVIELENS = ROOT.parent / "shared" / "data" / "movielens-100k" / "u.data"


def _criteo_models(dim: int = 16, rows: int = 20000) -> dict[str, Callable[[], Any]]:
    from torchrec import EmbeddingBagCollection
    from torchrec.models.dlrm import DLRM_DCN

    from recsys.criteo import criteo_dlrm, criteo_tables

    def ebc():
        return EmbeddingBagCollection(tables=criteo_tables(rows, dim))

    return {"DLRM": lambda: criteo_dlrm(rows, dim, dense_layers=(512, 256, dim), over_layers=(512, 256, 1)),
            "DLRM_DCN": lambda: DLRM_DCN(embedding_bag_collection=ebc(), dense_in_features=13,
                                         dense_arch_layer_sizes=[512, 256, dim], over_arch_layer_sizes=[512, 256, 1],
                                         dcn_num_layers=3, dcn_low_rank_dim=64)}


def _criteo_batches(steps: int, batch: int, rows: int = 20000) -> list[tuple[tuple, Any]]:
    import torch
    from torchrec import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps + 1):
        ids = torch.randint(0, rows, (26 * batch,), generator=gen)
        kjt = KeyedJaggedTensor(keys=[f"C{j + 1}" for j in range(26)], values=ids,
                                lengths=torch.ones(26 * batch, dtype=torch.int32))
        out.append(((torch.rand(batch, 13, generator=gen), kjt), torch.rand(batch, generator=gen).round()))
    return out


class MatrixFactorization:
    """Factory of a MovieLens model: user and item ``nn.Embedding`` tables, dot product plus biases and an MLP on
    the concatenation (ratings 1..5). Shapes: ``users (B,)``, ``items (B,)`` int64 -> ``(B,)`` rating."""

    def __new__(cls, users: int = 943, items: int = 1682, dim: int = 32):
        import torch
        from torch import nn

        class MF(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.user = nn.Embedding(users + 1, dim)
                self.item = nn.Embedding(items + 1, dim)
                self.mlp = nn.Sequential(nn.Linear(2 * dim, 64), nn.ReLU(), nn.Linear(64, 1))

            def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
                u, i = self.user(users), self.item(items)
                return (u * i).sum(1) + self.mlp(torch.cat([u, i], dim=1)).squeeze(1) + 3.5

        return MF()


def _movielens_batches(steps: int, batch: int) -> tuple[list[tuple[tuple, Any]], str]:
    import torch

    if MOVIELENS.is_file():
        rows = torch.tensor([[int(x) for x in line.split("\t")[:3]] for line in MOVIELENS.read_text().splitlines()])
        source = f"MovieLens-100K ({rows.shape[0]} ratings)"
    else:
        gen = torch.Generator().manual_seed(0)
        rows = torch.stack([torch.randint(1, 944, (100000,), generator=gen), torch.randint(1, 1683, (100000,), generator=gen),
                            torch.randint(1, 6, (100000,), generator=gen)], dim=1)
        source = f"random ratings ({MOVIELENS} not found)"
    out = []
    for s in range(steps + 1):
        idx = torch.arange(s * batch, (s + 1) * batch) % rows.shape[0]
        out.append(((rows[idx, 0], rows[idx, 1]), rows[idx, 2].float()))
    return out, source


def _train(module: Any, batches: list, loss_fn: Callable, tables_sgd: bool, prefetch_names: list[str]) -> dict:
    """Train ``module`` on ``batches`` (the first is a warm-up step); returns seconds and fetch-wait seconds."""
    import torch

    from scheduling.ps import get_client

    dense = [p for n, p in module.named_parameters() if not tables_sgd or "embedding" not in n and "user." not in n
             and "item." not in n]
    tables = [p for p in module.parameters() if all(p is not d for d in dense)]
    opts = [torch.optim.Adam(dense, lr=1e-3)] + ([torch.optim.SGD(tables, lr=0.05)] if tables else [])
    waited = [0.0]
    for name in _client_names(module):
        client = get_client(name)
        finish = client.finish_lookup

        def timed(fut, server, finish=finish):
            t0 = time.perf_counter()
            try:
                return finish(fut, server)
            finally:
                waited[0] += time.perf_counter() - t0

        client.finish_lookup = timed
    t_start, wait_start = None, 0.0
    for i, ((inputs, labels), nxt) in enumerate(zip(batches, batches[1:] + [None])):
        if i == 1:
            t_start, wait_start = time.perf_counter(), waited[0]
        kwargs = {n: nxt[0][j] for j, n in enumerate(prefetch_names) if n and nxt is not None}
        loss = loss_fn(module(*inputs, **kwargs), labels)
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
    from scheduling import placement

    if _client_names(module):
        placement.flush(module)
    seconds = time.perf_counter() - t_start
    return {"seconds": seconds, "wait": waited[0] - wait_start}


def _client_names(module: Any) -> list[str]:
    from scheduling import placement

    return placement.client_names(module) if hasattr(module, "meta") else []


def _next_names(gm: Any, inputs: int) -> list[str]:
    """For each positional input of the model, the ``next_<input>`` keyword the optimized module takes, or ''."""
    import inspect

    params = list(inspect.signature(gm.forward).parameters)
    return [f"next_{p}" if f"next_{p}" in params else "" for p in params[:inputs]]


def run_model(name: str, factory: Callable, batches: list, loss_fn: Callable, batch: int) -> None:
    import torch

    import fxdist
    import scheduling
    from scheduling import placement

    torch.manual_seed(0)
    to_servers = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=0.05, verbose=False)
    results = {}
    for label, passes in (("local", None), ("ps blocking", (to_servers,)),
                          ("ps + prefetch", (to_servers, "async_rpc_prefetch"))):
        torch.manual_seed(0)
        model = factory()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = model if passes is None else fxdist.optimize(model, passes=passes)
        names = _next_names(module, len(batches[0][0])) if passes and "async_rpc_prefetch" in passes else []
        results[label] = _train(module, batches, loss_fn, tables_sgd=True, prefetch_names=names)
        if passes is not None:
            placement.close(module)
    steps = len(batches) - 1
    print(f"{name}: {steps} steps of {batch}")
    for label, r in results.items():
        qps = steps * batch / r["seconds"]
        share = 100 * r["wait"] / r["seconds"]
        print(f"  {label:<14} QPS {qps:9.1f}   waiting on fetches {share:5.1f} % of the step")
    q = {k: steps * batch / v["seconds"] for k, v in results.items()}
    print(f"  ratios: prefetch/blocking {q['ps + prefetch'] / q['ps blocking']:.3f}, "
          f"blocking/local {q['ps blocking'] / q['local']:.3f}, prefetch/local {q['ps + prefetch'] / q['local']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--latency-ms", type=float, default=1.0, help="emulated network latency per lookup")
    args = parser.parse_args()
    import _bench  # this folder is sys.path[0]

    _bench.reexec_with_fixed_allocator()
    import torch
    import torch.nn.functional as F

    from scheduling.ps import LocalCluster

    torch.set_num_threads(1)
    print(f"one trainer, 2 parameter servers on loopback, emulated latency {args.latency_ms} ms per lookup, "
          "1 torch thread")
    with LocalCluster(2, fetch_delay_s=args.latency_ms / 1e3, timeout_s=60):
        criteo = _criteo_batches(args.steps, args.batch)

        def bce(out, y):
            return F.binary_cross_entropy_with_logits(out.squeeze(-1), y)

        for name, factory in _criteo_models().items():
            run_model(name, factory, criteo, bce, args.batch)
        ratings, source = _movielens_batches(args.steps, args.batch)
        print(f"MovieLens data: {source}")
        run_model("MovieLens MF", MatrixFactorization, ratings, F.mse_loss, args.batch)


if __name__ == "__main__":
    main()
