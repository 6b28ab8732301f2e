"""The stacked (table-batched) server path gives exactly what the per-shard path gives; with FBGEMM's kernel
(:mod:`scheduling.ps.tbe`, dimensions divisible by 4) the same to float32 rounding (it sums in another order)."""

from __future__ import annotations

import functools
import os
import threading
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.ps.fused import FusedTables, unique_count, unique_inverse
from scheduling.ps.server import PSServer, server_layout
from scheduling.ps.shard_plan import TableSpec, plan_shards
from scheduling.ps.tbe import KERNEL_ENV


def _server(tables, sharding, num_servers, server, optimizer="rowwise_adagrad", fused=True) -> PSServer:
    srv = PSServer(f"ps{server}")
    srv.configure("ns", plan_shards(tables, num_servers, sharding), server, optimizer, {"lr": 0.1}, seed=3)
    if not fused:
        srv.fused["ns"] = None
    return srv


def _batch(data, tables, batch_size, weighted):
    keys = tuple(f for t in tables for f in t.feature_names)
    rows = {f: t.num_embeddings for t in tables for f in t.feature_names}
    lengths, values = [], []
    for key in keys:
        for _ in range(batch_size):
            n = data.draw(st.integers(0, 3))
            lengths.append(n)
            values += data.draw(st.lists(st.integers(0, rows[key] - 1), min_size=n, max_size=n))
    values_t = torch.tensor(values, dtype=torch.long)
    weights = torch.rand(len(values)) if weighted else None
    return keys, values_t, torch.tensor(lengths, dtype=torch.int32), weights


@pytest.mark.parametrize("kernel", ["fxdist", "fbgemm"])
@settings(max_examples=40, deadline=None)
@given(data=st.data(), num_servers=st.integers(1, 3), sharding=st.sampled_from(["table_wise", "row_wise"]),
       weighted=st.booleans(), optimizer=st.sampled_from(["rowwise_adagrad", "sgd"]))
def test_stacked_path_equals_per_shard_path(kernel, data, num_servers, sharding, weighted, optimizer):
    with mock.patch.dict(os.environ, {KERNEL_ENV: kernel}):
        _check_stacked_path(kernel, data, num_servers, sharding, weighted, optimizer)


def _check_stacked_path(kernel, data, num_servers, sharding, weighted, optimizer):
    dim = data.draw(st.sampled_from([1, 4, 8]))
    same = torch.equal if kernel == "fxdist" else functools.partial(torch.allclose, rtol=1e-5, atol=1e-6)
    tables = [TableSpec("a", data.draw(st.integers(1, 9)), dim, ("fa",)),
              TableSpec("b", data.draw(st.integers(1, 9)), dim, ("fb", "fc")),   # one table, two features
              TableSpec("c", data.draw(st.integers(1, 9)), dim, ("fd",))]
    batch_size = data.draw(st.integers(1, 4))
    for server in range(num_servers):
        fast = _server(tables, sharding, num_servers, server, optimizer)
        slow = _server(tables, sharding, num_servers, server, optimizer, fused=False)
        if not fast.layouts["ns"]:
            continue
        assert fast.fused["ns"] is not None
        assert (fast.fused["ns"].kernel is not None) == (kernel == "fbgemm" and dim % 4 == 0)
        for _ in range(2):  # the second lookup sees the first push
            batch = _batch(data, tables, batch_size, weighted)
            out = fast.lookup("ns", batch)
            assert same(out, slow.lookup("ns", batch))
            grad = torch.randn_like(out)
            assert fast.push("ns", batch, grad) == slow.push("ns", batch, grad)
        a, b = fast.state_dict("ns"), slow.state_dict("ns")
        assert a.keys() == b.keys()
        for key in a:
            assert same(a[key]["weight"], b[key]["weight"]), key
            assert (a[key]["state"] is None) == (b[key]["state"] is None)
            if a[key]["state"] is not None:
                assert same(a[key]["state"], b[key]["state"]), key


def test_shards_are_views_of_the_stack_and_reloads_restack():
    tables = [TableSpec("a", 5, 2, ("fa",)), TableSpec("b", 4, 2, ("fb",))]
    srv = _server(tables, "table_wise", 1, 0)
    fused = srv.fused["ns"]
    assert fused is not None and fused.weight.shape == (9, 2)
    srv.shards["ns/b@0"].weight[1] = 7.0                       # write through the shard's view
    assert torch.equal(fused.weight[6], torch.full((2,), 7.0))
    state = srv.state_dict("ns")
    state["ns/a@0"]["weight"] = torch.arange(10.0).view(5, 2)
    srv.load_state_dict(state)
    batch = (("fa", "fb"), torch.tensor([4, 1]), torch.tensor([1, 1], dtype=torch.int32), None)
    assert srv.lookup("ns", batch).tolist() == [[8.0, 9.0, 7.0, 7.0]]


