"""Dynamic tables stacked in one group: every row, slot, counter and checkpoint bit-identical to the same
tables kept apart (each its own group of one, which tests/scheduling/test_ps_dynamic.py checks against a
pure-Python reference)."""

from __future__ import annotations

import pytest
import torch

from scheduling.ps.dynamic import DynamicSpec, DynamicTable, group_tables, lookup_tables, push_tables, table_salt
from scheduling.ps.optimizer import make_optimizer
from scheduling.ps.server import PSServer
from scheduling.ps.shard_plan import TableSpec, plan_shards

DIM = 3
pytestmark = pytest.mark.usefixtures("dynamic_backend")   # torch SlotIndex and compiled kernels


def _tables(n, spec, optimizer="rowwise_adagrad"):
    opt = make_optimizer(optimizer, lr=0.5)
    return [DynamicTable(DIM, spec, opt, seed=7, salt=table_salt(f"t{i}")) for i in range(n)]


def _same(a: DynamicTable, b: DynamicTable, where) -> None:
    assert a.stats() == b.stats(), where
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key, value in sa.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, sb[key]), (where, key)
        else:
            assert value == sb[key], (where, key)


def _requests(step, n):
    """Per step: a random subset of the ``n`` tables, some read by two features, ragged lengths, ids from a
    small pool (repeats, returns after eviction) with raw 64-bit values."""
    gen = torch.Generator().manual_seed(step)
    out = []
    for t in range(n):
        if float(torch.rand(1, generator=gen)) < 0.25:
            continue                                                    # absent from this request
        for _ in range(1 + int(torch.randint(0, 2, (1,), generator=gen))):
            size = int(torch.randint(0, 12, (1,), generator=gen))
            out.append((t, torch.randint(0, 30, (size,), generator=gen) * (1 << 45) + 17 * t))
    return out


@pytest.mark.parametrize("capacity, min_count, expire", [(8, 1, None), (6, 2, 3), (5, 1, 2), (40, 3, None)])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_grouped_tables_match_separate_tables_bit_for_bit(capacity, min_count, expire, optimizer):
    spec = DynamicSpec(capacity, min_count, expire)
    apart, grouped = _tables(4, spec, optimizer), _tables(4, spec, optimizer)
    assert len(group_tables(grouped)) == 1 and grouped[3].group is grouped[0].group
    assert grouped[2].index == 2 and grouped[2].lock is grouped[0].lock
    for step in range(25):
        reqs = _requests(step, 4)
        got = lookup_tables([(grouped[t], ids) for t, ids in reqs])
        want = lookup_tables([(apart[t], ids) for t, ids in reqs])
        for (t, ids), a, b in zip(reqs, got, want):
            assert a is not None and b is not None and a.shape == (ids.numel(), DIM)
            assert torch.equal(a, b), (step, t)
        gen = torch.Generator().manual_seed(1000 + step)
        pushes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for t, ids in reqs:
            g = torch.randn(ids.numel(), DIM, generator=gen)
            old = pushes.get(t)
            pushes[t] = (ids, g) if old is None else (torch.cat([old[0], ids]), torch.cat([old[1], g]))
        n_grouped = push_tables([(grouped[t], i, g) for t, (i, g) in pushes.items()])
        for table in apart:
            table.group.last_lookup = None                  # probe again rather than reuse the lookup's slots
        n_apart = sum(apart[t].push(i, g) for t, (i, g) in pushes.items())
        assert n_grouped == n_apart, step
        for t in range(4):
            _same(grouped[t], apart[t], (step, t))
    s = [t.stats() for t in apart]
    assert sum(x["admitted"] for x in s) > 0 and len({x["step"] for x in s}) > 1      # tables skipped steps
    if capacity < 40:
        assert sum(x["evictions"] + x["expired"] for x in s) > 0
    if min_count > 1 or capacity < 8:
        assert sum(x["rejected"] for x in s) > 0


@pytest.mark.parametrize("capacity, min_count, expire", [(6, 2, 3), (5, 1, 2)])
def test_chunked_map_ops_match_separate_tables(monkeypatch, capacity, min_count, expire):
    """Large groups run the dense map ops in chunks of tables; one or two tables a chunk, same results."""
    import scheduling.ps.dynamic_group as dg

    monkeypatch.setattr(dg, "CHUNK_ELEMENTS", 2 * capacity)
    test_grouped_tables_match_separate_tables_bit_for_bit(capacity, min_count, expire, "rowwise_adagrad")


