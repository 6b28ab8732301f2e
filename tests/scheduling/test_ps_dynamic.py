"""The dynamic (collisionless) row store: admission, LRU eviction, expiry, counters, checkpoints, and a few
training steps exact against a small pure-Python reference with the same rules."""

from __future__ import annotations

import pytest
import torch

from recsys.criteo_format import mix64
from scheduling.ps.dynamic import DynamicSpec, DynamicTable, initial_rows, mix64_torch, table_salt
from scheduling.ps.optimizer import make_optimizer
from scheduling.ps.server import PSServer
from scheduling.ps.shard_plan import TableSpec, plan_shards


def _table(capacity=4, min_count=1, expire_steps=None, optimizer="sgd", dim=3):
    return DynamicTable(dim, DynamicSpec(capacity, min_count, expire_steps), make_optimizer(optimizer, lr=0.5),
                        seed=7, salt=1)


def _ids(*v):
    return torch.tensor(v, dtype=torch.int64)


class Reference:
    """Same rules, one id at a time with dicts: the reference the vectorised table must match."""

    def __init__(self, dim, capacity, min_count, expire_steps, lr, seed=7, salt=1):
        self.seed, self.salt = seed, salt
        self.dim, self.capacity, self.min_count, self.expire, self.lr = dim, capacity, min_count, expire_steps, lr
        self.rows, self.slot, self.last, self.cand, self.step = {}, {}, {}, {}, 0
        self.rejected = 0

    def lookup(self, ids):
        self.step += 1
        if self.expire is not None:
            for i in [i for i in self.rows if self.step - self.last[i] > self.expire]:
                del self.rows[i], self.slot[i], self.last[i]
            self.cand = {i: c for i, c in self.cand.items() if self.step - c[1] <= self.expire}
        counts = {}
        for i in ids.tolist():
            counts[i] = counts.get(i, 0) + 1
        for i in sorted(counts):
            if i in self.rows:
                self.last[i] = self.step
            else:
                self.cand[i] = (self.cand.get(i, (0, 0))[0] + counts[i], self.step)
        for i in sorted(i for i in counts if i in self.cand and self.cand[i][0] >= self.min_count):
            free = sorted(set(range(self.capacity)) - set(self.slot.values()))
            if free:
                slot = free[0]
            else:
                old = [j for j in self.rows if self.last[j] < self.step]
                if not old:
                    continue
                victim = min(old, key=lambda j: (self.last[j], j))
                slot = self.slot.pop(victim)
                del self.rows[victim], self.last[victim]
            del self.cand[i]
            self.rows[i] = initial_rows(_ids(i), self.dim, self.capacity ** -0.5, self.seed, self.salt)[0]
            self.slot[i], self.last[i] = slot, self.step
        out = torch.stack([self.rows.get(i, torch.zeros(self.dim)) for i in ids.tolist()])
        self.rejected += sum(i not in self.rows for i in ids.tolist())
        return out

    def push(self, ids, grads):
        for i in sorted(set(ids.tolist())):
            if i in self.rows:
                self.rows[i] = self.rows[i] - self.lr * grads[ids == i].sum(0)
        self.rejected += sum(i not in self.rows for i in ids.tolist())


def test_mix_matches_recsys_and_rows_are_deterministic_per_id():
    v = 123456789
    z = torch.tensor([v + (0 + 1) * 0x9E3779B97F4A7C15 - (1 << 64)])
    assert int(mix64_torch(z)[0]) % (1 << 64) == mix64(v, 0)
    a = initial_rows(_ids(5, 9, 2**62), 8, 0.25, seed=3)
    b = initial_rows(_ids(2**62, 5), 8, 0.25, seed=3)
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])
    assert a.abs().max() <= 0.25 and not torch.equal(a[0], a[1])
    assert not torch.equal(a, initial_rows(_ids(5, 9, 2**62), 8, 0.25, seed=4))


