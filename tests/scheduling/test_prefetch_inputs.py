"""``async_rpc_prefetch`` on lookups whose ids are computed from the graph's inputs, against 2 real servers on
loopback (one trainer), and on hand-built graphs for the reasons a lookup is not prefetched.

Differential: each model trained three ways gives the same losses and tables: eager PyTorch with local tables
(torch.optim.SGD on the tables, Adam on the dense part), ``parameter_servers`` alone (blocking lookups) and
``parameter_servers`` + ``async_rpc_prefetch`` (every lookup after the first step answered by a prefetch).
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import operator
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

import fxdist
import scheduling
from fxdist.graph import Graph
from fxdist.graph_module import GraphModule
from scheduling import placement
from scheduling.batch_replay import BatchReplay
from scheduling.prefetch import PrefetchWarning
from scheduling.ps import LocalCluster, get_client, ops
from tests.scheduling._graphs import offline_client

HERE = "tests/scheduling/test_prefetch_inputs.py"
LR_TABLES = 0.05
B, STEPS = 4, 4


class PerFeature(nn.Module):
    """One ``(B, 3)`` id input sliced per feature: two ``nn.EmbeddingBag`` (2-D ``(B, 1)`` slices) and one
    ``nn.Embedding`` (a ``(B,)`` column); the dense input also reads a slice of the ids."""

    def __init__(self) -> None:
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(11, 4, mode="sum"), nn.EmbeddingBag(13, 4, mode="mean")])
        self.item = nn.Embedding(9, 4)
        self.dense = nn.Linear(5, 4)
        self.top = nn.Linear(16, 1)

    def forward(self, dense, ids):
        parts = [self.bags[j](ids[:, j:j + 1]) for j in range(2)] + [self.item(ids[:, 2])]
        return self.top(torch.cat([self.dense(dense + ids[:, :1].float() * 0.01)] + parts, dim=1)).squeeze(1)


class CastReshape(nn.Module):
    """Ids cast (``.long()``, ``.to(torch.int64)``) and reshaped (``.view``, ``.reshape``, ``unsqueeze``) before
    the lookups; the ids come as int32 ``(B, 2)`` and ``(B * 3,)``."""

    def __init__(self) -> None:
        super().__init__()
        self.user = nn.EmbeddingBag(11, 4)
        self.item = nn.EmbeddingBag(13, 4)
        self.history = nn.Embedding(7, 4)
        self.top = nn.Linear(12, 1)

    def forward(self, ids, history):
        user = self.user(ids[:, 0].long().unsqueeze(1))
        item = self.item(ids[:, 1].to(torch.int64).reshape(-1, 1))
        hist = self.history(history.view(ids.shape[0], 3).long()).sum(dim=1)
        return self.top(torch.cat([user, item, hist], dim=1)).squeeze(1)


def _ebc_tables() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=11, feature_names=["f0"]),
            EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=13, feature_names=["f1", "f2"])]


class KJTInForward(nn.Module):
    """A torchrec ``EmbeddingBagCollection`` fed by a ``KeyedJaggedTensor`` built in forward from a ``(B, 3)``
    id tensor (one id per sample and feature)."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=_ebc_tables())
        self.dense = nn.Linear(5, 4)
        self.top = nn.Linear(16, 1)

    def forward(self, dense, ids):
        b, f = ids.shape
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2"], values=ids.t().reshape(-1),
                                                  lengths=torch.ones(b * f, dtype=torch.int32))
        return self.top(torch.cat([self.dense(dense), self.ebc(kjt).values()], dim=1)).squeeze(1)


class ArgmaxIds(nn.Module):
    """One lookup whose ids are a module's output (``argmax`` of a Linear): not prefetchable; one fed by an
    input: prefetched."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 6)
        self.cluster = nn.Embedding(6, 4)
        self.user = nn.EmbeddingBag(11, 4)
        self.top = nn.Linear(8, 1)

    def forward(self, dense, ids):
        return self.top(torch.cat([self.cluster(self.proj(dense).argmax(dim=1)), self.user(ids)], dim=1)).squeeze(1)


class Positions(nn.Module):
    """A positional ``nn.Embedding`` looked up at ``torch.arange(L)`` (a tensor constant of the trace) and at
    a buffer that nothing updates, added to each sample's item rows: ids ``(B, L)`` -> logits ``(B,)``."""

    def __init__(self, length: int = 5) -> None:
        super().__init__()
        self.pos = nn.Embedding(20, 4)
        self.slot = nn.Embedding(7, 4)
        self.item = nn.Embedding(11, 4)
        self.register_buffer("slots", torch.tensor([6, 0, 3, 3, 1]))
        self.top = nn.Linear(4, 1)
        self.length = length

    def forward(self, ids):
        h = self.item(ids) + self.pos(torch.arange(5)) + self.slot(self.slots)
        return self.top(h.sum(dim=1)).squeeze(1)