def test_regrouping_mid_stream_keeps_state_and_a_checkpoint_loads_into_a_grouped_table():
    spec = DynamicSpec(6, 2, 4)
    apart, grouped = _tables(3, spec), _tables(3, spec)
    for step in range(6):
        for tables in (apart, grouped):
            for t, ids in _requests(step, 3):
                tables[t].lookup(ids)
                tables[t].push(ids, torch.ones(ids.numel(), DIM))
    group_tables(grouped)                                   # state copied into the stack as stored
    for t in range(3):
        _same(grouped[t], apart[t], t)
    fresh = _tables(3, spec)
    group_tables(fresh)
    fresh[1].load_state_dict(apart[1].state_dict())
    _same(fresh[1], apart[1], "loaded")
    assert fresh[0].stats()["step"] == 0                    # its neighbours untouched
    ids = torch.arange(10) * (1 << 45) + 17
    assert torch.equal(lookup_tables([(fresh[1], ids)])[0], apart[1].lookup(ids)[0])


def test_group_tables_keeps_incompatible_tables_apart():
    a = _tables(2, DynamicSpec(6))
    b = _tables(1, DynamicSpec(6, min_count=2))
    groups = group_tables(a + b)
    assert len(groups) == 2 and a[0].group is a[1].group and b[0].group is not a[0].group


TABLES = [TableSpec(f"d{i}", 8, DIM, (f"f{i}",), dynamic=DynamicSpec(8, 1, 5)) for i in range(3)]


def _server(storage, seed=3):
    srv = PSServer("ps0")
    srv.configure("ns", plan_shards(TABLES, 1), 0, "rowwise_adagrad", {"lr": 0.5}, seed=seed, storage=storage)
    return srv


def _batch(step):
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (3 * 4,), generator=gen)
    values = torch.randint(0, 20, (int(lengths.sum()),), generator=gen) * (1 << 50) + 5
    return ("f0", "f1", "f2"), values, lengths.int(), None


@pytest.mark.parametrize("storage", ["fp32", "fp16", "fused8bit"])
def test_server_groups_its_dynamic_tables_and_checkpoints_round_trip(storage):
    if storage == "fused8bit":
        pytest.importorskip("fbgemm_gpu")
    srv = _server(storage)
    shards = [srv.shards[f"ns/d{i}@0"] for i in range(3)]
    tables = [s.dynamic for s in shards]
    assert all(t is not None and t.group is tables[0].group for t in tables)
    assert shards[1].weight.data_ptr() == tables[1].weight.data_ptr() and shards[1].lock is shards[0].lock
    for step in range(6):
        out = srv.lookup("ns", _batch(step))
        srv.push("ns", _batch(step), torch.ones_like(out))
    copy = _server(storage, seed=99)
    copy.load_state_dict(srv.state_dict("ns"))
    assert copy.shards["ns/d0@0"].dynamic.group is copy.shards["ns/d2@0"].dynamic.group
    for step in range(6, 10):
        batch = _batch(step)
        out = srv.lookup("ns", batch)
        if storage == "fused8bit":                             # stochastic rounding: each server its own draws
            torch.testing.assert_close(copy.lookup("ns", batch), out, atol=0.05, rtol=0)
        else:
            assert torch.equal(copy.lookup("ns", batch), out), step
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
        srv.push("ns", batch, grad)
        copy.push("ns", batch, grad)
    for key in ("ns/d0@0", "ns/d1@0", "ns/d2@0"):
        a, b = srv.shards[key].dynamic, copy.shards[key].dynamic
        assert a.stats() == b.stats() and a.stats()["admitted"] > 0
        if storage != "fused8bit":                             # stochastic rounding: each server its own draws
            assert torch.equal(a.state_dict()["weight"], b.state_dict()["weight"]), key
    state = srv.state_dict("ns")["ns/d1@0"]
    assert torch.equal(state["weight"], state["dynamic"]["weight"])      # the shard's rows are the table's

