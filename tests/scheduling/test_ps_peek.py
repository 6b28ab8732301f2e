"""Read-only lookups (peeks): a dynamic table answers its rows without a step (no counting, admission, LRU refresh,
eviction or expiry), fixed tables answer as a lookup, peeks follow the request order, and evaluation interleaved
with training (prefetch included, both transports) leaves training bit for bit as without it."""

from __future__ import annotations

import functools

import pytest
import torch

from scheduling.ps.dynamic import DynamicSpec, DynamicTable
from scheduling.ps.endpoints import METHODS, ServerEndpoints
from scheduling.ps.peek import peek
from scheduling.ps.server import PSServer
from scheduling.ps.shard_plan import TableSpec, plan_shards

DYN = DynamicSpec(capacity=6, min_count=2, expire_steps=3)
TABLES = [TableSpec("fixed", 20, 4, ("fa",)), TableSpec("dyn", 6, 4, ("fb", "fc"), dynamic=DYN)]


def _server(tables=TABLES):
    srv = PSServer("ps0")
    srv.configure("ns", plan_shards(tables, 1), 0, "rowwise_adagrad", {"lr": 0.5}, seed=3)
    return srv


def _batch(step, batch_size=4, spread=12, keys=("fa", "fb", "fc"), weighted=False):
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (len(keys) * batch_size,), generator=gen)
    n = lengths.view(len(keys), batch_size).sum(1).tolist()
    fixed = torch.randint(0, 20, (n[0],), generator=gen)
    raw = torch.randint(0, spread, (sum(n[1:]),), generator=gen) * (1 << 40) + 12345   # raw 64-bit ids
    values = torch.cat([fixed, raw])
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return keys, values, lengths.int(), weights


def _train_step(srv, step):
    batch = _batch(step)
    out = srv.lookup("ns", batch)
    srv.push("ns", batch, torch.randn(out.shape, generator=torch.Generator().manual_seed(100 + step)))


def _dyn(srv) -> DynamicTable:
    table = srv.shards["ns/dyn@0"].dynamic
    assert table is not None
    return table


def _snapshot(table: DynamicTable):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in table.state_dict().items()}


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(
        (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]) for k in a)


def test_peek_is_the_request_every_transport_carries():
    assert "peek" in METHODS and "peek" in ServerEndpoints.ORDERED
    from scheduling.ps import server as srv_module

    assert callable(srv_module._rpc_peek)


def test_peek_answers_rows_of_and_changes_nothing():
    srv = _server()
    for step in range(6):
        _train_step(srv, step)
    table = _dyn(srv)
    before, stats = _snapshot(table), table.stats()
    assert stats["rows"] > 0 and stats["candidates"] > 0              # admitted rows and waiting candidates
    for step in range(20, 26):
        keys, values, lengths, weights = batch = _batch(step, spread=40, weighted=True)
        out = peek(srv, "ns", batch)
        n = lengths.view(3, -1).sum(1).tolist()
        raw, w = values[n[0]:], weights[n[0]:]
        bags = torch.repeat_interleave(torch.arange(8), lengths.view(3, -1)[1:].reshape(-1).long())
        pooled = torch.zeros(8, 4).index_add_(0, bags, table.rows_of(raw) * w.unsqueeze(1))
        assert torch.equal(out[:, 4:8], pooled[:4]) and torch.equal(out[:, 8:], pooled[4:]), step
        fixed = srv.shards["ns/fixed@0"]
        fixed_bags = torch.repeat_interleave(torch.arange(4), lengths[:4].long())
        want = torch.zeros(4, 4).index_add_(0, fixed_bags, fixed.store.gather(fixed.weight, values[:n[0]])
                                            * weights[:n[0]].unsqueeze(1))
        assert torch.equal(out[:, :4], want), step
    assert table.stats() == stats and _same(_snapshot(table), before)   # map, last_seen, candidates, step, rows


def test_peek_answers_zeros_for_ids_not_admitted():
    srv = _server()
    _train_step(srv, 0)
    keys = ("fa", "fb", "fc")
    unseen = torch.tensor([7, 1 << 60, 3 << 58, 5 << 57], dtype=torch.int64)  # raw ids never looked up
    batch = (keys, torch.cat([torch.tensor([1, 2]), unseen]), torch.tensor([1, 1, 2, 0, 1, 1], dtype=torch.int32),
             None)
    out = peek(srv, "ns", batch)
    assert torch.equal(out[:, 4:], torch.zeros(2, 8)) and out[:, :4].abs().sum() > 0
    assert int((_dyn(srv).slots_of(unseen) >= 0).sum()) == 0           # still not admitted, not even candidates
    assert _dyn(srv).stats()["candidates"] == _dyn(srv).stats()["candidates"]


