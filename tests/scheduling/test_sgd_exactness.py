"""How exactly the servers' ``optimizer="sgd"`` (scheduling/ps/optimizer.py) trains against ``torch.optim.SGD`` on
local tables.

The servers sum each row's gradients over a push in another order than autograd's embedding backward, so only
``nn.Embedding`` (one id per row and sample) is bit-identical; the bags, ``per_sample_weights`` and a table
read twice differ in the last bits. The README states the bound tested here (30 steps, lr 0.05, float32).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

LR = 0.05
TOLERANCE = 2e-6
"""Max abs difference after 30 steps (measured: 3.0e-8 mean bags, 1.2e-7 sum bags and per_sample_weights,
1.1e-6 a table read twice; 0 for nn.Embedding)."""


class OneTable(nn.Module):
    """One table read as ``kind`` says, projected to a score per sample by a fixed buffer."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "embedding":
            self.t = nn.Embedding(50, 8)
        else:
            self.t = nn.EmbeddingBag(50, 8, mode="mean" if kind == "mean" else "sum")
        self.register_buffer("proj", torch.linspace(-1, 1, 8).unsqueeze(1))

    def forward(self, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:  # (B, 4), (B, 4) -> (B,)
        if self.kind == "embedding":
            out = self.t(ids[:, 0])
        elif self.kind == "per_sample_weights":
            out = self.t(ids, per_sample_weights=weights)
        elif self.kind == "twice":
            out = self.t(ids) + self.t(ids.flip(1))
        else:
            out = self.t(ids)
        return (out @ self.proj).squeeze(1)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 50, (16, 4), generator=gen), torch.rand(16, 4, generator=gen),
             torch.randn(16, generator=gen)) for _ in range(30)]


@pytest.fixture(scope="module")
def cluster():
    from scheduling.ps import LocalCluster

    with LocalCluster(num_servers=1) as c:
        yield c


@pytest.mark.parametrize("kind", ["embedding", "sum", "mean", "per_sample_weights", "twice"])
def test_server_sgd_against_torch_optim_sgd(cluster, kind):
    import fxdist
    import scheduling
    from scheduling import placement

    torch.manual_seed(0)
    ref = OneTable(kind)
    torch.manual_seed(0)
    to_servers = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=LR, verbose=False,
                                   client=f"exact-{kind}")
    gm = fxdist.optimize(OneTable(kind), passes=(to_servers,))
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    try:
        for ids, weights, target in _batches():
            opt.zero_grad()
            ((ref(ids, weights) - target) ** 2).mean().backward()
            opt.step()
            ((gm(ids, weights) - target) ** 2).mean().backward()
        placement.flush(gm)
        got = placement.table_state_dict(gm)["t.weight"]
    finally:
        placement.close(gm)
    torch.manual_seed(0)
    assert not torch.equal(got, OneTable(kind).t.weight)           # it trained
    diff = (got - ref.t.weight).abs().max().item()
    print(f"{kind}: max abs difference {diff:.3g}")
    if kind == "embedding":
        assert diff == 0.0
    else:
        assert diff <= TOLERANCE