def test_mixed_dims_fall_back_to_the_per_shard_path():
    tables = [TableSpec("a", 5, 2, ("fa",)), TableSpec("b", 4, 3, ("fb",))]
    srv = _server(tables, "table_wise", 1, 0)
    assert srv.fused["ns"] is None
    batch = (("fa", "fb"), torch.tensor([4, 1]), torch.tensor([1, 1], dtype=torch.int32), None)
    assert srv.lookup("ns", batch).shape == (1, 5)


def test_stacked_path_names_bad_ids_and_missing_features():
    tables = [TableSpec("a", 5, 2, ("fa",)), TableSpec("b", 4, 2, ("fb",))]
    srv = _server(tables, "table_wise", 1, 0)
    bad = (("fa", "fb"), torch.tensor([4, 4]), torch.tensor([1, 1], dtype=torch.int32), None)
    with pytest.raises(ValueError, match=r"server ps0: feature 'fb' has id 4 outside table 'b' rows \[0, 4\)"):
        srv.lookup("ns", bad)
    with pytest.raises(ValueError, match="the batch has no feature 'fb'"):
        srv.lookup("ns", (("fa",), torch.tensor([1]), torch.tensor([1], dtype=torch.int32), None))


def test_build_refuses_a_feature_pooled_by_two_shards():
    a = plan_shards([TableSpec("a", 4, 2, ("f",)), TableSpec("b", 4, 2, ("g",))], 1)
    layout = [(a[0], "f"), (a[1], "f")]
    weights = {s.key: torch.zeros(4, 2) for s in a}
    assert FusedTables.build(layout, weights, {s.key: None for s in a}, threading.Lock()) is None
    assert FusedTables.build(server_layout(a, 0), weights, {s.key: None for s in a}, threading.Lock()) is not None


@pytest.mark.parametrize("mean", [False, True])
def test_client_pool_gather_equals_the_per_feature_path(mean):
    from torchrec import KeyedJaggedTensor

    from scheduling.ps import PSClient

    tables = [TableSpec("a", 9, 3, ("fa",), "mean" if mean else "sum"), TableSpec("b", 9, 3, ("fb", "fc")),
              TableSpec("c", 9, 3, ("fd",), "mean" if mean else "sum")]
    client = PSClient(tables, ["ps0", "ps1"], name="pool_gather", configure=False)
    try:
        kjt = KeyedJaggedTensor(keys=["fd", "fc", "fb", "fa"], values=torch.arange(9) % 9,
                                lengths=torch.tensor([2, 0, 1, 1, 0, 2, 1, 2], dtype=torch.int32))
        parts = [torch.randn(2, client.widths[s], requires_grad=True) for s in client.servers_for()]
        fast = client.pool(kjt, parts)
        assert client._gather is not False
        client._gather = False                                        # force the per-feature path
        slow = client.pool(kjt, parts)
        assert fast.keys() == slow.keys() and fast.length_per_key() == slow.length_per_key()
        assert torch.equal(fast.values(), slow.values())
        grad = torch.randn_like(fast.values())
        g_fast = torch.autograd.grad(fast.values(), parts, grad)
        g_slow = torch.autograd.grad(slow.values(), parts, grad)
        assert all(torch.equal(a, b) for a, b in zip(g_fast, g_slow))
    finally:
        client.close(flush=False)


def _copy(batch):
    """The batch as a new message delivers it: equal tensors, not the same objects."""
    keys, values, lengths, weights = batch
    return keys, values.clone(), lengths.clone(), None if weights is None else weights.clone()


def test_a_push_reuses_its_lookups_index_and_trains_the_same(monkeypatch):
    import scheduling.ps.fused as fused_module

    tables = [TableSpec("a", 6, 2, ("fa",)), TableSpec("b", 5, 2, ("fb", "fc"))]
    gen = torch.Generator().manual_seed(0)
    batches = [(("fa", "fb", "fc"), torch.randint(0, 5, (6,), generator=gen), torch.tensor([1, 1, 2, 0, 1, 1],
                dtype=torch.int32), w) for w in (None, torch.rand(6, generator=gen)) for _ in range(3)]
    runs = []
    for recent in (fused_module.RECENT_INDEXES, 0):   # with the recent indexes, and without (always resolved)
        monkeypatch.setattr(fused_module, "RECENT_INDEXES", recent)
        srv = _server(tables, "table_wise", 1, 0, optimizer="sgd")
        outs = []
        for batch in batches:
            outs.append(srv.lookup("ns", _copy(batch)))
            srv.push("ns", _copy(batch), torch.ones_like(outs[-1]))
        runs.append((outs, srv.fused["ns"].weight.clone(), srv.fused["ns"].index_hits))
    (outs, weight, hits), (outs0, weight0, hits0) = runs
    assert hits == len(batches) and hits0 == 0     # every push found its lookup's index
    assert all(torch.equal(a, b) for a, b in zip(outs, outs0)) and torch.equal(weight, weight0)