def test_training_with_interleaved_peeks_is_bit_identical_to_training_alone():
    alone, peeked = _server(), _server()
    for step in range(12):
        _train_step(alone, step)
        _train_step(peeked, step)
        for extra in range(2):                       # held-out batches: other ids, some of them never trained
            peek(peeked, "ns", _batch(1000 + 3 * step + extra, spread=30))
    a, b = _dyn(alone), _dyn(peeked)
    assert a.stats()["evictions"] + a.stats()["expired"] > 0             # the rules were exercised
    assert a.stats() == b.stats() and _same(_snapshot(a), _snapshot(b))
    assert torch.equal(alone.shards["ns/fixed@0"].weight, peeked.shards["ns/fixed@0"].weight)
    assert alone.num_lookups == 12 and peeked.num_lookups == 12 + 24     # peeks are served lookups


def test_fixed_tables_peek_as_they_look_up():
    fixed_only = [TableSpec("a", 20, 4, ("fa",)), TableSpec("b", 30, 4, ("fb", "fc"))]
    srv = _server(fixed_only)
    assert srv.fused["ns"] is not None                                   # the fused path
    mixed = _server()
    for step in range(3):
        keys, values, lengths, _ = batch = _batch(step)
        small = (keys, values % 20, lengths, torch.rand(values.numel()))            # ids of the fixed tables
        assert torch.equal(peek(srv, "ns", small), srv.lookup("ns", small))
        assert torch.equal(peek(mixed, "ns", batch)[:, :4], mixed.lookup("ns", batch)[:, :4])  # the fixed table's
    with pytest.raises(ValueError, match="unknown compression"):
        peek(mixed, "ns", _batch(0), compress="int4")
    with pytest.raises(ValueError, match="no tables configured for client 'other'"):
        peek(mixed, "other", _batch(0))


def test_a_peek_waits_for_the_push_issued_before_it():
    """Sequence numbers: peek #1 arrives first and waits; push #0 then runs, and the peek sees it."""
    srv, ref = _server(), _server()
    for step in range(4):
        _train_step(srv, step)
        _train_step(ref, step)
    ends = ServerEndpoints(srv)
    batch, grad = _batch(4), torch.randn(4, 12, generator=torch.Generator().manual_seed(9))
    answers = {}
    ends.submit("peek", ("ns", batch, None, ("c", 1, 5.0)), lambda v, e: answers.__setitem__("peek", (v, e)))
    assert "peek" not in answers                                          # parked until push #0
    ends.submit("push", ("ns", batch, grad, ("c", 0, 5.0)), lambda v, e: answers.__setitem__("push", (v, e)))
    ref.push("ns", batch, grad)
    assert answers["push"][1] is None and answers["peek"][1] is None
    assert torch.equal(answers["peek"][0], peek(ref, "ns", batch))


def test_a_group_peek_waits_for_every_trainers_pushes_of_its_count():
    srv = _server()
    _train_step(srv, 0)
    ends, answers = ServerEndpoints(srv), {}
    batch = _batch(1)
    grad = torch.ones(4, 12)

    def order(rank, seq, count):
        return (f"c{rank}", seq, 5.0, ("g", rank, 2, count))

    ends.submit("push", ("ns", batch, grad, order(0, 0, 0)), lambda v, e: answers.__setitem__("p0", e))
    ends.submit("peek", ("ns", batch, None, order(0, 1, 1)), lambda v, e: answers.__setitem__("peek", v))
    assert "peek" not in answers and "p0" not in answers                  # trainer 1's push #0 is missing
    ends.submit("push", ("ns", batch, grad, order(1, 0, 0)), lambda v, e: answers.__setitem__("p1", e))
    assert answers["p0"] is None and answers["p1"] is None
    assert torch.equal(answers["peek"], peek(srv, "ns", batch))


# ---- through the pass and a cluster -----------------------------------------------------------------------------
class RawIds(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.t = torch.nn.Embedding(8, 4)                     # on the servers: dynamic, raw ids
        self.register_buffer("proj", torch.linspace(-1, 1, 4).unsqueeze(1))

    def forward(self, ids):
        return (self.t(ids) @ self.proj).squeeze(1)


def _ids(step, spread=9):
    gen = torch.Generator().manual_seed(step)
    return torch.randint(0, spread, (8,), generator=gen) * (1 << 50) + 3, torch.randn(8, generator=gen)


def _train(name, evaluate: bool, steps=8, max_staleness=None, flush=True):
    """Train ``RawIds`` with prefetch on a dynamic table; with ``evaluate``, after each step do what a job's
    mid-phase evaluation does: wait the pushes (``flush``), evaluate a held-out batch read-only, read the servers'
    state."""
    import fxdist
    import scheduling
    from scheduling import placement
    from scheduling.ps.client import get_client

    torch.manual_seed(0)
    ps = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=0.5, verbose=False, client=name,
                           dynamic={"t": {"capacity": 6, "min_count": 2, "expire_steps": 4}})
    prefetch = functools.partial(scheduling.async_rpc, prefetch=True, max_staleness=max_staleness)
    gm = fxdist.optimize(RawIds(), passes=(ps, prefetch))
    try:
        client = get_client(placement.client_names(gm)[0])
        nexts = [n.target for n in gm.graph.nodes if n.op == "placeholder" and n.target.startswith("next_")]
        losses, evals = [], []
        for (ids, target), nxt in scheduling.lookahead([_ids(s) for s in range(steps)]):
            loss = ((gm(ids, **{n: None if nxt is None else nxt[0] for n in nexts}) - target) ** 2).mean()
            loss.backward()
            losses.append(loss.detach())
            if evaluate:
                if flush:
                    placement.flush(gm)
                with torch.no_grad(), placement.read_only(gm):
                    evals.append(gm(_ids(500 + len(losses), spread=30)[0]))
                if flush:
                    client.server_states()
        placement.flush(gm)
        (state,) = client.server_states()
        return losses, next(iter(state.values()))["dynamic"], client.prefetch_hits, evals, dict(client.staleness)
    finally:
        placement.close(gm)


