"""The parameter_servers pass on users' own models, against 2 real servers on loopback (one trainer).

Differential: each model trained with local tables (torch.optim.SGD on the tables, Adam on the dense part) and
after ``fxdist.optimize(model, passes=(parameter_servers with sgd, "async_rpc_prefetch"))`` (the servers' SGD on
the tables, Adam built on the optimized module's parameters) gives the same losses and tables.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingCollection

import fxdist
import scheduling
from fxdist.pipeline import NoOpPassWarning
from recsys.criteo import criteo_dlrm
from scheduling import placement
from scheduling.placement import PlacementWarning
from scheduling.placement.plan import TableInfo, plan_tables, server_bytes
from scheduling.ps import LocalCluster, NoGroupError, get_client, ops
from scheduling.ps.shard_plan import TableSpec

LR_TABLES = 0.05


class TwoTower(nn.Module):
    """nn.EmbeddingBag (1-D input + offsets, mean), nn.EmbeddingBag (2-D input, sum, per-sample weights) and
    nn.Embedding (padding_idx) tables inside a submodule, and a dense tower."""

    def __init__(self) -> None:
        super().__init__()
        self.sparse = nn.Module()
        self.sparse.user = nn.EmbeddingBag(20, 4, mode="mean")
        self.sparse.item = nn.EmbeddingBag(15, 4, mode="sum")
        self.history = nn.Embedding(12, 4, padding_idx=0)
        self.dense = nn.Linear(5, 4)
        self.top = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, dense, user_ids, user_offsets, item_ids, item_weights, history):
        user = self.sparse.user(user_ids, user_offsets)
        item = self.sparse.item(item_ids, per_sample_weights=item_weights)
        hist = self.history(history).mean(dim=1) + self.history(history[:, 0])  # one table, two calls
        return self.top(torch.cat([self.dense(dense), user, item, hist], dim=1)).squeeze(1)


def _ebc_tables() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=11, feature_names=["f0"]),
            EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=17, feature_names=["f1", "f2"],
                               pooling=PoolingType.MEAN)]


def _dlrm() -> nn.Module:
    return DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=_ebc_tables()), dense_in_features=5,
                dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[8, 1])


def _dlrm_dcn() -> nn.Module:
    return DLRM_DCN(embedding_bag_collection=EmbeddingBagCollection(tables=_ebc_tables()), dense_in_features=5,
                    dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[8, 1], dcn_num_layers=2,
                    dcn_low_rank_dim=4)


def _kjt_batches(steps: int, b: int = 3) -> list[tuple]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 3, (3 * b,), generator=gen)
        values = torch.cat([torch.randint(0, 11, (int(lengths[:b].sum()),), generator=gen),
                            torch.randint(0, 17, (int(lengths[b:].sum()),), generator=gen)])
        kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=values, lengths=lengths)
        out.append(((torch.rand(b, 5, generator=gen), kjt), torch.rand(b, generator=gen)))
    return out


def _two_tower_batches(steps: int, b: int = 3) -> list[tuple]:
    gen = torch.Generator().manual_seed(2)
    out = []
    for _ in range(steps):
        lengths = torch.randint(1, 4, (b,), generator=gen)
        inputs = (torch.rand(b, 5, generator=gen), torch.randint(0, 20, (int(lengths.sum()),), generator=gen),
                  torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]]),
                  torch.randint(0, 15, (b, 2), generator=gen), torch.rand(b, 2, generator=gen),
                  torch.randint(0, 12, (b, 3), generator=gen))
        out.append((inputs, torch.rand(b, generator=gen)))
    return out


def _table_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, (nn.EmbeddingBag, nn.Embedding))]


def _train_local(model: nn.Module, batches: list[tuple]) -> tuple[list[float], dict[str, torch.Tensor]]:
    tables = {f"{n}.weight" for n in _table_names(model)}
    named = dict(model.named_parameters())
    dense_opt = torch.optim.Adam([p for n, p in named.items() if n not in tables], lr=0.01)
    table_opt = torch.optim.SGD([named[n] for n in sorted(tables)], lr=LR_TABLES)
    losses = []
    for inputs, labels in batches:
        loss = F.binary_cross_entropy_with_logits(model(*inputs).reshape(-1), labels)
        dense_opt.zero_grad()
        table_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        table_opt.step()
        losses.append(loss.item())
    return losses, {n: named[n].detach().clone() for n in tables}


def _train_on_servers(model: nn.Module, batches: list[tuple], next_names: list[str], plan=None):
    ps = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=LR_TABLES, plan=plan, verbose=False)
    gm = fxdist.optimize(model, passes=(ps, "async_rpc_prefetch"))
    try:
        opt = torch.optim.Adam(gm.parameters(), lr=0.01)  # the user's optimizer: the dense part only
        losses = []
        for (inputs, labels), nxt in scheduling.lookahead(batches):
            extra = {name: (None if nxt is None else nxt[0][i]) for i, name in next_names}
            loss = F.binary_cross_entropy_with_logits(gm(*inputs, **extra).reshape(-1), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        placement.flush(gm)
        hits = sum(get_client(n).prefetch_hits for n in placement.client_names(gm))
        return losses, placement.table_state_dict(gm), gm, hits
    finally:
        placement.close(gm)


def test_no_group_is_a_clear_error():
    from torch.distributed import rpc

    if rpc.api._is_current_rpc_agent_set():
        pytest.skip("another test of this session left an RPC group running")
    with pytest.raises(NoGroupError, match=r"parameter_servers: no parameter-server group .*LocalCluster"):
        scheduling.parameter_servers(TwoTower())


def test_no_op_is_warned_with_the_reason():
    with pytest.warns(NoOpPassWarning) as record:
        gm = fxdist.optimize(nn.Sequential(nn.Linear(3, 3)), passes=("parameter_servers", "async_rpc"))
    messages = [str(w.message) for w in record if w.category is NoOpPassWarning]
    assert messages == ["parameter_servers: changed nothing: no embedding module found (torchrec "
                        "EmbeddingBagCollection, nn.EmbeddingBag or nn.Embedding called as a call_module node; "
                        "trace with scheduling.placement.EmbeddingLeafTracer)",
                        f"async_rpc: changed nothing: {fxdist.pipeline.NO_OP_REASONS['async_rpc']}"]
    assert set(gm.meta["fxdist"]["unchanged"]) == {"parameter_servers", "async_rpc"}


def _infos(sizes: dict[str, int], dim: int = 8) -> list[TableInfo]:
    return [TableInfo(TableSpec(n, r, dim, (n,)), "m", f"m.{n}") for n, r in sizes.items()]


def test_plan_row_wise_for_large_tables_table_wise_for_small_balanced_by_bytes():
    tables = _infos({"big": 100_000, "a": 3000, "b": 2000, "c": 2500, "d": 1000})
    plan = {p.table.spec.name: p for p in plan_tables(tables, 2)}
    assert plan["big"].sharding == "row_wise" and plan["big"].servers == (0, 1)
    assert all(plan[t].sharding == "table_wise" and len(plan[t].servers) == 1 for t in "abcd")
    load = server_bytes(list(plan.values()), 2)
    assert max(load) <= 1.1 * sum(load) / 2
    # equal small tables: whole, one per server; a lone small table is never split
    even = plan_tables(_infos({"x": 500, "y": 500}), 2)
    assert [(p.sharding, p.servers) for p in even] == [("table_wise", (0,)), ("table_wise", (1,))]
    assert plan_tables(_infos({"x": 500}), 2)[0].sharding == "table_wise"
    # one server: everything whole
    assert {p.sharding for p in plan_tables(tables, 1)} == {"table_wise"}


def test_plan_overrides_and_bad_overrides():
    tables = _infos({"big": 100_000, "a": 3000, "b": 2000})
    plan = plan_tables(tables, 2, {"big": "table_wise", "m.a": "row_wise", "b": 1})
    assert [(p.sharding, p.servers, p.reason) for p in plan] == [
        ("table_wise", (0,), "override"), ("row_wise", (0, 1), "override"), ("table_wise", (1,), "override")]
    with pytest.raises(ValueError, match=r"plan names table 'nope', which is not among the tables"):
        plan_tables(tables, 2, {"nope": "row_wise"})
    with pytest.raises(ValueError, match=r"plan\['a'\] = 'columns'; use 'table_wise', 'row_wise', 'local' or a server"):
        plan_tables(tables, 2, {"a": "columns"})


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(2, timeout_s=30) as cl:
        yield cl


@pytest.mark.parametrize("make, plan", [(_dlrm, None), (_dlrm_dcn, {"t1": "row_wise"})], ids=["DLRM", "DLRM_DCN"])
def test_torchrec_dlrm_trains_as_with_local_tables(cluster, make, plan):
    torch.manual_seed(0)
    model = make()
    batches = _kjt_batches(4)
    local_losses, local_tables = _train_local(copy.deepcopy(model), batches)
    losses, tables, gm, hits = _train_on_servers(model, batches, [(1, "next_sparse_features")], plan)
    torch.testing.assert_close(losses, local_losses, rtol=1e-5, atol=1e-6)
    assert tables.keys() == local_tables.keys() == {f"sparse_arch.embedding_bag_collection.embedding_bags.{t}.weight"
                                                    for t in ("t0", "t1")}
    for key in tables:
        torch.testing.assert_close(tables[key], local_tables[key], rtol=1e-5, atol=1e-6)
        assert not torch.equal(tables[key], model.get_parameter(key))       # the tables did train
    assert "next_sparse_features" in [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    assert hits == 3 * len(gm.graph.find_nodes(op="call_function", target=ops.ps_lookup_start))  # all but step 1
    assert not any("embedding" in n for n, _ in gm.named_parameters())
    sharding = {t["table"]: t["sharding"] for t in gm.meta["fxdist"]["placement"]["tables"]}
    assert sharding == {"t0": "table_wise", "t1": "row_wise" if plan else "table_wise"}
    # SparseArch's to_dict + cat of the pooled features became the KeyedTensor's values (scheduling.placement.pooled)
    assert not gm.graph.find_nodes(op="call_method", target="to_dict")
    pooled = gm.graph.find_nodes(op="call_function", target=ops.ps_pool)
    assert [n.args[0] for n in gm.graph.find_nodes(op="call_method", target="values")] == pooled


def test_plain_module_with_embedding_bags_trains_as_with_local_tables(cluster):
    torch.manual_seed(0)
    model = TwoTower()
    with torch.no_grad():
        model.history.weight[0].zero_()
    batches = _two_tower_batches(4)
    local_losses, local_tables = _train_local(copy.deepcopy(model), batches)
    nexts = [(1, "next_user_ids"), (2, "next_user_offsets"), (3, "next_item_ids"), (4, "next_item_weights")]
    losses, tables, gm, hits = _train_on_servers(model, batches, nexts)
    torch.testing.assert_close(losses, local_losses, rtol=1e-5, atol=1e-6)
    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    assert placeholders[6:] == [name for _, name in nexts]  # history is read twice per step: not prefetched
    assert hits == 3 * 2                                    # user and item lookups of steps 2..4
    assert tables.keys() == local_tables.keys() == {"sparse.user.weight", "sparse.item.weight", "history.weight"}
    for key in tables:
        torch.testing.assert_close(tables[key], local_tables[key], rtol=1e-5, atol=1e-6)
    assert sorted(n for n, _ in gm.named_parameters()) == sorted(
        n for n, _ in model.named_parameters() if n not in tables)


def test_the_plan_is_printed_and_recorded(cluster, capsys):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.big = nn.EmbeddingBag(40_000, 8)          # 1.28 MB: over the row-wise minimum, and unbalanced whole
    model.small = nn.EmbeddingBag(300, 8)
    model.tiny = nn.EmbeddingBag(100, 8)
    ids = torch.randint(0, 100, (4, 2))
    expected = [m(ids) for m in (model.big, model.small, model.tiny)]
    gm = scheduling.parameter_servers(_Split(model), optimizer="sgd", lr=0.1, plan={"seq.tiny": 1})
    try:
        printed = capsys.readouterr().out
        assert [line.split() for line in printed.splitlines()] == [line.split() for line in [
            "parameter_servers plan: 3 tables on 2 servers, optimizer sgd (lr=0.1)",
            "table      module     rows x dim  sharding    server(s)  bytes",
            "seq.big    seq.big    40000 x 8   row_wise    ps0,ps1    1280000",
            "seq.small  seq.small  300 x 8     table_wise  ps0        9600",
            "seq.tiny   seq.tiny   100 x 8     table_wise  ps1        3200",
            "bytes per server: ps0 649600, ps1 643200"]]
        meta = gm.meta["fxdist"]["placement"]
        assert meta["server_bytes"] == {"ps0": 640000 + 9600, "ps1": 640000 + 3200}
        assert [(t["table"], t["sharding"], t["servers"], t["reason"]) for t in meta["tables"]] == [
            ("seq.big", "row_wise", ["ps0", "ps1"], "large"), ("seq.small", "table_wise", ["ps0"], "balanced"),
            ("seq.tiny", "table_wise", ["ps1"], "override")]
        assert meta["plan_text"] == printed.rstrip("\n")
        with torch.no_grad():
            for got, want in zip(gm(ids), expected):
                torch.testing.assert_close(got, want)
    finally:
        placement.close(gm)


class _Split(nn.Module):
    def __init__(self, seq: nn.Module) -> None:
        super().__init__()
        self.seq = seq

    def forward(self, ids):
        return self.seq.big(ids), self.seq.small(ids), self.seq.tiny(ids)


class _Hidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4)

    def forward(self, ids):
        return self.emb(ids)


class Mixed(nn.Module):
    """Movable tables (one called twice, one frozen, one sequence) and one of each kind the pass must leave
    local."""

    def __init__(self) -> None:
        super().__init__()
        self.ok = nn.EmbeddingBag(10, 4)
        self.maxpool = nn.EmbeddingBag(10, 4, mode="max")
        self.normed = nn.Embedding(10, 4, max_norm=1.0)
        self.mutated = nn.EmbeddingBag(10, 4)
        self.tied = nn.Embedding(10, 4)
        self.seq = EmbeddingCollection(tables=[EmbeddingConfig(name="s", embedding_dim=4, num_embeddings=10,
                                                               feature_names=["s"])])
        self.hidden = _Hidden()
        self.frozen = nn.EmbeddingBag(10, 4)
        self.frozen.weight.requires_grad_(False)
        self.padded = nn.Embedding(10, 4, padding_idx=0)
        with torch.no_grad():
            self.padded.weight[0] = 1.0

    def forward(self, ids, kjt):
        d = self.mutated(ids)
        d.mul_(2)
        e = self.tied(ids).sum(1) + self.tied.weight.sum()
        f = self.seq(kjt)["s"].values().sum()
        return (self.ok(ids) + self.ok(ids[:, :1]) + self.maxpool(ids) + self.normed(ids).sum(1) + d + e + f
                + self.hidden(ids) + self.frozen(ids) + self.padded(ids).sum(1))


class _HiddenLeafTracer(placement.EmbeddingLeafTracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, _Hidden) or super().is_leaf_module(m, qualname)


def test_modules_that_cannot_move_are_reported_and_stay_local(cluster):
    torch.manual_seed(0)
    model = Mixed()
    ids = torch.randint(0, 10, (3, 2))
    kjt = KeyedJaggedTensor(keys=["s"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 0, 2]))
    with torch.no_grad():
        expected = model(ids, kjt)
    tracer = _HiddenLeafTracer()
    graph = tracer.trace(model)
    traced = fxdist.GraphModule(tracer.root, graph)
    with pytest.warns(PlacementWarning) as record:
        gm = scheduling.parameter_servers(traced, optimizer="sgd", lr=0.1, verbose=False)
    try:
        why = {w.message.args[0].split(" ")[1]: str(w.message) for w in record if w.category is PlacementWarning}
        assert set(why) == {"maxpool", "normed", "mutated", "tied", "hidden.emb", "padded"}
        assert "(Embedding, node %padded): padding_idx=0 and row 0 is not zero" in why["padded"]
        assert "(EmbeddingBag, node %maxpool): mode='max' pooling" in why["maxpool"]
        assert "(Embedding, node %normed): max_norm=1.0 renormalises" in why["normed"]
        assert "modified in place by %mul_ (call_method mul_)" in why["mutated"]
        assert "read directly by %tied_weight (get_attr tied.weight)" in why["tied"]
        assert "inside leaf module hidden (_Hidden)" in why["hidden.emb"]
        assert all(w.endswith("it stays on the trainer") for w in why.values())
        meta = gm.meta["fxdist"]["placement"]
        assert {k["module"] for k in meta["not_moved"]} == set(why)
        modules = {n.target for n in gm.graph.nodes if n.op == "call_module"}
        assert modules == {"maxpool", "normed", "mutated", "tied", "hidden", "padded"}  # local, still called
        assert [t["table"] for t in meta["tables"]] == ["s", "ok", "frozen"]
        assert list(meta["clients"]) == ["seq", "ok", "frozen"]
        assert len(gm.graph.find_nodes(op="call_function", target=ops.ps_pool)) == 4  # "ok" called twice
        hooks = gm.graph.find_nodes(op="call_function", target=ops.ps_push_in_backward)
        assert sorted(h.args[0] for h in hooks) == ["ps:ok", "ps:ok", "ps:seq"]       # no pushes for a frozen table
        with torch.no_grad():
            torch.testing.assert_close(gm(ids, kjt), expected)
    finally:
        placement.close(gm)


def test_one_optimizer_per_server(cluster):
    from scheduling.ps import PSClient

    other = PSClient(_ebc_tables(), cluster.server_names, optimizer="rowwise_adagrad", name="other_optimizer")
    try:
        with pytest.raises(ValueError, match=r"already serve client 'other_optimizer' with optimizer "
                                             r"rowwise_adagrad .*one optimizer for all its tables"):
            scheduling.parameter_servers(TwoTower(), optimizer="sgd", lr=0.1, verbose=False)
        with pytest.raises(ValueError, match="unknown parameter-server optimizer 'adam'"):
            scheduling.parameter_servers(TwoTower(), optimizer="adam", verbose=False)
    finally:
        other.close()


def test_optimize_accepts_a_partial_and_names_it(cluster):
    ps = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=0.05, verbose=False, servers=["ps1"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoOpPassWarning)
        gm = fxdist.optimize(TwoTower(), passes=(ps, "async_rpc"))
    try:
        assert [r["name"] for r in gm.meta["fxdist"]["passes"]] == ["parameter_servers", "async_rpc"]
        assert all(r["modified"] for r in gm.meta["fxdist"]["passes"])
        meta = gm.meta["fxdist"]["placement"]
        assert meta["optimizer"] == {"name": "sgd", "lr": 0.05} and meta["servers"] == ["ps1"]
        assert {s for t in meta["tables"] for s in t["servers"]} == {"ps1"}
        clients = {c.args[0] for c in gm.graph.find_nodes(op="call_function", target=ops.ps_lookup_start)}
        assert clients == set(meta["clients"].values())       # unique in the process: "ps:sparse.user#2" ...
        # sparse.user and sparse.item share one client (one request per server); history, called twice, has its own
        assert {c.split("#")[0] for c in clients} == {"ps:sparse.user+1", "ps:history"}
        assert meta["clients"]["sparse.user"] == meta["clients"]["sparse.item"] != meta["clients"]["history"]
    finally:
        placement.close(gm)


def test_pass_object_for_the_pass_manager(cluster):
    from fxdist.passes.pass_base import PassManager

    traced = placement._as_graph_module(TwoTower())
    result = PassManager([scheduling.ParameterServers(optimizer="sgd", lr=0.05, options={"verbose": False})]).run(traced)
    try:
        assert result.modified and result.graph_module.meta["fxdist"]["passes"][0]["name"] == "parameter-servers"
        assert not any(n.op == "call_module" and "sparse" in str(n.target) for n in result.graph_module.graph.nodes)
        assert any(n.op == "call_module" for n in traced.graph.nodes if n.target == "sparse.user")  # input untouched
    finally:
        placement.close(result.graph_module)


class Sequence(nn.Module):
    """torchrec EmbeddingCollection (sequence embeddings, one table read by two features) and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(tables=[
            EmbeddingConfig(name="words", embedding_dim=4, num_embeddings=13, feature_names=["title", "body"]),
            EmbeddingConfig(name="tags", embedding_dim=4, num_embeddings=7, feature_names=["tag"])])
        self.head = nn.Linear(12, 1)

    def forward(self, dense, kjt):
        seq = self.ec(kjt)
        pooled = [seq[f].to_padded_dense(desired_length=3).sum(1) for f in ("title", "body", "tag")]
        return self.head(torch.cat(pooled, dim=1)).squeeze(1) + dense.sum(1)