def test_only_an_equal_batch_reuses_an_index():
    tables = [TableSpec("a", 6, 2, ("fa",)), TableSpec("b", 5, 2, ("fb",))]
    fused = _server(tables, "table_wise", 1, 0).fused["ns"]
    keys, lengths = ("fa", "fb"), torch.tensor([1, 2, 1, 0], dtype=torch.int32)
    values = torch.tensor([1, 2, 3, 4])
    first = fused.index(keys, values, lengths, None, where="t")
    assert fused.index(keys, values.clone(), lengths.clone(), None, where="t") is first and fused.index_hits == 1
    # the same sums of ids and of lengths, other batches: resolved anew, and right
    for other_values, other_lengths, weights in [(torch.tensor([2, 1, 3, 4]), lengths, None),
                                                 (values, torch.tensor([2, 1, 0, 1], dtype=torch.int32), None),
                                                 (values, lengths, torch.ones(4))]:
        idx = fused.index(keys, other_values, other_lengths, weights, where="t")
        assert idx is not first and fused.index_hits == 1
    assert fused.index(keys, values, lengths, torch.full((4,), 2.0), where="t").weights.tolist() == [2.0] * 4
    bad = torch.tensor([1, 2, 3, 5])    # id 5 outside table b: raises every time, never kept
    for _ in range(2):
        with pytest.raises(ValueError, match="has id 5 outside table 'b'"):
            fused.index(keys, bad, lengths, None, where="t")


def test_a_batch_changed_in_place_is_resolved_anew():
    # servers in the trainers keep the sender's own tensors: a caller reusing them must not get the old index
    fused = _server([TableSpec("a", 6, 2, ("fa",))], "table_wise", 1, 0).fused["ns"]
    keys, lengths = ("fa",), torch.ones(2, dtype=torch.int32)
    values = torch.tensor([1, 4])
    first = fused.index(keys, values, lengths, None, where="t")
    values[0], values[1] = 4, 1     # the same sum of ids, other rows
    again = fused.index(keys, values, lengths, None, where="t")
    assert again is not first and fused.index_hits == 0
    assert torch.equal(again.rows, fused.index(keys, values.clone(), lengths, None, where="t").rows)


