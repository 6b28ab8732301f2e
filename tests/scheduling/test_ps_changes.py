"""Changed-row records of parameter servers (:mod:`scheduling.ps.changes`): servers trained in process, their changes
taken every few steps and applied to a copy of the tables as they were when tracking started; after each delta the
copy equals the servers' tables bit for bit (fixed tables on every push path, row-wise shards, reduced-precision
storage, dynamic tables with admissions, evictions and expiry)."""

from __future__ import annotations

import pytest
import torch

from jobs.deltas import DynamicDelta, apply_map
from scheduling.ps.dynamic import DynamicSpec
from scheduling.ps.fused import FusedTables
from scheduling.ps.server import PSServer
from scheduling.ps.shard_plan import TableSpec, plan_shards


def _servers(tables, num_servers, optimizer="sgd", storage="fp32", sharding=None):
    plan = plan_shards(tables, num_servers, sharding) if sharding else plan_shards(tables, num_servers)
    servers = [PSServer(f"ps{i}") for i in range(num_servers)]
    for i, s in enumerate(servers):
        s.configure("ns", plan, i, optimizer, {"lr": 0.5}, seed=3, storage=storage)
    return servers


def _batch(step, keys, high, batch_size=6, raw=False):
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 3, (len(keys) * batch_size,), generator=gen)
    ids = torch.randint(0, high, (int(lengths.sum()),), generator=gen)
    return tuple(keys), (ids * (1 << 40) + 7 if raw else ids), lengths.int(), None


def _copy(servers):
    """Per server, its tables as they are now: ``{shard key: [weight (R, D), {"ids", "slots"} or None]}``."""
    out = []
    for s in servers:
        state = s.state_dict("ns")
        out.append({k: [e["weight"].clone(), None if e["dynamic"] is None else
                        {"ids": e["dynamic"]["map_ids"].clone(), "slots": e["dynamic"]["map_slots"].clone()}]
                    for k, e in state.items()})
    return out


def _apply(copy, servers):
    """Take every server's changes and apply them to ``copy`` (rows set by global row, maps as jobs.deltas does);
    returns the rows taken."""
    taken = 0
    for mine, server in zip(copy, servers):
        for key, change in server_changes(server).items():
            weight, ids = mine[key]
            start = server.shards[key].spec.row_start
            weight[change["rows"] - start] = change["values"]
            taken += change["rows"].numel()
            if ids is not None:
                mine[key][1] = apply_map(ids, DynamicDelta(change["ids"], change["slots"], change["evicted"]))
    return taken


def server_changes(server):
    from scheduling.ps.endpoints import ServerEndpoints

    return ServerEndpoints(server).changes("ns")


def _same(copy, servers):
    assert _copy(servers) and len(copy) == len(servers)
    for mine, now in zip(copy, _copy(servers)):
        assert mine.keys() == now.keys()
        for key, (weight, ids) in now.items():
            assert torch.equal(mine[key][0], weight), key
            if ids is not None:
                assert torch.equal(mine[key][1]["ids"], ids["ids"]) and torch.equal(mine[key][1]["slots"], ids["slots"])


def _train(servers, steps, keys, high, raw=False, every=3):
    from scheduling.ps.endpoints import ServerEndpoints

    for s in servers:
        assert ServerEndpoints(s).changes("ns", start=True) == {}
    copy = _copy(servers)
    rows = []
    for step in steps:
        batch = _batch(step, keys, high, raw=raw)
        for s in servers:
            out = s.lookup("ns", batch)
            s.push("ns", batch, torch.randn(out.shape, generator=torch.Generator().manual_seed(100 + step)))
        if (step + 1) % every == 0:
            rows.append(_apply(copy, servers))
            _same(copy, servers)
    return rows


FIXED = [TableSpec("a", 40, 4, ("fa",)), TableSpec("b", 30, 4, ("fb", "fc"))]


@pytest.mark.parametrize("optimizer, storage, kernel", [("sgd", "fp32", "fxdist"), ("rowwise_adagrad", "fp32", "fxdist"),
                                                        ("rowwise_adagrad", "fp32", "fbgemm"),
                                                        ("rowwise_adagrad", "fp16", "fxdist"),
                                                        ("sgd", "fused8bit", "fxdist")])
def test_fixed_tables_row_wise_on_two_servers(optimizer, storage, kernel, monkeypatch):
    from scheduling.ps.tbe import KERNEL_ENV

    monkeypatch.setenv(KERNEL_ENV, kernel)
    servers = _servers(FIXED, 2, optimizer, storage, "row_wise")
    assert all(isinstance(s.fused["ns"], FusedTables) for s in servers)          # the stacked push path
    assert all((s.fused["ns"].kernel is not None) == (kernel == "fbgemm") for s in servers)
    rows = _train(servers, range(9), ["fa", "fb", "fc"], 30)
    assert 0 < max(rows) < 70                                                    # changed rows only, not all
    assert _apply(_copy(servers), servers) == 0                                  # nothing since the last one


def test_fixed_tables_on_the_per_shard_path():
    tables = [TableSpec("a", 40, 4, ("fa",)), TableSpec("b", 30, 2, ("fb",))]      # two widths: not stacked
    servers = _servers(tables, 1, "rowwise_adagrad")
    assert servers[0].fused["ns"] is None
    _train(servers, range(9), ["fa", "fb"], 30)