@pytest.mark.usefixtures("dynamic_backend")
def test_admission_after_min_count_lookups_zero_and_pushes_dropped_until_then():
    t = _table(min_count=3)
    rows, slots = t.lookup(_ids(10, 11))
    assert torch.equal(rows, torch.zeros(2, 3)) and slots.tolist() == [-1, -1]
    assert t.push(_ids(10), torch.ones(1, 3)) == 0
    assert t.stats()["rejected"] == 3 and t.stats()["inserts"] == 2 and t.stats()["rows"] == 0
    rows, slots = t.lookup(_ids(10, 10, 11))                  # 10 reaches 3 occurrences: admitted now
    assert slots.tolist() == [0, 0, -1]
    assert torch.equal(rows[0], initial_rows(_ids(10), 3, 0.5, 7, 1)[0]) and torch.equal(rows[2], torch.zeros(3))
    assert t.push(_ids(10, 10), torch.ones(2, 3)) == 1
    assert torch.allclose(t.lookup(_ids(10))[0][0], initial_rows(_ids(10), 3, 0.5, 7, 1)[0] - 1.0)
    s = t.stats()
    assert (s["rows"], s["admitted"], s["inserts"], s["candidates"], s["rejected"]) == (1, 1, 2, 1, 4)


@pytest.mark.usefixtures("dynamic_backend")
def test_lru_eviction_order_and_slot_reuse():
    t = _table(capacity=3)
    t.lookup(_ids(1, 2, 3))                                    # slots 0, 1, 2
    t.lookup(_ids(1))
    t.lookup(_ids(3))
    _, slots = t.lookup(_ids(4, 5))                            # evicts 2 (oldest), then 1
    assert slots.tolist() == [1, 0]
    assert t.slots_of(_ids(1, 2, 3)).tolist() == [-1, -1, 2]
    assert t.stats()["evictions"] == 2 and t.stats()["rows"] == 3
    _, slots = t.lookup(_ids(6, 7, 8, 9))                      # all three rows evictable; 9 cannot get one
    assert slots.tolist() == [2, 1, 0, -1]              # 3 (oldest), then 4 and 5 by id
    assert t.stats()["rows"] == 3 and t.slots_of(_ids(9)).tolist() == [-1]


@pytest.mark.usefixtures("dynamic_backend")
def test_rows_seen_in_the_current_lookup_are_never_evicted():
    t = _table(capacity=2)
    t.lookup(_ids(1, 2))
    _, slots = t.lookup(_ids(1, 2, 3))
    assert slots.tolist() == [0, 1, -1] and t.stats()["evictions"] == 0


@pytest.mark.usefixtures("dynamic_backend")
def test_expiry_frees_rows_and_candidates_unseen_for_expire_steps():
    t = _table(capacity=4, min_count=2, expire_steps=2)
    t.lookup(_ids(1, 1, 2))                                    # 1 admitted, 2 candidate
    t.lookup(_ids(3, 3))
    t.lookup(_ids(3))
    assert t.slots_of(_ids(1)).tolist() == [0] and t.stats()["candidates"] == 1
    t.lookup(_ids(3))                                          # step 4: 1 (last 1) and candidate 2 expire
    s = t.stats()
    assert t.slots_of(_ids(1)).tolist() == [-1] and s["expired"] == 1 and s["candidates"] == 0
    _, slots = t.lookup(_ids(5, 5))
    assert slots.tolist() == [0, 0]                            # the expired slot is reused first


@pytest.mark.usefixtures("dynamic_backend")
def test_checkpoint_round_trip_keeps_map_rows_state_and_counters():
    t = _table(capacity=3, min_count=2, optimizer="rowwise_adagrad")
    for step in range(6):
        ids = torch.randint(0, 6, (8,), generator=torch.Generator().manual_seed(step))
        rows, _ = t.lookup(ids)
        t.push(ids, torch.randn(8, 3, generator=torch.Generator().manual_seed(100 + step)))
    copy = _table(capacity=3, min_count=2, optimizer="rowwise_adagrad")
    copy.load_state_dict(t.state_dict())
    assert copy.stats() == t.stats()
    ids = _ids(0, 1, 2, 3, 4, 5, 9)
    assert torch.equal(copy.lookup(ids)[0], t.lookup(ids)[0])
    g = torch.ones(7, 3)
    copy.push(ids, g), t.push(ids, g)
    assert torch.equal(copy.state_dict()["weight"], t.state_dict()["weight"])
    assert torch.equal(copy.state_dict()["state"], t.state_dict()["state"])
    with pytest.raises(ValueError, match="capacity"):
        _table(capacity=5).load_state_dict(t.state_dict())


def test_spec_rejects_bad_values():
    with pytest.raises(ValueError):
        DynamicSpec(0)
    with pytest.raises(ValueError):
        DynamicSpec(4, min_count=0)