def test_recent_indexes_are_bounded():
    import scheduling.ps.fused as fused_module

    fused = _server([TableSpec("a", 100, 2, ("fa",))], "table_wise", 1, 0).fused["ns"]
    lengths = torch.ones(1, dtype=torch.int32)
    first = fused.index(("fa",), torch.tensor([0]), lengths, None, where="t")
    for i in range(1, fused_module.RECENT_INDEXES + 1):
        fused.index(("fa",), torch.tensor([i]), lengths, None, where="t")
    assert len(fused._recent) == fused_module.RECENT_INDEXES
    assert fused.index(("fa",), torch.tensor([0]), lengths, None, where="t") is not first   # pushed out


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_batches_of_known_lengths_reuse_their_structure_and_resolve_the_same(sharding):
    import scheduling.ps.fused as fused_module

    tables = [TableSpec("a", 7, 2, ("fa",)), TableSpec("b", 5, 2, ("fb",)), TableSpec("c", 6, 2, ("fc",))]
    gen = torch.Generator().manual_seed(0)
    for server in range(2):
        fast = _server(tables, sharding, 2, server, optimizer="sgd")
        slow = _server(tables, sharding, 2, server, optimizer="sgd", fused=False)
        fused = fast.fused["ns"]
        keys = ("fa", "fb", "fc", "other")    # a key of no table here: never a row
        for step in range(4):
            for dtype in (torch.int32, torch.long):   # equal lengths of another dtype: a structure of their own
                lengths = torch.tensor([1, 2, 0, 1, 1, 3, 2, 1], dtype=dtype)
                values = torch.cat([torch.randint(0, n, (int(k),), generator=gen)
                                    for n, k in zip([7, 5, 6, 99], lengths.view(4, 2).sum(1))])
                batch = (keys, values, lengths, torch.rand(values.numel(), generator=gen) if step % 2 else None)
                out = fast.lookup("ns", batch)
                assert torch.equal(out, slow.lookup("ns", batch))
                grad = torch.randn(out.shape, generator=gen)
                assert fast.push("ns", batch, grad) == slow.push("ns", batch, grad)
        assert [s.lengths.dtype for s in fused._structures[keys]] == [torch.long, torch.int32]
        for key, shard in fast.state_dict("ns").items():
            assert torch.equal(shard["weight"], slow.state_dict("ns")[key]["weight"]), key
        # a bad id in a batch of known lengths is still named (where this server pools its feature)
        lengths = torch.tensor([1, 2, 0, 1, 1, 3, 2, 1])
        values = torch.tensor([0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0])
        if "fb" in fused.features:
            with pytest.raises(ValueError, match=r"feature 'fb' has id 5 outside table 'b' rows \[0, 5\)"):
                fast.lookup("ns", (keys, values, lengths, None))
        else:
            assert torch.equal(fast.lookup("ns", (keys, values, lengths, None)),
                               slow.lookup("ns", (keys, values, lengths, None)))
        for i in range(fused_module.RECENT_STRUCTURES + 1):   # bounded per key tuple
            fused.index(keys, torch.zeros(i + 1, dtype=torch.long), torch.tensor([i + 1] + [0] * 7), None, where="t")
        assert len(fused._structures[keys]) == fused_module.RECENT_STRUCTURES


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(-(2**62), 2**62), max_size=300), spread=st.sampled_from([1, 3, 1000, None]))
def test_unique_inverse_is_torch_unique(ids, spread):
    """The NumPy-sorted distinct ids and inverse a push sums its gradients by are torch.unique's, bit for bit."""
    rows = torch.tensor([i % spread if spread else i for i in ids], dtype=torch.int64)
    want, want_inverse = torch.unique(rows, return_inverse=True)
    got, got_inverse = unique_inverse(rows)
    assert got.dtype == want.dtype and got_inverse.dtype == want_inverse.dtype
    assert torch.equal(got, want) and torch.equal(got_inverse, want_inverse)
    assert unique_count(rows) == want.numel()
    small = rows.remainder(1000).int()  # another dtype: torch.unique itself
    for got_t, want_t in zip(unique_inverse(small), torch.unique(small, return_inverse=True)):
        assert got_t.dtype == want_t.dtype and torch.equal(got_t, want_t)


def _bits(t):
    return t.contiguous().view(torch.int32)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), num_servers=st.integers(1, 2), sharding=st.sampled_from(["table_wise", "row_wise"]),
       optimizer=st.sampled_from(["rowwise_adagrad", "sgd"]), extra_key=st.booleans())
def test_one_id_per_bag_takes_the_bag_order_path_with_the_same_bits(data, num_servers, sharding, optimizer,
                                                                     extra_key):
    """One id in every bag (the common KJT of a recommendation model): the lookup gathers the rows in bag order
    (FusedIndex.order) instead of pooling into zeros, bit for bit the per-shard path, -0.0 included."""
    dim = data.draw(st.sampled_from([1, 4]))
    tables = [TableSpec(n, data.draw(st.integers(1, 6)), dim, (f"f{n}",)) for n in "abc"]
    batch_size = data.draw(st.integers(1, 5))
    keys = tuple(f"f{n}" for n in "abc") + (("other",) if extra_key else ())
    used = 0
    for server in range(num_servers):
        fast = _server(tables, sharding, num_servers, server, optimizer)
        slow = _server(tables, sharding, num_servers, server, optimizer, fused=False)
        if not fast.layouts["ns"]:
            continue
        for srv in (fast, slow):  # a stored -0.0: index_add_ into zeros turns it into 0.0, so must the bag path
            for shard in srv.shards.values():
                shard.weight[0, 0] = -0.0
        for _ in range(3):  # later lookups see the earlier pushes
            values = torch.tensor([data.draw(st.integers(0, t.num_embeddings - 1)) for t in tables
                                   for _ in range(batch_size)] + [0] * (batch_size if extra_key else 0))
            batch = (keys, values, torch.ones(len(keys) * batch_size, dtype=torch.int32), None)
            fused = fast.fused["ns"]
            used += fused.index(*batch, where="test").order is not None
            out = fast.lookup("ns", batch)
            assert torch.equal(_bits(out), _bits(slow.lookup("ns", batch)))
            grad = torch.randn_like(out)
            assert fast.push("ns", batch, grad) == slow.push("ns", batch, grad)
        a, b = fast.state_dict("ns"), slow.state_dict("ns")
        for key in a:
            assert torch.equal(_bits(a[key]["weight"]), _bits(b[key]["weight"])), key
    if sharding == "table_wise" or num_servers == 1:
        assert used  # the path under test ran
