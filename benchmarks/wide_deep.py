"""Wide & Deep with one embedding module per feature (53 modules) vs the same features in one torchrec
``EmbeddingBagCollection``, both with their tables on 2 parameter servers and ``async_rpc_prefetch``; the 53
modules grouped into one request per server (``group_tables=True``, the default) and one client per module
(``group_tables=False``).

The 53-module model: 26 ``nn.EmbeddingBag(R, 16)`` (deep) and 27 ``nn.EmbeddingBag(R, 1)`` (wide: one per
categorical feature plus one more on the first), each reading its column of a ``(B, 26)`` id tensor; a
2-layer MLP over the deep part and the 13 dense features, plus the wide sum. The one-EBC model: the same 53
tables in one collection fed by one ``KeyedJaggedTensor``. One trainer (this process, one torch thread), 2 servers
of a ``LocalCluster`` on loopback, SGD on the servers; the three variants take turns, round by round; QPS
(samples/s) after 3 warm-up steps, and per round the ratios of the 53-module variants to one EBC.

Run: ``.venv/bin/python benchmarks/wide_deep.py [--steps 20 --rounds 3]``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402

import fxdist  # noqa: E402
import scheduling  # noqa: E402
from scheduling import placement  # noqa: E402
from scheduling.ps import LocalCluster  # noqa: E402

R, B = 10000, 128

class WideDeep(nn.Module):
    def __init__(self):
        super().__init__()
        self.deep = nn.ModuleList([nn.EmbeddingBag(R, 16, mode="sum") for _ in range(26)])
        self.wide = nn.ModuleList([nn.EmbeddingBag(R, 1, mode="sum") for _ in range(27)])
        self.mlp = nn.Sequential(nn.Linear(26 * 16 + 13, 256), nn.ReLU(), nn.Linear(256, 1))
    def forward(self, dense, ids):
        deep = torch.cat([dense] + [m(ids[:, j:j + 1]) for j, m in enumerate(self.deep)], 1)
        wide = sum(m(ids[:, j % 26:j % 26 + 1]) for j, m in enumerate(self.wide))
        return (self.mlp(deep) + wide).squeeze(1)

class OneEBC(nn.Module):
    def __init__(self):
        super().__init__()
        t = [EmbeddingBagConfig(name=f"d{j}", embedding_dim=16, num_embeddings=R, feature_names=[f"d{j}"]) for j in range(26)]
        t += [EmbeddingBagConfig(name=f"w{j}", embedding_dim=1, num_embeddings=R, feature_names=[f"w{j}"]) for j in range(27)]
        self.ebc = EmbeddingBagCollection(tables=t)
        self.mlp = nn.Sequential(nn.Linear(26 * 16 + 13, 256), nn.ReLU(), nn.Linear(256, 1))
    def forward(self, dense, kjt):
        kt = self.ebc(kjt).values()
        deep = torch.cat([dense, kt[:, :26 * 16]], 1)
        return (self.mlp(deep) + kt[:, 26 * 16:].sum(1, keepdim=True)).squeeze(1)

def kjt_of(ids):
    cols = [ids[:, j] for j in range(26)] + [ids[:, j % 26] for j in range(27)]
    keys = [f"d{j}" for j in range(26)] + [f"w{j}" for j in range(27)]
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(cols), lengths=torch.ones(53 * ids.shape[0], dtype=torch.int32))

def run(model, batches, nextname, steps, group_tables=True):
    ps = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=0.05, verbose=False,
                           group_tables=group_tables)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = fxdist.optimize(model, passes=(ps, "async_rpc_prefetch"))
    opt = torch.optim.SGD(gm.parameters(), lr=0.01)
    t0 = None
    for i in range(steps):
        if i == 3: t0 = time.perf_counter()
        d, x, y = batches[i]
        nxt = batches[i + 1][1] if i + 1 < steps else None
        loss = F.binary_cross_entropy_with_logits(gm(d, x, **{nextname: nxt}), y)
        opt.zero_grad(); loss.backward(); opt.step()
    placement.flush(gm)
    q = (steps - 3) * B / (time.perf_counter() - t0)
    placement.close(gm)
    return q

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    steps = args.steps
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    raw = [(torch.rand(B, 13, generator=gen), torch.randint(0, R, (B, 26), generator=gen), torch.rand(B, generator=gen).round()) for _ in range(steps + 1)]
    with LocalCluster(2, timeout_s=60):
        ratios: dict[str, list[float]] = {"grouped": [], "per module": []}
        for r in range(args.rounds):
            q1 = run(OneEBC(), [(d, kjt_of(x), y) for d, x, y in raw], "next_kjt", steps)
            q2 = run(WideDeep(), raw, "next_ids", steps)
            q3 = run(WideDeep(), raw, "next_ids", steps, group_tables=False)
            ratios["grouped"].append(q2 / q1)
            ratios["per module"].append(q3 / q1)
            print(f"round {r}: one EBC {q1:,.0f}/s, 53 modules grouped {q2:,.0f}/s ({q2 / q1:.2f}), "
                  f"one client per module {q3:,.0f}/s ({q3 / q1:.2f})", flush=True)
        for name, found in ratios.items():
            print(f"53 modules {name} / one EBC: median {statistics.median(found):.2f} "
                  f"({min(found):.2f}..{max(found):.2f})")

if __name__ == "__main__":
    main()