def test_embedding_collection_trains_as_with_local_tables(cluster):
    torch.manual_seed(0)
    model = Sequence()
    gen = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(4):
        lengths = torch.randint(0, 4, (9,), generator=gen)
        values = torch.cat([torch.randint(0, 13, (int(lengths[:6].sum()),), generator=gen),
                            torch.randint(0, 7, (int(lengths[6:].sum()),), generator=gen)])
        kjt = KeyedJaggedTensor(keys=["title", "body", "tag"], values=values, lengths=lengths)
        batches.append(((torch.rand(3, 2, generator=gen), kjt), torch.rand(3, generator=gen)))
    local_losses, local_tables = _train_local(copy.deepcopy(model), batches)
    losses, tables, gm, hits = _train_on_servers(model, batches, [(1, "next_kjt")])
    torch.testing.assert_close(losses, local_losses, rtol=1e-5, atol=1e-6)
    assert tables.keys() == local_tables.keys() == {"ec.embeddings.words.weight", "ec.embeddings.tags.weight"}
    for key in tables:
        torch.testing.assert_close(tables[key], local_tables[key], rtol=1e-5, atol=1e-6)
    assert hits == 3 * 2                                                   # both servers, steps 2..4


def test_table_state_round_trip_with_optimizer_state(cluster):
    """table_state_dict(optimizer_state=True) then load_table_state_dict restores weights and row-wise Adagrad
    state exactly (a job's checkpoint); a missing table or a wrong shape is refused before anything is sent."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("bag", nn.EmbeddingBag(30, 4, mode="sum"))
    gm = placement.parameter_servers(model, optimizer="rowwise_adagrad", lr=0.1, client="roundtrip", verbose=False)
    ids = torch.randint(0, 30, (8, 3))
    gm(ids).sum().backward()
    placement.flush(gm)
    saved = placement.table_state_dict(gm, optimizer_state=True)
    assert sorted(saved) == ["bag.momentum", "bag.weight"] and saved["bag.momentum"].abs().sum() > 0
    assert sorted(placement.table_state_dict(gm)) == ["bag.weight"]
    gm(ids).sum().backward()  # one more step changes both
    placement.flush(gm)
    assert not torch.equal(placement.table_state_dict(gm)["bag.weight"], saved["bag.weight"])
    placement.load_table_state_dict(gm, saved)
    again = placement.table_state_dict(gm, optimizer_state=True)
    assert all(torch.equal(again[k], saved[k]) for k in saved)
    with pytest.raises(KeyError, match="no 'bag.weight' in the state"):
        placement.load_table_state_dict(gm, {"other.weight": saved["bag.weight"]})
    with pytest.raises(ValueError, match=r"'bag.weight' has shape \(29, 4\), the table on the servers is \(30, 4\)"):
        placement.load_table_state_dict(gm, {"bag.weight": saved["bag.weight"][:29]})
    with pytest.raises(ValueError, match="no tables on parameter servers"):
        placement.load_table_state_dict(nn.Linear(2, 2), saved)
    placement.close(gm)


def test_storage_applies_to_the_moved_tables(cluster, capsys):
    """``storage="fp16"``: the servers hold the moved rows in float16 (lookups answer float32, the rows rounded
    to fp16); an unknown storage is refused before anything moves."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.bag = nn.EmbeddingBag(50, 8)
    with pytest.raises(ValueError, match=r"parameter_servers: unknown storage='int4' \(use one of fp32, fp16, fused8bit\)"):
        scheduling.parameter_servers(model, storage="int4")
    ids = torch.randint(0, 50, (4, 3))
    weight = model.bag.weight.detach().clone()
    gm = scheduling.parameter_servers(model, optimizer="sgd", lr=0.1, storage="fp16")
    try:
        assert gm.meta["fxdist"]["placement"]["storage"] == "fp16"
        assert capsys.readouterr().out.startswith("parameter_servers plan: 1 table on 2 servers, optimizer sgd "
                                                  "(lr=0.1), rows stored fp16")
        stored = placement.table_state_dict(gm)["bag.weight"]
        assert stored.dtype == torch.float32 and torch.equal(stored, weight.half().float())
        assert not torch.equal(stored, weight)  # the rows were rounded: fp16 storage, not fp32
        with torch.no_grad():
            torch.testing.assert_close(gm(ids), F.embedding_bag(ids, weight.half().float()))
    finally:
        placement.close(gm)