@pytest.mark.usefixtures("dynamic_backend")
@pytest.mark.parametrize("capacity, min_count, expire", [(64, 1, None), (12, 2, 3), (6, 1, 2)])
def test_training_matches_the_reference_exactly(capacity, min_count, expire):
    """A pooled-embedding linear model trained a few steps: same losses, same rows, same counters."""
    dim, lr, batch, bag = 4, 0.5, 6, 3
    table = DynamicTable(dim, DynamicSpec(capacity, min_count, expire), make_optimizer("sgd", lr=lr),
                         seed=7, salt=1)
    ref = Reference(dim, capacity, min_count, expire, lr)
    w = torch.randn(dim, generator=torch.Generator().manual_seed(0))
    for step in range(12):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 40, (batch * bag,), generator=gen) * 1_000_000_007 + (1 << 40)   # raw, sparse
        y = torch.randn(batch, generator=gen)
        losses = []
        for lookup in (lambda i: table.lookup(i)[0], ref.lookup):
            rows = lookup(ids).requires_grad_()
            loss = ((rows.view(batch, bag, dim).sum(1) @ w - y) ** 2).mean()
            loss.backward()
            losses.append((loss.detach(), rows.grad))
        assert torch.equal(losses[0][0], losses[1][0]), step
        table.push(ids, losses[0][1])
        ref.push(ids, losses[1][1])
        for i, row in ref.rows.items():
            assert torch.equal(table.rows_of(_ids(i))[0], row), (step, i)
        assert sorted(ref.rows) == sorted(table.map_ids.tolist())
        assert table.stats()["rejected"] == ref.rejected
    s = table.stats()
    assert s["admitted"] > 0 and (capacity == 64 or s["evictions"] + s["expired"] > 0)
    assert min_count == 1 or s["rejected"] > 0


# ---- on a server ---------------------------------------------------------------------------------------------

DYN = DynamicSpec(capacity=10, min_count=2, expire_steps=4)
SERVER_TABLES = [TableSpec("fixed", 20, 4, ("fa",)), TableSpec("dyn", 10, 4, ("fb", "fc"), dynamic=DYN)]


def _server(storage="fp32"):
    srv = PSServer("ps0")
    srv.configure("ns", plan_shards(SERVER_TABLES, 1), 0, "rowwise_adagrad", {"lr": 0.5}, seed=3, storage=storage)
    return srv


def _server_batch(step, batch_size=4):
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 3, (3 * batch_size,), generator=gen)
    n = lengths.view(3, batch_size).sum(1).tolist()
    fixed = torch.randint(0, 20, (n[0],), generator=gen)
    raw = torch.randint(0, 15, (n[1] + n[2],), generator=gen) * (1 << 40) + 12345     # raw 64-bit ids
    return ("fa", "fb", "fc"), torch.cat([fixed, raw]), lengths.int(), None


def test_server_routes_dynamic_tables_through_the_store_and_matches_a_local_table():
    srv = _server()
    assert srv.fused["ns"] is None                                     # dynamic tables take the per-shard path
    local = DynamicTable(4, DYN, make_optimizer("rowwise_adagrad", lr=0.5), seed=3, salt=table_salt("dyn"))
    for step in range(8):
        keys, values, lengths, _ = batch = _server_batch(step)
        out = srv.lookup("ns", batch)
        n = lengths.view(3, -1).sum(1).tolist()
        raw = values[n[0]:]
        rows, _ = local.lookup(raw)
        bags = torch.repeat_interleave(torch.arange(8), lengths.view(3, -1)[1:].reshape(-1).long())
        pooled = torch.zeros(8, 4).index_add_(0, bags, rows)
        assert torch.equal(out[:, 4:8], pooled[:4]) and torch.equal(out[:, 8:], pooled[4:]), step
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(50 + step))
        srv.push("ns", batch, grad)
        local.push(raw, torch.cat([grad[:, 4:8], grad[:, 8:]]).index_select(0, bags))
    dyn = srv.shards["ns/dyn@0"].dynamic
    assert dyn is not None and dyn.stats() == local.stats() and dyn.stats()["rejected"] > 0
    assert torch.equal(dyn.state_dict()["weight"], local.state_dict()["weight"])


