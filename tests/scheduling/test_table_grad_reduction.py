"""Table gradients are averaged across trainers by default, as DDP averages the dense ones.

The bug this guards against: the servers applied every trainer's push as computed, so with N trainers the tables saw N times the
learning rate the dense part (DDP: gradients divided by the world size) saw. With the default
``grad_reduction="mean"`` two trainers on a server (tables there, dense part under DDP over gloo) must train
like one process on the global batch; ``"sum"`` keeps the old behaviour (table gradients summed).
"""

from __future__ import annotations

import functools
import multiprocessing as mp

import pytest
import torch
from torch import nn

from scheduling.ps.transport.ports import free_port
from tests.scheduling._group import ddp_trainer_main, one_server_main, spawn_and_collect

WORLD, STEPS, BATCH, LR = 2, 4, 8, 0.5


class TwoTables(nn.Module):
    """A mean-pooled bag of user ids, an item embedding, and a trained linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.user = nn.EmbeddingBag(20, 4, mode="mean")
        self.item = nn.Embedding(15, 4)
        self.head = nn.Linear(8, 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:  # (B, 3), (B,) -> (B,)
        return self.head(torch.cat([self.user(users), self.item(items)], dim=1)).squeeze(1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return TwoTables()


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(77 + rank)
    return [(torch.randint(0, 20, (BATCH, 3), generator=gen), torch.randint(0, 15, (BATCH,), generator=gen),
             torch.randn(BATCH, generator=gen)) for _ in range(STEPS)]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _reference(table_factor: float) -> dict[str, torch.Tensor]:
    """One process on the global batch (both trainers' batches), local tables, ``torch.optim.SGD``; the table
    gradients multiplied by ``table_factor`` (``WORLD`` reproduces summed table gradients)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = [_batches(r) for r in range(WORLD)]
    for step in range(STEPS):
        users, items, target = (torch.cat([data[r][step][i] for r in range(WORLD)]) for i in range(3))
        opt.zero_grad()
        _loss(model(users, items), target).backward()
        for p in (model.user.weight, model.item.weight):
            p.grad *= table_factor
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ddp_pass(reduction: str, rank: int):
    import scheduling

    return functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=LR, servers=["ps0"],
                             client=f"avg-{reduction}", rank=rank, world_size=WORLD, group=f"g-{reduction}",
                             timeout_s=60.0, verbose=False, grad_reduction=reduction)


REDUCTIONS = ("mean", "sum")


@pytest.fixture(scope="module")
def trained() -> dict[str, dict[int, dict[str, torch.Tensor]]]:
    """``{reduction: {rank: state}}``: one group (the server and 2 trainers) trains the model once per reduction,
    one after the other, each under its own clients and group key."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port, ddp_port = free_port(), free_port()
    targets = [(one_server_main, (port, WORLD))] + [
        (ddp_trainer_main, (r, WORLD, port, ddp_port, queue, _ddp_pass, _model, _batches, _loss, LR, REDUCTIONS))
        for r in range(WORLD)]
    results = spawn_and_collect(ctx, targets, queue, WORLD)
    errors = {r: res["error"] for r, res in results.items() if "error" in res}
    assert not errors, errors
    return {red: {r: {k: torch.tensor(v) for k, v in res[red].items() if k != "local"} for r, res in results.items()}
            for red in REDUCTIONS}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reduction,table_factor", [("mean", 1.0), ("sum", float(WORLD))])
def test_two_trainers_on_servers_train_like_one_process_on_the_global_batch(trained, reduction, table_factor):
    results = trained[reduction]
    want = _reference(table_factor)
    other = _reference(float(WORLD) if reduction == "mean" else 1.0)
    start = _model().state_dict()
    for rank in range(WORLD):
        got = results[rank]
        assert got.keys() >= {"head.weight", "head.bias"}
        for key in ("head.weight", "head.bias"):            # DDP: identical dense weights on every trainer
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)
    tables = results[0]
    assert {"user.weight", "item.weight"} <= tables.keys()
    for key in ("user.weight", "item.weight"):
        assert not torch.equal(tables[key], start[key])
        # float32 sums in another order than the single process's: a few ulps after 4 steps
        torch.testing.assert_close(tables[key], want[key], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(tables[key], other[key], rtol=1e-5, atol=1e-6)   # the reduction matters


def test_unknown_grad_reduction_is_refused():
    import scheduling

    with pytest.raises(ValueError, match=r"unknown grad_reduction='avg' \(use 'mean' or 'sum'\)"):
        scheduling.parameter_servers(_model(), grad_reduction="avg")