def _meta_dlrm(seed: int) -> nn.Module:
    return criteo_dlrm([11, 300, 17], 4, 3, dense_layers=(8, 4), over_layers=(8, 1), tables_device="meta", seed=seed)


def test_tables_on_meta_are_initialised_by_the_servers(cluster):
    """Tables built on the ``meta`` device (no trainer memory) move, and the servers make their rows: torchrec's
    distribution (uniform in ±sqrt(1/rows)), the same for the same seed, others for another; the optimized
    module holds no meta tensor, so it trains (DDP refuses modules with meta parameters)."""
    model = _meta_dlrm(seed=3)
    assert all(p.is_meta for n, p in model.named_parameters() if "embedding_bags" in n)
    gms = [fxdist.optimize(m, passes=(functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=0.1,
                                                        seed=s, verbose=False),))
           for m, s in ((model, 7), (_meta_dlrm(seed=3), 7), (_meta_dlrm(seed=3), 8))]
    try:
        states = [placement.table_state_dict(gm) for gm in gms]
        for key, w in states[0].items():
            rows = w.shape[0]
            assert w.shape == (rows, 4) and rows in (11, 300, 17)
            assert w.abs().max() <= rows ** -0.5 and w.std() > 0.2 * rows ** -0.5   # filled, in torchrec's range
            assert torch.equal(w, states[1][key])                # same seed and plan: the same rows
            assert not torch.equal(w, states[2][key])            # another seed: other rows
        gm = gms[0]
        assert not any(t.is_meta for t in (*gm.parameters(), *gm.buffers()))
        kjt = KeyedJaggedTensor(keys=["C1", "C2", "C3"], values=torch.tensor([1, 2, 299, 5, 16, 0]),
                                lengths=torch.ones(6, dtype=torch.int32))
        dense = torch.rand(2, 13)
        out = gm(dense, kjt)
        assert out.shape == (2, 1) and torch.isfinite(out).all()
        out.sum().backward()   # the pushes go to the servers: the looked-up rows change
        placement.flush(gm)
        after = placement.table_state_dict(gm)["sparse_arch.embedding_bag_collection.embedding_bags.t_C2.weight"]
        before = states[0]["sparse_arch.embedding_bag_collection.embedding_bags.t_C2.weight"]
        assert not torch.equal(after[299], before[299]) and torch.equal(after[298], before[298])
        # the arches do not depend on where the tables were built
        real = criteo_dlrm([11, 300, 17], 4, 3, dense_layers=(8, 4), over_layers=(8, 1), seed=3)
        assert torch.equal(gm.get_parameter("dense_arch.model._mlp.0._linear.weight"),
                           real.get_parameter("dense_arch.model._mlp.0._linear.weight"))
    finally:
        for gm in gms:
            placement.close(gm)