@pytest.mark.parametrize("storage", ["fp32", "fp16"])
def test_server_checkpoint_round_trip_of_a_dynamic_table(storage):
    srv = _server(storage)
    for step in range(5):
        out = srv.lookup("ns", _server_batch(step))
        srv.push("ns", _server_batch(step), torch.ones_like(out))
    state = srv.state_dict("ns")
    assert state["ns/dyn@0"]["dynamic"]["map_ids"].numel() > 0
    copy = PSServer("ps1")
    copy.configure("ns", plan_shards(SERVER_TABLES, 1), 0, "rowwise_adagrad", {"lr": 0.5}, seed=99,
                   storage=storage)
    copy.load_state_dict(state)
    for step in range(5, 8):
        batch = _server_batch(step)
        out = srv.lookup("ns", batch)
        assert torch.equal(copy.lookup("ns", batch), out)
        srv.push("ns", batch, out)
        copy.push("ns", batch, out)
    assert copy.shards["ns/dyn@0"].dynamic.stats() == srv.shards["ns/dyn@0"].dynamic.stats()


def test_server_refuses_a_dynamic_table_entry_without_its_map():
    srv = _server()
    srv.lookup("ns", _server_batch(0))
    entry = dict(srv.state_dict("ns")["ns/dyn@0"])
    del entry["dynamic"]                                  # what a client's full-table state dict carries back
    with pytest.raises(ValueError, match="id -> slot map"):
        srv.load_state_dict({"ns/dyn@0": entry})


def test_dynamic_tables_are_placed_table_wise_only():
    with pytest.raises(ValueError, match="table-wise"):
        plan_shards(SERVER_TABLES, 2, "row_wise")


@pytest.mark.usefixtures("dynamic_backend")
def test_fused8bit_dynamic_rows_train_close_to_fp32():
    exact, small = _server("fp32"), _server("fused8bit")
    for step in range(6):
        batch = _server_batch(step)
        a, b = exact.lookup("ns", batch), small.lookup("ns", batch)
        torch.testing.assert_close(b, a, atol=0.05, rtol=0)
        exact.push("ns", batch, torch.ones_like(a))
        small.push("ns", batch, torch.ones_like(a))
    assert small.shards["ns/dyn@0"].dynamic.weight.dtype == torch.uint8
    assert small.shards["ns/dyn@0"].dynamic.stats() == exact.shards["ns/dyn@0"].dynamic.stats()


# ---- through the pass --------------------------------------------------------------------------------------
class RawIds(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.t = torch.nn.Embedding(8, 4)                     # 8 rows locally; on the servers: dynamic, raw ids
        self.register_buffer("proj", torch.linspace(-1, 1, 4).unsqueeze(1))

    def forward(self, ids):
        return (self.t(ids) @ self.proj).squeeze(1)


def test_pass_with_a_dynamic_table_trains_exactly_as_the_reference():
    import functools

    import fxdist
    import scheduling
    from scheduling import placement
    from scheduling.ps import LocalCluster

    with LocalCluster(num_servers=1):
        to_servers = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=0.5, verbose=False,
                                       client="dyn", dynamic={"t": {"capacity": 6, "min_count": 2}})
        gm = fxdist.optimize(RawIds(), passes=(to_servers,))
        ref = Reference(4, 6, 2, None, 0.5, seed=0, salt=table_salt("t"))
        proj = torch.linspace(-1, 1, 4).unsqueeze(1)
        try:
            for step in range(10):
                gen = torch.Generator().manual_seed(step)
                ids = torch.randint(0, 9, (8,), generator=gen) * (1 << 50) + 3        # far beyond 8 rows
                target = torch.randn(8, generator=gen)
                loss = ((gm(ids) - target) ** 2).mean()
                loss.backward()
                rows = ref.lookup(ids).requires_grad_()
                ref_loss = (((rows @ proj).squeeze(1) - target) ** 2).mean()
                ref_loss.backward()
                ref.push(ids, rows.grad)
                assert torch.equal(loss.detach(), ref_loss.detach()), step
            placement.flush(gm)
            from scheduling.ps.client import get_client

            weight = get_client(placement.client_names(gm)[0]).state_dict()["t.weight"]      # (capacity, D) slots
            assert weight.shape == (6, 4) and len(ref.rows) == 6
            for i, row in ref.rows.items():
                assert torch.equal(weight[ref.slot[i]], row), i
        finally:
            placement.close(gm)