@pytest.mark.parametrize("expire", [None, 2])
def test_dynamic_tables_admissions_evictions_and_expiry(dynamic_backend, expire):
    tables = [TableSpec("d", 8, 4, ("fa",), dynamic=DynamicSpec(8, 1, expire)),
              TableSpec("e", 8, 4, ("fb",), dynamic=DynamicSpec(8, 1, expire))]
    servers = _servers(tables, 1, "rowwise_adagrad")
    _train(servers, range(12), ["fa", "fb"], 40, raw=True)
    stats = servers[0].shards["ns/d@0"].dynamic.stats()
    assert stats["evictions"] + stats["expired"] > 0 and stats["admitted"] > 8


def test_dynamic_and_fixed_tables_with_candidates():
    tables = [TableSpec("f", 20, 4, ("fa",)), TableSpec("d", 6, 4, ("fb",), dynamic=DynamicSpec(6, 2, 3))]
    servers = _servers(tables, 1, "sgd")

    def raw(step):                                      # fixed ids < 20, raw 64-bit ids for the dynamic table
        keys, ids, lengths, w = _batch(step, ["fa", "fb"], 20)
        n = int(lengths[:6].sum())
        return keys, torch.cat([ids[:n], ids[n:] * (1 << 40) + 5]), lengths, w

    from scheduling.ps.endpoints import ServerEndpoints

    ServerEndpoints(servers[0]).changes("ns", start=True)
    copy = _copy(servers)
    for step in range(10):
        out = servers[0].lookup("ns", raw(step))
        servers[0].push("ns", raw(step), torch.ones_like(out))
        if step % 2:
            _apply(copy, servers)
            _same(copy, servers)


def test_changes_need_tracking_and_a_load_starts_it_again():
    from scheduling.ps.endpoints import ServerEndpoints

    (server,) = _servers(FIXED, 1)
    ends = ServerEndpoints(server)
    with pytest.raises(ValueError, match="not tracked; start tracking first"):
        ends.changes("ns")
    with pytest.raises(ValueError, match="no tables of client 'other' to track"):
        ends.changes("other", start=True)
    ends.changes("ns", start=True)
    batch = _batch(0, ["fa", "fb", "fc"], 30)
    server.push("ns", batch, torch.ones_like(server.lookup("ns", batch)))
    saved = server.state_dict("ns")
    server.load_state_dict(saved)                       # restacked: the record starts again, empty
    assert all(c["rows"].numel() == 0 for c in ends.changes("ns").values())
    server.push("ns", batch, torch.ones_like(server.lookup("ns", batch)))
    assert sum(c["rows"].numel() for c in ends.changes("ns").values()) > 0
    from scheduling.ps.changes import stop_tracking

    stop_tracking(server, "ns")
    server.push("ns", batch, torch.ones_like(server.lookup("ns", batch)))   # not recorded, no error
    assert server.fused["ns"].changed is None and not server.changes
    with pytest.raises(ValueError, match="not tracked"):
        ends.changes("ns")


def test_a_client_takes_its_tables_changes_from_an_in_process_server():
    from torchrec import KeyedJaggedTensor

    from scheduling.ps import PSClient, serve_in_trainer, stop_serving

    serve_in_trainer("me", name="ps-me", own_requests="inline")
    try:
        client = PSClient([TableSpec("t0", 10, 4, ("f0",))], ["me"], name="own", optimizer="sgd",
                          optimizer_kwargs={"lr": 0.5}, seed=3)
        with pytest.raises(ValueError, match="not tracked"):
            client.take_changes()
        client.track_changes()
        before = client.state_dict()["t0.weight"].clone()
        kjt = KeyedJaggedTensor(keys=["f0"], values=torch.tensor([1, 7, 7]), lengths=torch.ones(3, dtype=torch.long))
        out = client.lookup(0, kjt)
        out.sum().backward()
        client.push(0, kjt, out)
        got = client.take_changes()["t0"]
        assert got["rows"].tolist() == [1, 7]
        before[got["rows"]] = got["values"]
        assert torch.equal(before, client.state_dict()["t0.weight"])
        client.close()
    finally:
        stop_serving()


def test_an_expired_id_is_evicted_and_its_fresh_row_at_the_same_slot_is_sent(dynamic_backend):
    """An id expired with its slot left free must be in ``evicted`` (no later id fills the slot); admitted again at
    the same slot, its fresh row must be sent although the slot's id did not change since the last delta."""
    from scheduling.ps.endpoints import ServerEndpoints

    (server,) = _servers([TableSpec("d", 4, 4, ("fa",), dynamic=DynamicSpec(4, 1, 2))], 1)
    table = server.shards["ns/d@0"].dynamic

    def step(ids, push=False):
        batch = (("fa",), torch.tensor(ids), torch.ones(len(ids), dtype=torch.int32), None)
        out = server.lookup("ns", batch)
        if push:
            server.push("ns", batch, torch.ones_like(out))

    step([5 << 40], push=True)                          # id X at slot 0, trained
    ServerEndpoints(server).changes("ns", start=True)
    copy = _copy([server])
    for _ in range(4):
        step([6 << 40])                                 # X unseen: expires, slot 0 left free
    assert table.stats()["expired"] == 1 and (5 << 40) not in table.map_ids.tolist()
    _apply(copy, [server])
    _same(copy, [server])
    step([5 << 40], push=True)                          # X again at slot 0, trained
    _apply(copy, [server])
    _same(copy, [server])
    for _ in range(4):
        step([6 << 40])
    step([5 << 40])                                     # X expired and admitted again since: a fresh row at slot 0
    assert table.slots_of(torch.tensor([5 << 40])).tolist() == [0] and table.stats()["expired"] == 2
    assert _apply(copy, [server]) == 1
    _same(copy, [server])
