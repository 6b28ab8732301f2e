"""jobs.trainer.sparse_grads: the trainers average their sparse table gradients after backward instead of DDP's sparse
all-reduce (which corrupts the heap on CPU, see the module). Two gloo processes; differential against the mean
of the dense gradients and against DDP training the same model with dense table gradients."""

from __future__ import annotations

import io
import multiprocessing as mp
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from jobs.trainer.metrics import free_port
from jobs.trainer.sparse_grads import average_sparse_grads, data_parallel, sparse_parameters
from tests.scheduling._group import spawn_and_collect

WORLD, STEPS, B = 2, 6, 8


class Model(nn.Module):
    def __init__(self, sparse: bool, unused: bool = False) -> None:
        super().__init__()
        self.user = nn.EmbeddingBag(30, 4, mode="sum", sparse=sparse)
        self.item = nn.Embedding(20, 4, sparse=sparse, padding_idx=0)
        if unused:
            self.unused = nn.EmbeddingBag(10, 4, sparse=sparse)  # no gradient on any trainer
        self.top = nn.Linear(8, 1)

    def forward(self, users, items):
        return self.top(torch.cat([self.user(users), self.item(items).sum(1)], dim=1)).squeeze(1)


def _batch(rank: int, step: int) -> tuple:
    gen = torch.Generator().manual_seed(100 * step + rank)
    users = torch.randint(0, 30, (B, 2), generator=gen)
    items = torch.randint(0, 20, (B, 3), generator=gen)
    if rank == 1 and step % 2 == 0:
        items.zero_()                                           # only padding: an empty item gradient here
    return users, items, torch.rand(B, generator=gen).round()


def _trainer(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        results = {}
        for sparse in (True, False):
            torch.manual_seed(0)
            module = Model(sparse)
            trained, sync = data_parallel(module, torch.device("cpu"))
            opt = torch.optim.SGD(module.parameters(), lr=0.5)
            losses = []
            for step in range(STEPS):
                users, items, labels = _batch(rank, step)
                loss = F.binary_cross_entropy_with_logits(trained(users, items), labels)
                opt.zero_grad()
                loss.backward()
                sync()
                opt.step()
                losses.append(loss.item())
            results[sparse] = (losses, {k: v.detach().clone() for k, v in module.state_dict().items()},
                               sorted(sparse_parameters(module)))
        # the averaged gradient itself, against the mean of every trainer's dense gradient
        torch.manual_seed(1)
        module = Model(True, unused=True)
        users, items, labels = _batch(rank, 0)
        F.binary_cross_entropy_with_logits(module(users, items), labels).backward()
        dense = {n: (p.grad.to_dense() if p.grad is not None else torch.zeros_like(p))
                 for n, p in sparse_parameters(module).items()}
        for g in dense.values():
            dist.all_reduce(g)
        average_sparse_grads(list(sparse_parameters(module).values()))
        got = {n: p.grad.to_dense() for n, p in sparse_parameters(module).items()}
        buf = io.BytesIO()   # bytes, not tensors: a tensor's shared memory dies with this process
        torch.save((results, {n: g / WORLD for n, g in dense.items()}, got), buf)
        queue.put((rank, buf.getvalue()))
    finally:
        dist.destroy_process_group()


def test_sparse_tables_train_as_ddp_with_dense_gradients():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    out = spawn_and_collect(ctx, [(_trainer, (r, port, queue)) for r in range(WORLD)], queue, WORLD)
    out = {rank: torch.load(io.BytesIO(data)) for rank, data in out.items()}
    for rank in range(WORLD):
        results, expected, got = out[rank]
        (sparse_losses, sparse_state, names), (dense_losses, dense_state, dense_names) = results[True], results[False]
        assert names == ["item.weight", "user.weight"] and dense_names == []
        torch.testing.assert_close(sparse_losses, dense_losses, rtol=1e-6, atol=1e-7)
        for key in dense_state:
            torch.testing.assert_close(sparse_state[key], dense_state[key], rtol=1e-6, atol=1e-7)
        assert sorted(got) == ["item.weight", "unused.weight", "user.weight"] and expected.keys() == got.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7)
    # both trainers hold the same tables (the gradients were averaged, not kept apart)
    assert all(torch.equal(out[0][0][True][1][k], out[1][0][True][1][k]) for k in out[0][0][True][1])


def test_without_a_process_group_nothing_is_wrapped():
    module = Model(True)
    trained, sync = data_parallel(module, torch.device("cpu"))
    assert trained is module and sync() is None
