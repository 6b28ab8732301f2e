"""Groups of embedding modules sharing one request per server (:mod:`scheduling.placement.table_groups`).

Differential: a Wide & Deep-like model with one ``nn.EmbeddingBag`` or ``nn.Embedding`` per feature of a
``(B, F, L)`` id tensor, trained with its tables on 2 real servers (blocking, and with ``async_rpc_prefetch``),
gives the losses and tables of the same model trained locally, while sending one lookup per server and step
for all its modules. Modules that cannot share a request (chained, ids modified in place in between) keep
their own client and still train as locally.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdist
import scheduling
from scheduling import placement
from scheduling.placement import conversions
from scheduling.placement.find import find_embeddings
from scheduling.placement.table_groups import group_candidates, group_label
from scheduling.ps import LocalCluster, get_client, ops
from scheduling.ps.client import PSClient

F_BAGS, F_EMBS, B, L, STEPS, LR = 7, 3, 4, 3, 4, 0.05


class WideDeep(nn.Module):
    """One sum/mean ``nn.EmbeddingBag`` per bag feature (``ids[:, j]``, ``(B, L)``; one with
    ``padding_idx``) and one ``nn.Embedding`` per single-id feature (``ids[:, j, 0]``), a dense tower."""

    def __init__(self) -> None:
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(10 + j, 4, mode="sum" if j % 2 else "mean",
                                                  padding_idx=0 if j == 3 else None) for j in range(F_BAGS))
        self.embs = nn.ModuleList(nn.Embedding(8 + j, 3) for j in range(F_EMBS))
        self.dense = nn.Linear(2, 4)
        self.top = nn.Linear(4 + 4 * F_BAGS + 3 * F_EMBS, 1)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:   # (B, 2), (B, F, L) -> (B,)
        parts = [self.dense(dense)]
        parts += [bag(ids[:, j]) for j, bag in enumerate(self.bags)]
        parts += [emb(ids[:, F_BAGS + j, 0]) for j, emb in enumerate(self.embs)]
        return self.top(torch.relu(torch.cat(parts, dim=1))).squeeze(1)


class Chained(nn.Module):
    """``c``'s ids are modified in place after ``a``'s call (so ``c`` cannot share ``a``'s request); ``b``'s ids
    come from ``a``'s output (so it cannot either), but they can be computed where ``c`` is called."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.EmbeddingBag(10, 4, mode="sum")
        self.b = nn.EmbeddingBag(10, 4, mode="sum")
        self.c = nn.EmbeddingBag(10, 4, mode="sum")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:    # (B, 3, L) -> (B,)
        ids = ids.clone()
        a = self.a(ids[:, 0])
        ids[:, 2].add_(1)                                       # c's ids change after a's call
        c = self.c(ids[:, 2] % 10)
        derived = (a.detach().abs() * 3).long().clamp(0, 9)     # (B, 4) ids from a's output
        return torch.cat([a, self.b(derived), c], dim=1).sum(dim=1)


def _batches(f: int, seed: int = 0) -> list[tuple[tuple, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [((torch.randn(B, 2, generator=gen), torch.randint(0, 8, (B, f, L), generator=gen)),
             torch.rand(B, generator=gen).round()) for _ in range(STEPS)]


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(2, timeout_s=30) as cl:
        yield cl


def _train(model: nn.Module, batches: list, step) -> list[float]:
    params = list(model.parameters())      # after the pass: the dense part only (none in Chained)
    opt = torch.optim.SGD(params or [torch.zeros(1, requires_grad=True)], lr=LR)
    losses = []
    for i, (inputs, labels) in enumerate(batches):
        loss = F.binary_cross_entropy_with_logits(step(model, inputs, i), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _local(model: nn.Module, batches: list) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = copy.deepcopy(model)
    losses = _train(model, batches, lambda m, inputs, i: m(*inputs))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()
                    if k.startswith(("bags.", "embs.", "a.", "b.", "c."))}


def _optimize(model: nn.Module, prefetch: bool, **options):
    ps = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=LR, verbose=False, **options)
    return fxdist.optimize(copy.deepcopy(model), passes=(ps, "async_rpc_prefetch") if prefetch else (ps, "async_rpc"))


@pytest.mark.parametrize("prefetch", [False, True], ids=["blocking", "prefetch"])
def test_wide_deep_trains_as_local_with_one_lookup_per_server(cluster, prefetch, monkeypatch):
    torch.manual_seed(0)
    model = WideDeep()
    batches = _batches(F_BAGS + F_EMBS)
    want_losses, want_tables = _local(model, batches)
    gm = _optimize(model, prefetch)
    calls: list[str] = []
    lookup_async = PSClient.lookup_async
    monkeypatch.setattr(PSClient, "lookup_async", lambda self, server, kjt, *a, **k: (
        calls.append(f"{self.name}/{server}"), lookup_async(self, server, kjt, *a, **k))[1])
    try:
        clients = placement.client_names(gm)
        assert [c.split("#")[0] for c in clients] == [f"ps:bags.0+{F_BAGS - 1}", f"ps:embs.0+{F_EMBS - 1}"]

        def step(m, inputs, i):
            nxt = {"next_ids": batches[i + 1][0][1] if i + 1 < STEPS else None} if prefetch else {}
            return m(*inputs, **nxt)

        losses = _train(gm, batches, step)
        placement.flush(gm)
        torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
        tables = placement.table_state_dict(gm)
        assert tables.keys() == want_tables.keys() and len(tables) == F_BAGS + F_EMBS
        for key in tables:
            torch.testing.assert_close(tables[key], want_tables[key], rtol=1e-5, atol=1e-6)
        # one request per (client, server) and step, whatever the number of modules (2 servers, 2 groups)
        servers = {c: get_client(c).servers_for() for c in clients}
        assert len(calls) == STEPS * sum(len(s) for s in servers.values())
        if prefetch:
            assert sum(get_client(c).prefetch_hits for c in clients) == (STEPS - 1) * sum(map(len, servers.values()))
    finally:
        placement.close(gm)


def test_the_table_state_round_trips_through_a_group(cluster):
    torch.manual_seed(1)
    gm = _optimize(WideDeep(), prefetch=False)
    try:
        state = {k: torch.randn_like(v) for k, v in placement.table_state_dict(gm).items()}
        placement.load_table_state_dict(gm, state)
        got = placement.table_state_dict(gm)
        assert got.keys() == state.keys()
        for key in state:
            torch.testing.assert_close(got[key], state[key])
    finally:
        placement.close(gm)


def test_modules_that_cannot_share_a_request_get_their_own_and_train_as_local(cluster):
    torch.manual_seed(0)
    model = Chained()
    gen = torch.Generator().manual_seed(3)
    batches = [((torch.randint(0, 10, (B, 3, L), generator=gen),), torch.rand(B, generator=gen).round())
               for _ in range(STEPS)]
    traced = placement._as_graph_module(copy.deepcopy(model))
    found, _ = find_embeddings(traced)
    groups = group_candidates(traced, found, {c.qualname: True for c in found})
    assert [group_label(g) for g in groups] == ["a", "c+1"]
    want_losses, want_tables = _local(model, batches)
    gm = _optimize(model, prefetch=False)
    try:
        assert len(placement.client_names(gm)) == 2
        losses = _train(gm, batches, lambda m, inputs, i: m(*inputs))
        torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
        for key, value in placement.table_state_dict(gm).items():
            torch.testing.assert_close(value, want_tables[key], rtol=1e-5, atol=1e-6)
    finally:
        placement.close(gm)


def test_a_bad_id_in_a_group_raises_the_local_modules_error(cluster):
    torch.manual_seed(0)
    model = WideDeep()
    gm = _optimize(model, prefetch=False)
    dense, ids = _batches(F_BAGS + F_EMBS)[0][0]
    bad = ids.clone()
    bad[1, 2, 0] = 12          # bags.2 has 12 rows
    try:
        with pytest.raises(RuntimeError, match="not in the valid range") as local:
            model(dense, bad)
        with pytest.raises(RuntimeError) as remote:
            gm(dense, bad)
        assert type(remote.value) is type(local.value) and str(remote.value) == str(local.value)
        gm(dense, ids)          # nothing lost: the next good batch runs
    finally:
        placement.close(gm)


def test_group_to_kjt_pads_keys_fills_weights_drops_padding_and_keeps_identity():
    members = (("bag", 10, "sum", False, None), ("embedding", 9, 0), ("bag", 10, "mean", True, 4))
    a, a_weights = torch.tensor([[1, 2], [3, 4]]), torch.tensor([[0.5, 2.0], [1.0, 3.0]])
    b = torch.tensor([5, 0, 7])                                   # 0: b's padding id, an empty bag
    c, c_offsets = torch.tensor([4, 6, 8]), torch.tensor([0, 2, 3])   # bags [4, 6], [8]; 4: c's padding id
    tensors = (a, None, a_weights, b, c, c_offsets, None)
    kjt = conversions.group_to_kjt(("a", "b", "c"), members, *tensors)
    assert kjt.keys() == ["a", "b", "c"]
    assert kjt.lengths().tolist() == [2, 2, 0, 1, 0, 1, 1, 1, 0]   # a's and c's 2 bags padded to b's 3
    assert kjt.values().tolist() == [1, 2, 3, 4, 5, 7, 6, 8]
    assert kjt.weights().tolist() == [0.5, 2.0, 1.0, 3.0, 1.0, 1.0, 1.0, 1.0]
    assert conversions.group_to_kjt(("a", "b", "c"), members, *tensors) is kjt   # the prefetched batch again
    assert conversions.group_to_kjt(("a", "b", "c"), members, None, *tensors[1:]) is None
    values = torch.arange(3 * 7.0).reshape(3, 7)

    class KT:
        def values(self):
            return values

    assert torch.equal(conversions.group_output(KT(), 0, 4, a), values[:2, 0:4])
    assert torch.equal(conversions.group_output(KT(), 4, 7, c, c_offsets, include_last_offset=True),
                       values[:2, 4:7])
    index = torch.tensor([[5], [6], [7]])
    assert torch.equal(conversions.group_output(KT(), 4, 7, index, embedding=True), values[:, 4:7].reshape(3, 1, 3))


def test_a_group_refuses_what_its_first_bad_module_refuses():
    members = (("bag", 10, "sum", False, None), ("embedding", 9, None))
    good = (torch.tensor([[1, 2]]), None, None)
    with pytest.raises(IndexError, match="index out of range in self"):       # F.embedding's own message
        conversions.group_to_kjt(("a", "b"), members, *good, torch.tensor([9]))
    with pytest.raises(RuntimeError) as local:
        nn.EmbeddingBag(10, 2, mode="sum")(torch.tensor([[1, 2.0]]))
    with pytest.raises(RuntimeError) as grouped:
        conversions.group_to_kjt(("a", "b"), members, torch.tensor([[1, 2.0]]), None, None, torch.tensor([3]))
    assert str(grouped.value) == str(local.value)


def test_the_group_is_one_fetch_per_server_in_the_graph(cluster):
    gm = _optimize(WideDeep(), prefetch=False)
    try:
        fetches = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ops.ps_lookup_start]
        expected = sum(len(get_client(c).servers_for()) for c in placement.client_names(gm))
        assert len(fetches) == expected <= 4
        assert not [n for n in gm.graph.nodes if n.op == "call_module" and str(n.target).startswith(("bags", "embs"))]
    finally:
        placement.close(gm)