def test_with_dynamic_marks_tables_and_rejects_bad_entries():
    from scheduling.placement.plan import TableInfo, plan_tables, with_dynamic

    big = TableInfo(TableSpec("big", 1 << 20, 8, ("f",)), "m", "m")
    small = TableInfo(TableSpec("small", 10, 8, ("g",)), "n", "n")
    out = with_dynamic({"m": [(big, None)], "n": [(small, None)]}, {"big": {"capacity": 1 << 20, "min_count": 2}})
    spec = out["m"][0][0].spec
    assert spec.dynamic == DynamicSpec(1 << 20, 2) and out["n"][0][0].spec.dynamic is None
    placements = plan_tables([out["m"][0][0], out["n"][0][0]], 2)
    assert placements[0].sharding == "table_wise"                 # never made row-wise automatically
    with pytest.raises(ValueError, match="names no table"):
        with_dynamic({"m": [(big, None)]}, {"nope": {"capacity": 4}})
    with pytest.raises(ValueError, match="capacity"):
        with_dynamic({"m": [(big, None)]}, {"big": {"min_count": 2}})


def _train_raw(prefetch: bool, batches):
    import functools

    import fxdist
    import scheduling
    from scheduling import placement
    from scheduling.ps.client import get_client

    torch.manual_seed(0)
    ps = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=0.5, verbose=False,
                           client=f"dynp{int(prefetch)}", dynamic={"t": {"capacity": 6, "min_count": 2}})
    gm = fxdist.optimize(RawIds(), passes=(ps, "async_rpc_prefetch") if prefetch else (ps,))
    try:
        nexts = [n.target for n in gm.graph.nodes if n.op == "placeholder" and n.target.startswith("next_")]
        losses = []
        for (ids, target), nxt in scheduling.lookahead(batches):
            extra = {n: None if nxt is None else nxt[0] for n in nexts}
            loss = ((gm(ids, **extra) - target) ** 2).mean()
            loss.backward()
            losses.append(loss.detach())
        placement.flush(gm)
        client = get_client(placement.client_names(gm)[0])
        return losses, client.state_dict()["t.weight"], client.prefetch_hits
    finally:
        placement.close(gm)


def test_prefetch_trains_a_dynamic_table_as_blocking_lookups():
    """The push of step t carries the lookup of step t + 1 (the ordering rules): the dynamic table sees the
    same lookups and pushes in the same order, so prefetching changes nothing."""
    from scheduling.ps import LocalCluster

    batches = []
    for step in range(8):
        gen = torch.Generator().manual_seed(step)
        batches.append((torch.randint(0, 9, (8,), generator=gen) * (1 << 50) + 3, torch.randn(8, generator=gen)))
    with LocalCluster(num_servers=1):
        blocking = _train_raw(False, batches)
        prefetched = _train_raw(True, batches)
    assert prefetched[2] > 0 and blocking[2] == 0
    assert all(torch.equal(a, b) for a, b in zip(blocking[0], prefetched[0]))
    assert torch.equal(blocking[1], prefetched[1])


def test_client_server_state_round_trip_restores_the_id_maps():
    """PSClient.server_states / load_server_states (scheduling.ps.client_state; what a job checkpoints for dynamic tables): the servers' shards
    with their id maps, given back after more training, restore the same rows and counters."""
    import functools

    import fxdist
    import scheduling
    from scheduling import placement
    from scheduling.ps import LocalCluster
    from scheduling.ps.client import get_client

    def train(gm, steps):
        for step in steps:
            gen = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 9, (8,), generator=gen) * (1 << 50) + 3
            ((gm(ids) - torch.randn(8, generator=gen)) ** 2).mean().backward()
        placement.flush(gm)

    with LocalCluster(num_servers=1):
        to_servers = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=0.5, verbose=False,
                                       client="dynstate", dynamic={"t": {"capacity": 4}})
        gm = fxdist.optimize(RawIds(), passes=(to_servers,))
        try:
            train(gm, range(5))
            client = get_client(placement.client_names(gm)[0])
            saved = client.server_states()
            (entry,) = saved[0].values()
            before = (entry["dynamic"]["map_ids"].clone(), entry["dynamic"]["counters"], client.state_dict())
            train(gm, range(5, 9))
            (moved,) = client.server_states()[0].values()
            assert moved["dynamic"]["counters"] != before[1]          # more training changed the tables
            client.load_server_states(saved)
            (after,) = client.server_states()[0].values()
            assert torch.equal(after["dynamic"]["map_ids"], before[0]) and after["dynamic"]["counters"] == before[1]
            assert all(torch.equal(v, before[2][k]) for k, v in client.state_dict().items())
            with pytest.raises(ValueError, match="2 server states for the 1 servers"):
                client.load_server_states(saved * 2)
        finally:
            placement.close(gm)