def _check_training_unchanged_by_evaluation(max_staleness=None, flush=True):
    alone = _train("peek-a", evaluate=False, max_staleness=max_staleness)
    evaluated = _train("peek-b", evaluate=True, max_staleness=max_staleness, flush=flush)
    assert alone[2] == evaluated[2] == 7                                  # every later step used its prefetch
    if not flush:                                                         # peeks wait no deferred push either
        assert alone[4] == evaluated[4] and len(alone[4]) > 1, alone[4]
    assert all(torch.equal(a, b) for a, b in zip(alone[0], evaluated[0]))
    assert _same(alone[1], evaluated[1]) and alone[1]["counters"]["evictions"] > 0
    assert any(bool((e == 0).any()) for e in evaluated[3]) and any(bool((e != 0).any()) for e in evaluated[3])


@pytest.mark.parametrize("max_staleness, flush", [(None, True), (1, False)])
def test_evaluation_between_prefetching_steps_leaves_training_unchanged(max_staleness, flush):
    from scheduling.ps import LocalCluster

    with LocalCluster(num_servers=1):
        _check_training_unchanged_by_evaluation(max_staleness, flush)


@pytest.mark.ray
def test_evaluation_leaves_training_unchanged_over_ray():
    pytest.importorskip("ray")
    from scheduling.ps import LocalCluster

    with LocalCluster(num_servers=1, transport="ray"):
        _check_training_unchanged_by_evaluation()


def test_read_only_client_refuses_pushes_and_sends_no_prefetch():
    from scheduling.ps import LocalCluster, PSClient

    with LocalCluster(num_servers=1) as cluster:
        client = PSClient([TableSpec("t", 10, 4, ("f",))], cluster.server_names, name="peek-ro", optimizer="sgd")
        try:
            from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

            kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1, 2, 3]), torch.tensor([1, 2]))
            with client.read_only():
                client.prefetch(0, kjt)
                assert client._prefetched == {}
                rows = client.lookup(0, kjt)
                with pytest.raises(RuntimeError, match="while read_only"):
                    client.push_grad_async(0, kjt, torch.ones(2, 4))
            assert torch.equal(rows, client.lookup(0, kjt))               # a fixed table: as a lookup
            assert client.prefetch_hits == 0 and client._read_only == 0
        finally:
            client.close()


@pytest.mark.parametrize("own_requests", ["inline", "thread"])
def test_read_only_lookups_of_a_server_in_the_trainers_process(own_requests):
    """A trainer's own requests to the server it hosts skip RPC (``scheduling.ps.in_trainers.call_local``): peeks
    go through the same ordered handlers."""
    from torchrec import KeyedJaggedTensor

    from scheduling.ps import PSClient, serve_in_trainer, stop_serving

    def kjt(ids):
        return KeyedJaggedTensor(keys=["f0"], values=torch.tensor(ids), lengths=torch.ones(len(ids), dtype=torch.long))

    server = serve_in_trainer("me-peek", own_requests=own_requests)
    try:
        client = PSClient([TableSpec("d", 4, 4, ("f0",), dynamic=DynamicSpec(4))], ["me-peek"], name="peek-own",
                          optimizer="sgd", optimizer_kwargs={"lr": 0.5})
        try:
            trained = client.lookup(0, kjt([5, 6])).detach()                  # admits 5 and 6
            (table,) = [s.dynamic for s in server.shards.values()]
            before = _snapshot(table)
            with client.read_only():
                peeked = client.lookup(0, kjt([6, 5, 7])).detach()
            assert torch.equal(peeked[:2], trained.flip(0)) and torch.equal(peeked[2], torch.zeros(4))
            assert trained.abs().sum() > 0 and _same(_snapshot(table), before)
        finally:
            client.close()
    finally:
        stop_serving()