def _batches(make_inputs, seed: int) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    return [(make_inputs(gen), torch.rand(B, generator=gen).round()) for _ in range(STEPS)]


def _ids(gen, *highs: int, dtype=torch.long) -> torch.Tensor:
    return torch.stack([torch.randint(0, h, (B,), generator=gen) for h in highs], dim=1).to(dtype)


CASES = {
    "per_feature": (PerFeature, lambda g: (torch.rand(B, 5, generator=g), _ids(g, 11, 13, 9)), ["next_ids"]),
    "cast_reshape": (CastReshape, lambda g: (_ids(g, 11, 13, dtype=torch.int32),
                                             torch.randint(0, 7, (B * 3,), generator=g, dtype=torch.int32)),
                     ["next_ids", "next_history"]),
    "kjt_in_forward": (KJTInForward, lambda g: (torch.rand(B, 5, generator=g), _ids(g, 11, 13, 13)), ["next_ids"]),
}


def _embedding_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    kinds = (nn.EmbeddingBag, nn.Embedding)
    return {f"{n}.weight": m.weight for n, m in model.named_modules() if isinstance(m, kinds)}


def _train_local(model: nn.Module, batches: list[tuple]) -> tuple[list[float], dict[str, torch.Tensor]]:
    tables = _embedding_weights(model)
    dense_opt = torch.optim.Adam([p for p in model.parameters() if all(p is not t for t in tables.values())], lr=0.01)
    table_opt = torch.optim.SGD(list(tables.values()), lr=LR_TABLES)
    losses = []
    for inputs, labels in batches:
        loss = F.binary_cross_entropy_with_logits(model(*inputs), labels)
        dense_opt.zero_grad()
        table_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        table_opt.step()
        losses.append(loss.item())
    return losses, {n: w.detach().clone() for n, w in tables.items()}


