"""The pushes of a model's clients go to each server as one message per step (:mod:`scheduling.ps.coalesce`).

Differential: a model with 12 embedding modules trained on 2 real servers with the shared batcher gives
exactly the losses and tables of the same model whose clients send every request alone; the servers count
the messages they received.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdist
import scheduling
from scheduling import placement
from scheduling.ps import LocalCluster, get_client
from scheduling.ps.endpoints import ServerEndpoints
from scheduling.ps.server import PSServer
from scheduling.ps.shard_plan import TableSpec, plan_shards

MODULES, B, STEPS = 12, 8, 5


class ManyBags(nn.Module):
    """One ``nn.EmbeddingBag`` per column of a ``(B, 12)`` id tensor (the Wide & Deep layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(20 + j, 4, mode="sum") for j in range(MODULES)])
        self.top = nn.Linear(4, 1)

    def forward(self, ids):
        return self.top(sum(bag(ids[:, j:j + 1]) for j, bag in enumerate(self.bags))).squeeze(1)


def _train(model: nn.Module, batches: list, prefetch: bool, batched: bool):
    """(losses, tables, messages per server over the STEPS steps, prefetch hits, clients per server)."""
    # one client per module (group_tables=False): the pushes of many clients are what gets batched here
    ps = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=0.1, verbose=False, group_tables=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = fxdist.optimize(model, passes=(ps, "async_rpc_prefetch") if prefetch else (ps,))
    clients = [get_client(n) for n in placement.client_names(gm)]
    try:
        if not batched:
            for client in clients:
                client.batcher = None
        opt = torch.optim.SGD(gm.parameters(), lr=0.1)
        losses, before = [], [s["requests"] for s in clients[0].stats()]
        for (ids, labels), nxt in scheduling.lookahead(batches):
            extra = {"next_ids": None if nxt is None else nxt[0]} if prefetch else {}
            loss = F.binary_cross_entropy_with_logits(gm(ids, **extra), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        placement.flush(gm)
        after = [s["requests"] for s in clients[0].stats()]
        per_server = [sum(s in c.servers_for() for c in clients) for s in range(2)]
        return (losses, placement.table_state_dict(gm), [a - b for a, b in zip(after, before)],
                sum(c.prefetch_hits for c in clients), per_server)
    finally:
        placement.close(gm)


@pytest.fixture(scope="module", params=["torch_rpc", "ray"])
def cluster(request):
    with LocalCluster(2, timeout_s=60, transport=request.param) as cl:
        yield cl


@pytest.mark.parametrize("prefetch", [True, False])
def test_one_message_per_server_per_step_trains_as_one_by_one(cluster, prefetch):
    torch.manual_seed(0)
    model = ManyBags()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.stack([torch.randint(0, 20 + j, (B,), generator=gen) for j in range(MODULES)], dim=1),
                torch.rand(B, generator=gen).round()) for _ in range(STEPS)]
    losses, tables, messages, hits, per_server = _train(copy.deepcopy(model), batches, prefetch, batched=True)
    alone = _train(model, batches, prefetch, batched=False)
    assert losses == alone[0]                                    # the same requests, applied in the same order
    assert all(torch.equal(tables[k], alone[1][k]) for k in tables) and tables.keys() == alone[1].keys()
    assert sum(per_server) == MODULES and per_server == alone[4]
    if prefetch:   # after the first step's lookups, every lookup rides on a push: one message per server per step
        assert hits == MODULES * (STEPS - 1)
        assert messages == [n + STEPS for n in per_server]
        assert alone[2] == [n * (STEPS + 1) for n in per_server]    # one message per module and step
    else:          # the lookups still go one by one; the pushes of a step share one message per server
        assert messages == [(n + 1) * STEPS for n in per_server]
        assert alone[2] == [2 * n * STEPS for n in per_server]


def test_a_refused_request_in_a_batch_raises_its_own_error_and_the_others_are_applied():
    server = PSServer("ps0")
    server.configure("ns", plan_shards([TableSpec("t", 10, 4, ("f",))], 1), 0, "sgd", {"lr": 1.0}, seed=0)
    endpoints = ServerEndpoints(server)
    batch = (("f",), torch.tensor([3]), torch.tensor([1]), None)
    answers = []
    endpoints.submit_batch([("push", ("ns", batch, torch.ones(1, 4))), ("push", ("ns", batch, torch.ones(1, 7))),
                            ("lookup", ("ns", batch))], lambda value, error: answers.append((value, error)))
    (result, error), = answers
    assert error is None and endpoints.requests == 1
    assert result[0] == (1, None)
    assert isinstance(result[1][1], ValueError) and "gradient shape (1, 7)" in str(result[1][1])
    before = server.state_dict("ns")["ns/t@0"]["weight"][3]
    torch.testing.assert_close(result[2][0][0], before)         # the lookup after the push sees it applied