def _train_on_servers(model: nn.Module, batches: list[tuple], prefetch: bool, **options):
    """(losses, tables, the optimized module, prefetch hits, PrefetchWarnings of the passes); ``options``: more
    arguments of the ``parameter_servers`` pass."""
    ps = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=LR_TABLES, verbose=False, **options)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        gm = fxdist.optimize(model, passes=(ps, "async_rpc_prefetch") if prefetch else (ps,))
    try:
        names = list(inspect.signature(model.forward).parameters)
        nexts = [n.target for n in gm.graph.nodes if n.op == "placeholder" and n.target.startswith("next_")]
        opt = torch.optim.Adam(gm.parameters(), lr=0.01)
        losses = []
        for (inputs, labels), nxt in scheduling.lookahead(batches):
            extra = {n: None if nxt is None else nxt[0][names.index(n[len("next_"):])] for n in nexts}
            loss = F.binary_cross_entropy_with_logits(gm(*inputs, **extra), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        placement.flush(gm)
        hits = sum(get_client(n).prefetch_hits for n in placement.client_names(gm))
        return losses, placement.table_state_dict(gm), gm, hits, [w for w in record if w.category is PrefetchWarning]
    finally:
        placement.close(gm)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(2, timeout_s=30) as cl:
        yield cl


def _assert_same_training(runs: list[tuple[list[float], dict[str, torch.Tensor]]]) -> None:
    (ref_losses, ref_tables), *others = runs
    for losses, tables in others:
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
        assert tables.keys() == ref_tables.keys()
        for key in tables:
            torch.testing.assert_close(tables[key], ref_tables[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_computed_ids_are_prefetched_and_train_as_blocking(cluster, case):
    make, inputs, expected_nexts = CASES[case]
    torch.manual_seed(0)
    model = make()
    batches = _batches(inputs, seed=len(case))
    local = _train_local(copy.deepcopy(model), batches)
    blocking = _train_on_servers(copy.deepcopy(model), batches, prefetch=False)
    losses, tables, gm, hits, warned = _train_on_servers(model, batches, prefetch=True)
    _assert_same_training([local, blocking[:2], (losses, tables)])
    assert losses == blocking[0]                                 # same lookups, same server updates: identical
    assert all(torch.equal(tables[k], blocking[1][k]) for k in tables)
    assert warned == []                                          # everything prefetched: nothing to say
    assert gm.meta["fxdist"]["prefetch"]["not_prefetched"] == []
    graph = gm.graph
    placeholders = [n.target for n in graph.nodes if n.op == "placeholder"]
    assert placeholders[-len(expected_nexts):] == expected_nexts  # the graph inputs themselves, after the others
    assert blocking[3] == 0
    starts = graph.find_nodes(op="call_function", target=ops.ps_lookup_start)
    assert starts and hits == (STEPS - 1) * len(starts)          # after step 1 no lookup blocks on the servers
    # each lookup's push carries the next one, computed at the top of the step from the next_ inputs
    nexts = [n for n in graph.nodes if n.op == "call_module" and n.kwargs.get("next_batch")]
    pushes = graph.find_nodes(op="call_function", target=ops.ps_push_in_backward)
    assert len(pushes) == len(starts) and {p.kwargs["next_kjt"] for p in pushes} <= set(nexts)
    assert all(isinstance(gm.get_submodule(n.target), BatchReplay) for n in nexts)
    assert {s.args[2].target for s in starts} == {n.target for n in nexts}  # this step's batch: the same function
    # both steps' batches and this step's lookups come first, before any of the step's compute
    head = list(itertools.takewhile(lambda n: n.op == "placeholder" or n.target is ops.ps_lookup_start or (
        n.op == "call_module" and isinstance(gm.get_submodule(n.target), BatchReplay)), graph.nodes))
    assert set(nexts) | set(starts) <= set(head)


def test_ids_from_a_module_output_are_warned_and_train_as_blocking(cluster):
    torch.manual_seed(0)
    model = ArgmaxIds()
    batches = _batches(lambda g: (torch.rand(B, 5, generator=g), torch.randint(0, 11, (B, 2), generator=g)), 7)
    local = _train_local(copy.deepcopy(model), batches)
    blocking = _train_on_servers(copy.deepcopy(model), batches, prefetch=False)
    losses, tables, gm, hits, warned = _train_on_servers(model, batches, prefetch=True)
    _assert_same_training([local, blocking[:2], (losses, tables)])
    meta = gm.meta["fxdist"]["placement"]
    server = next(meta["servers"].index(t["servers"][0]) for t in meta["tables"] if t["module"] == "cluster")
    line = inspect.getsourcelines(ArgmaxIds.forward)[1] + 1    # the user's call of the module, not internal nodes
    call = "return self.top(torch.cat([self.cluster(self.proj(dense).argmax(dim=1)), self.user(ids)], dim=1)).squeeze(1)"
    assert [str(w.message) for w in warned] == [
        f"async_rpc_prefetch: the lookup of module 'cluster' (at {HERE}:{line} in forward: `{call}`) is not "
        f"prefetched: its ids depend on the output of module 'proj' (server {server}); it keeps the in-step schedule"]
    assert "%" not in str(warned[0].message) and "index_to_kjt" not in str(warned[0].message)
    assert gm.meta["fxdist"]["prefetch"]["not_prefetched"] == [str(w.message) for w in warned]
    user_server = next(meta["servers"].index(t["servers"][0]) for t in meta["tables"] if t["module"] == "user")
    assert gm.meta["fxdist"]["prefetch"]["lookups"] == {
        "cluster": {"prefetched": False, "reason": f"its ids depend on the output of module 'proj' (server {server})",
                    "where": f"{HERE}:{line}", "servers": [server]},
        "user": {"prefetched": True, "reason": None, "where": f"{HERE}:{line}", "servers": [user_server]}}
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["dense", "ids", "next_ids"]
    assert hits == STEPS - 1                                     # the user table's lookups only


@pytest.mark.parametrize("group_tables", [False, True], ids=["own_lookups", "grouped"])
def test_position_ids_from_constants_are_prefetched_and_train_exactly(cluster, group_tables):
    """``self.pos(torch.arange(5))`` and a buffer nothing updates: the same batch every step, looked up ahead
    (each table its own lookup: a batch of constants only; grouped: one batch of the input and the constants)."""
    torch.manual_seed(0)
    model = Positions()
    batches = _batches(lambda g: (torch.randint(0, 11, (B, 5), generator=g),), 11)
    local = _train_local(copy.deepcopy(model), batches)
    blocking = _train_on_servers(copy.deepcopy(model), batches, prefetch=False, group_tables=group_tables)
    losses, tables, gm, hits, warned = _train_on_servers(model, batches, prefetch=True, group_tables=group_tables)
    _assert_same_training([local, blocking[:2], (losses, tables)])
    assert losses == blocking[0] and all(torch.equal(tables[k], blocking[1][k]) for k in tables)
    assert warned == []
    lookups = gm.meta["fxdist"]["prefetch"]["lookups"]
    line = inspect.getsourcelines(Positions.forward)[1] + 1
    assert {k: (v["prefetched"], v["reason"], v["where"]) for k, v in lookups.items()} == {
        name: (True, None, f"{HERE}:{line}") for name in ("item", "pos", "slot")}
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["ids", "next_ids"]  # no next_ for constants
    starts = gm.graph.find_nodes(op="call_function", target=ops.ps_lookup_start)
    assert len(starts) == (2 if group_tables else 3)              # a lookup per (client, server)
    assert hits == (STEPS - 1) * len(starts)                     # every lookup after step 1 answered by a prefetch


def test_a_constant_batch_is_computed_once_and_again_when_its_values_change(client):
    root = nn.Module()
    root.register_buffer("positions", torch.arange(3))
    g = Graph()
    g.placeholder("x")
    kjt = g.call_function(operator.add, (g.get_attr("positions"), 1))
    part = g.call_function(ops.ps_lookup, ("replay_ps", 0, kjt))
    done = g.call_function(ops.ps_backward, (g.call_function(torch.sum, (part,)),))
    g.call_function(ops.ps_push, ("replay_ps", 0, kjt, part, done))
    g.output(done)
    gm, warned = _prefetch(GraphModule(root, g))
    assert warned == [] and _placeholders(gm) == ["x"]
    replay = gm.graph.find_nodes(op="call_function", target=ops.ps_push_start)[0].kwargs["next_kjt"]
    assert replay.args == () and replay.kwargs == {"next_batch": True}
    module = gm.get_submodule(replay.target)
    out = module(next_batch=True)
    assert out.tolist() == [1, 2, 3] and module() is out       # the same object every step: the prefetch matches
    gm.positions.copy_(torch.arange(3))                          # written with the same values (DDP's broadcast)
    assert module() is out
    gm.positions.add_(1)                                         # changed between steps: computed again
    assert module().tolist() == [2, 3, 4]


# ---- hand-built graphs: what is not prefetched, and why ------------------------------------------------------
@pytest.fixture()
def client():
    c = offline_client("replay_ps", num_servers=1)
    yield c
    c.close(flush=False)


def _step(make_batch) -> GraphModule:
    """A training step reading and pushing server 0 of ``replay_ps``, its batch ``make_batch(graph, ids)``."""
    root = nn.Module()
    root.w = nn.Parameter(torch.ones(3))
    root.register_buffer("counts", torch.zeros(3))
    g = Graph()
    ids, x = g.placeholder("ids"), g.placeholder("x")
    kjt = make_batch(g, ids)
    part = g.call_function(ops.ps_lookup, ("replay_ps", 0, kjt))
    done = g.call_function(ops.ps_backward, (g.call_function(torch.sum, (g.call_function(operator.mul, (part, x)),)),))
    g.call_function(ops.ps_push, ("replay_ps", 0, kjt, part, done))
    g.output(done)
    return GraphModule(root, g)


def _prefetch(gm: GraphModule) -> tuple[GraphModule, list[str]]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        gm = scheduling.async_rpc(gm, prefetch=True)
    return gm, [str(w.message) for w in record if w.category is PrefetchWarning]


def _placeholders(gm: GraphModule) -> list[str]:
    return [n.target for n in gm.graph.nodes if n.op == "placeholder"]


def _after(_first, then):
    return then


@pytest.mark.parametrize("make_batch, reason", [
    (lambda g, ids: g.call_function(operator.add, (ids, g.get_attr("w"))), "its ids depend on parameter 'w'"),
    (lambda g, ids: _after(g.call_method("add_", (g.get_attr("counts"), 1)),
                           g.call_function(operator.add, (ids, g.get_attr("counts")))),
     "its ids depend on buffer 'counts', which the impure call '.add_()' (node %add_) may modify in place"),
    (lambda g, ids: g.call_function(torch.randint_like, (ids, 10)),
     "its ids depend on the random op 'torch.randint_like' (node %randint_like)"),
    (lambda g, ids: g.call_method("add_", (ids, 1)), "its ids depend on the impure call '.add_()' (node %add_)"),
    (lambda g, ids: _after(g.call_method("clamp_", (ids, 0, 5)), g.call_function(operator.getitem, (ids, 0))),
     "its ids depend on the input %ids, which the impure call '.clamp_()' (node %clamp_) may modify in place"),
], ids=["parameter", "updated_buffer", "random", "in_place", "mutated_input"])
def test_lookups_that_are_not_a_function_of_the_inputs_are_warned(client, make_batch, reason):
    gm, warned = _prefetch(_step(make_batch))
    batch = gm.graph.find_nodes(op="call_function", target=ops.ps_lookup_start)[0].args[2]
    assert warned == [f"async_rpc_prefetch: the lookup of client 'replay_ps' (batch %{batch.name}) is not "
                      f"prefetched: {reason} (server 0); it keeps the in-step schedule"]
    assert _placeholders(gm) == ["ids", "x"]
    assert all("next_kjt" not in n.kwargs for n in gm.graph.find_nodes(op="call_function", target=ops.ps_push_start))


def test_a_computed_batch_is_replayed_on_the_next_input(client):
    gm, warned = _prefetch(_step(lambda g, ids: g.call_method("long", (g.call_function(operator.getitem, (
        ids, (slice(None), 1))),))))
    assert warned == []
    assert _placeholders(gm) == ["ids", "x", "next_ids"]
    nxt = gm.graph.find_nodes(op="placeholder")[-1]
    push = gm.graph.find_nodes(op="call_function", target=ops.ps_push_start)[0]
    replay = push.kwargs["next_kjt"]
    assert replay.op == "call_module" and replay.args == (nxt,) and replay.kwargs == {"next_batch": True}
    module = gm.get_submodule(replay.target)
    ids = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    out = module(ids)
    assert out.dtype == torch.long and out.tolist() == [2, 4]
    assert module(ids) is out and module(ids, next_batch=True) is out   # the same objects: the same batch
    assert module(None, next_batch=True) is None                        # no next batch given: no prefetch
    ids.add_(1)                                                          # modified in place: computed again
    assert module(ids) is not out and module(ids).tolist() == [3, 5]
    for clone in (copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))):
        assert clone.get_submodule(replay.target)(ids).tolist() == [3, 5]
    # the current step's batch comes from the same module; the copied nodes left unused are gone
    assert push.args[2].op == "call_module" and push.args[2].target == replay.target and push.args[2].args[0].name == "ids"
    assert not gm.graph.find_nodes(op="call_method", target="long")


def test_with_max_staleness_the_replayed_batch_is_prefetched_after_the_lookup(client):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        gm = scheduling.async_rpc(_step(lambda g, ids: g.call_method("view", (ids, -1))), prefetch=True,
                                  max_staleness=1)
    assert [w for w in record if w.category is PrefetchWarning] == []
    nodes = list(gm.graph.nodes)
    names = [n.name for n in nodes]
    assert names[:6] == ["ids", "x", "next_ids", "prefetch_view", "prefetch_view_1", "ps_lookup_start"]
    prefetch = nodes[6]
    assert prefetch.target is ops.ps_prefetch and prefetch.args == ("replay_ps", 0, nodes[4])
    assert nodes[4].kwargs == {"next_batch": True} and nodes[5].args[2] is nodes[3]
