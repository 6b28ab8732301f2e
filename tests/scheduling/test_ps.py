"""The parameter-server runtime against 2 real servers on loopback, and training with/without async_rpc.

One group (2 server processes + this process as trainer) serves the whole module; each test uses its own
client name, hence its own tables on the servers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

import fxdist
import scheduling
from recsys.criteo import criteo_batches, criteo_dlrm, criteo_tables
from scheduling import placement
from scheduling.ps import LocalCluster, PSClient, PSEmbeddingBagCollection, get_client, ops
from tests.scheduling._graphs import before, order


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(2, timeout_s=30) as cl:
        yield cl


def _tables(mean: bool = True) -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=11, feature_names=["f0"]),
            EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=7, feature_names=["f1", "f2"],
                               pooling=PoolingType.MEAN if mean else PoolingType.SUM)]


def _kjt(weighted: bool = False) -> KeyedJaggedTensor:
    values = torch.tensor([1, 2, 10, 3, 4, 6, 0, 5, 5])
    lengths = torch.tensor([2, 1, 1, 2, 0, 3])
    weights = torch.tensor([0.5, 2.0, 1.0, 1.5, -1.0, 0.25, 1.0, 2.0, 3.0]) if weighted else None
    return KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=values, lengths=lengths, weights=weights)


def _torchrec_ebc(client: PSClient, weighted: bool) -> EmbeddingBagCollection:
    ebc = EmbeddingBagCollection(tables=_tables(mean=not weighted), is_weighted=weighted)
    sd = client.state_dict()
    ebc.load_state_dict({f"embedding_bags.{t}.weight": sd[f"{t}.weight"] for t in ("t0", "t1")})
    return ebc


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_lookup_matches_torchrec_ebc(cluster, sharding):
    client = PSClient(_tables(), cluster.server_names, sharding=sharding, name=f"lookup_{sharding}", seed=3)
    try:
        out = PSEmbeddingBagCollection(client)(_kjt())
        ref = _torchrec_ebc(client, weighted=False)(_kjt())
        assert out.keys() == ref.keys() == ["f0", "f1", "f2"]
        torch.testing.assert_close(out.values(), ref.values())
        if sharding == "row_wise":
            assert {sp.server for sp in client.shards if sp.table.name == "t0"} == {0, 1}
    finally:
        client.close()


def test_weighted_lookup_and_quantized_fetch(cluster):
    # torchrec's EBC has no weighted MEAN pooling, so the reference uses SUM tables
    exact = PSClient(_tables(mean=False), cluster.server_names, sharding="row_wise", name="weighted", seed=4)
    quant = PSClient(_tables(mean=False), cluster.server_names, sharding="row_wise", name="weighted_q", seed=4,
                     compress="fused8bit")
    try:
        kjt = _kjt(weighted=True)
        ours = PSEmbeddingBagCollection(exact)(kjt).values()
        torch.testing.assert_close(ours, _torchrec_ebc(exact, weighted=True)(kjt).values())
        approx = PSEmbeddingBagCollection(quant)(kjt).values()
        assert not torch.equal(approx, ours)                      # really went through 8-bit
        assert (approx - ours).abs().max() < 0.02                 # rows span ~0.6: 8-bit step ~2.5e-3
    finally:
        exact.close()
        quant.close()


def _one_sgd_step_reference(weight: torch.Tensor, ids, offsets, grad_out, lr):
    w = weight.clone().requires_grad_(True)
    out = torch.nn.functional.embedding_bag(ids, w, offsets, mode="sum")
    out.backward(grad_out)
    return (w - lr * w.grad).detach()


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_push_applies_the_optimizer_on_touched_rows(cluster, optimizer):
    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=9, feature_names=["f"])]
    client = PSClient(tables, cluster.server_names, sharding="row_wise", optimizer=optimizer,
                      optimizer_kwargs={"lr": 0.5}, name=f"push_{optimizer}", seed=5)
    try:
        kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 1, 7, 3]), lengths=torch.tensor([3, 1]))
        w0 = client.state_dict()["t.weight"]
        ebc = PSEmbeddingBagCollection(client)
        parts = ebc.lookup(kjt)
        grad_out = torch.tensor([[1.0, -2.0, 0.5, 3.0], [0.25, 0.0, -1.0, 2.0]])
        (ebc.pool(kjt, parts).values() * grad_out).sum().backward()
        assert ebc.push(kjt, parts) == [2, 1]                     # rows {1, 3} on ps0, {7} on ps1
        w1 = client.state_dict()["t.weight"]
        if optimizer == "sgd":
            expected = _one_sgd_step_reference(w0, kjt.values(), torch.tensor([0, 3]), grad_out, 0.5)
        else:
            g = torch.zeros_like(w0)
            g[1] = 2 * grad_out[0]; g[7] = grad_out[0]; g[3] = grad_out[1]  # noqa: E702
            acc = (g * g).mean(1)
            expected = w0 - 0.5 * g / (acc.sqrt() + 1e-8).unsqueeze(1)
            torch.testing.assert_close(client.state_dict()["t.momentum"], acc)
        torch.testing.assert_close(w1, expected)
        with pytest.raises(RuntimeError, match="already pushed"):
            ebc.push(kjt, parts)
        fresh = ebc.lookup(kjt)
        with pytest.raises(RuntimeError, match="backward"):
            ebc.push(kjt, fresh)
    finally:
        client.close()


def test_push_in_backward_hook_equals_explicit_push(cluster):
    a = PSClient(_tables(), cluster.server_names, optimizer="sgd", name="hook_a", seed=6)
    b = PSClient(_tables(), cluster.server_names, optimizer="sgd", name="hook_b", seed=6)
    try:
        kjt = _kjt()
        initial = a.state_dict()["t0.weight"]
        PSEmbeddingBagCollection(a, push_in_backward=True)(kjt).values().pow(2).sum().backward()
        ebc = PSEmbeddingBagCollection(b)
        parts = ebc.lookup(kjt)
        ebc.pool(kjt, parts).values().pow(2).sum().backward()
        ebc.push(kjt, parts)
        sa, sb = a.state_dict(), b.state_dict()
        assert not torch.equal(sa["t0.weight"], initial)
        for key in sa:
            torch.testing.assert_close(sa[key], sb[key])
    finally:
        a.close()
        b.close()


def test_state_dict_round_trip_and_checkpoint(cluster, tmp_path):
    client = PSClient(_tables(), cluster.server_names, sharding="row_wise", name="ckpt", seed=7)
    try:
        state = {k: v + 1.0 for k, v in client.state_dict().items()}
        client.load_state_dict(state)
        for key, value in client.state_dict().items():
            torch.testing.assert_close(value, state[key])
        paths = client.checkpoint(tmp_path)
        assert sorted(p.rsplit("/", 1)[1] for p in paths) == ["ps0.pt", "ps1.pt"]
        saved = torch.load(paths[0], weights_only=False)
        assert any(k.startswith("ckpt/t0@") for k in saved)
        with pytest.raises(KeyError, match="t1.weight"):
            client.load_state_dict({"t0.weight": state["t0.weight"]})
    finally:
        client.close()


def test_out_of_range_id_is_a_clear_error(cluster):
    client = PSClient(_tables(), cluster.server_names, name="badid")
    try:
        kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.tensor([11, 0, 0]),
                                lengths=torch.tensor([1, 1, 1]))
        with pytest.raises(ValueError, match=r"id 11 outside table 't0' rows \[0, 11\)"):
            PSEmbeddingBagCollection(client)(kjt)
    finally:
        client.close()


def test_lookups_with_max_staleness_count_the_pushes_left_in_flight(cluster):
    """``PSClient.staleness``: the deferred pushes to the server when a lookup is sent (what the trainers export as
    ``fxdist_ps_staleness_steps``); lookups without ``max_staleness`` are not counted."""
    client = PSClient(_tables(), cluster.server_names, name="staleness", seed=3)
    try:
        server = client.servers_for(["t0"])[0]
        out = client.finish_lookup(client.lookup_async(server, _kjt()), server)
        out.sum().backward()
        client.defer_push(server, client.push_async(server, _kjt(), out))
        client.finish_lookup(client.lookup_async(server, _kjt(), max_staleness=1), server)  # the push stays deferred
        client.finish_lookup(client.lookup_async(server, _kjt(), max_staleness=0), server)  # waited first
        client.finish_lookup(client.lookup_async(server, _kjt()), server)
        assert client.staleness == {1: 1, 0: 1}
    finally:
        client.close()


def _train(cluster, criteo_path, name: str, mode: str | None, steps: int = 4):
    """torchrec's DLRM with its 6 tables row-wise on the 2 servers (the ``parameter_servers`` pass, row-wise
    Adagrad), scheduled by ``async_rpc`` in ``mode``, trained as users write it (Adagrad on the dense part)."""
    torch.manual_seed(0)
    model = criteo_dlrm(50, 4, 6, dense_layers=(8, 4), over_layers=(8, 1))
    gm = scheduling.parameter_servers(model, "rowwise_adagrad", lr=0.1, client=name, verbose=False,
                                      plan={t.name: "row_wise" for t in criteo_tables(50, 4, 6)})
    client = get_client(placement.client_names(gm)[0])
    try:
        if mode == "exact":
            scheduling.async_rpc(gm)
        elif mode is not None and mode.startswith("stale"):
            scheduling.async_rpc(gm, max_staleness=int(mode[-1]))
        elif mode is not None and mode.startswith("prefetch"):
            scheduling.async_rpc(gm, prefetch=True, max_staleness=1 if mode == "prefetch_stale1" else None)
        opt = torch.optim.Adagrad(gm.parameters(), lr=0.05)
        batches = criteo_batches(criteo_path, 32, num_embeddings=50, num_tables=6, limit=32 * steps)
        lookups = sum(s["lookups"] for s in client.stats())
        losses = []
        for (dense, kjt, labels), nxt in scheduling.lookahead(batches):
            extra = {}
            if mode is not None and mode.startswith("prefetch"):
                extra["next_sparse_features"] = _next_kjt(nxt, copy=mode == "prefetch_other")
            loss = F.binary_cross_entropy_with_logits(gm(dense, kjt, **extra).squeeze(-1), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        client.flush()
        lookups = sum(s["lookups"] for s in client.stats()) - lookups
        with torch.no_grad():
            dense, kjt, _ = next(criteo_batches(criteo_path, 16, num_embeddings=50, num_tables=6, limit=16))
            logits = gm(dense, kjt)
        return (losses, placement.table_state_dict(gm), {k: v.clone() for k, v in gm.state_dict().items()}, logits,
                lookups)
    finally:
        placement.close(gm)


def _next_kjt(nxt, copy: bool):
    if nxt is None:
        return None
    kjt = nxt[1]
    if not copy:
        return kjt
    return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().clone(), lengths=kjt.lengths().clone())


def test_torchrec_dlrm_lookups_overlap_the_dense_arch(cluster):
    torch.manual_seed(0)
    gm = scheduling.parameter_servers(criteo_dlrm(50, 4, 6, dense_layers=(8, 4), over_layers=(8, 1)), "sgd",
                                      lr=0.1, client="schedule", verbose=False,
                                      plan={t.name: "row_wise" for t in criteo_tables(50, 4, 6)})
    try:
        g = gm.graph
        assert len(g.find_nodes(op="call_function", target=ops.ps_lookup)) == 2          # one per server
        assert len(g.find_nodes(op="call_function", target=ops.ps_push_in_backward)) == 2
        scheduling.async_rpc(gm)
        names = order(g)
        assert names[:4] == ["dense_features", "sparse_features", "ps_lookup_start", "ps_lookup_start_1"]
        assert before(g, "relu_1", "ps_lookup_wait")                   # the dense arch overlaps the lookups
        assert names.index("ps_pool") == names.index("ps_push_in_backward_1") + 1
        assert g.find_nodes(op="call_function", target=ops.ps_lookup) == []
        g.lint()
    finally:
        placement.close(gm)


def test_training_with_async_rpc_is_exactly_the_baseline(cluster, criteo_path):
    base = _train(cluster, criteo_path, "train_base", None)
    # stale1: pushes stay in flight into the next step; the servers order each client's requests, so the
    # next fetch still sees them and training stays exact
    # prefetch: each step's lookups start inside the previous step, after its pushes; prefetch_other: the
    # module is given a copy of the next batch, so each prefetched answer is dropped and fetched again
    for mode in ("exact", "stale0", "stale1", "prefetch", "prefetch_other"):
        other = _train(cluster, criteo_path, f"train_{mode}", mode)
        assert other[0] == base[0], mode                                 # same loss every step
        assert base[0][-1] < base[0][0]                                  # and it learns
        for key in base[1]:
            assert torch.equal(other[1][key], base[1][key]), (mode, key)  # same embeddings
        for key in base[2]:
            assert torch.equal(other[2][key], base[2][key]), (mode, key)  # same dense parameters
        assert torch.equal(other[3], base[3])                            # same forward outputs
        # each step looks up once per server (2 servers, 4 steps); dropped prefetches add 3 per server
        assert other[4] == base[4] + (6 if mode == "prefetch_other" else 0) == 8 + (6 if mode == "prefetch_other" else 0), mode


def test_stale_prefetch_misses_exactly_the_previous_push(cluster, criteo_path):
    base = _train(cluster, criteo_path, "stalepf_base", None)
    stale = _train(cluster, criteo_path, "stalepf", "prefetch_stale1")
    assert stale[0][0] == base[0][0]           # step 0 reads the initial tables either way
    assert stale[0][1] != base[0][1]           # step 1's lookup was sent before step 0's push
    assert stale[4] == base[4] == 8            # no extra lookups
    assert stale[0][-1] < stale[0][0]          # it still learns


def test_exact_prefetch_needs_an_ordered_client(cluster):
    client = PSClient(_tables(), cluster.server_names, name="unordered_pf", ordered=False)
    try:
        with pytest.raises(RuntimeError, match="exact prefetch needs ordered=True"):
            client.prefetch(0, _kjt())
        client.prefetch(0, _kjt(), max_staleness=1)   # allowed: the caller accepts one push of staleness
        client.flush()
    finally:
        client.close()


def test_push_carrying_the_next_lookup(cluster):
    client = PSClient(_tables(), cluster.server_names, optimizer="sgd", name="push_lookup", seed=8)
    ref = PSClient(_tables(), cluster.server_names, optimizer="sgd", name="push_lookup_ref", seed=8)
    try:
        kjt, nxt = _kjt(), _kjt(weighted=False)
        for c, carry in ((client, True), (ref, False)):
            part = c.lookup(0, kjt)
            part.sum().backward()
            fut = c.push_async(0, kjt, part, next_kjt=nxt if carry else None)
            if carry:
                assert c.settle_push(fut, 0) is None                 # left in flight with the lookup
            else:
                assert c.settle_push(fut, 0) > 0
        lookups = sum(s["lookups"] for s in client.stats())
        after_push = client.finish_lookup(client.lookup_async(0, nxt), 0)   # the carried answer
        assert sum(s["lookups"] for s in client.stats()) == lookups      # no new request
        assert torch.equal(after_push, ref.lookup(0, nxt))               # and it saw the push
        # a bad id in the carried lookup surfaces as the server's ValueError when that lookup is fetched
        bad = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.tensor([11, 0, 0]),
                                lengths=torch.tensor([1, 1, 1]))
        part = client.lookup(0, kjt)
        part.sum().backward()
        client.settle_push(client.push_async(0, kjt, part, next_kjt=bad), 0)
        with pytest.raises(ValueError, match="id 11 outside table 't0'"):
            client.finish_lookup(client.lookup_async(0, bad), 0)
    finally:
        client.close(flush=False)
        ref.close()


class _PushInBackwardModel(torch.nn.Module):
    """Pushes from backward hooks (as jobs/ does), so the graph holds the fetches but not the pushes."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.ebc = PSEmbeddingBagCollection(name)
        self.linear = torch.nn.Linear(10, 1)

    def forward(self, kjt):
        parts = self.ebc.lookup(kjt)
        parts = [ops.ps_push_in_backward(self.name, s, kjt, p) for s, p in zip(self.ebc.server_ids, parts)]
        return self.linear(self.ebc.pool(kjt, parts).values()).squeeze(-1)


def _train_with_hooks(cluster, name: str, prefetch: bool, steps: int = 4):
    client = PSClient(_tables(), cluster.server_names, optimizer="sgd", optimizer_kwargs={"lr": 0.2}, name=name,
                      seed=9)
    try:
        torch.manual_seed(0)
        model = _PushInBackwardModel(name)
        module = scheduling.async_rpc(fxdist.symbolic_trace(model), prefetch=True) if prefetch else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        batches = [KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.randint(0, 7, (9,), generator=gen),
                                     lengths=torch.tensor([2, 1, 1, 2, 0, 3])) for _ in range(steps)]
        lookups = sum(s["lookups"] for s in client.stats())
        losses = []
        for kjt, nxt in scheduling.lookahead(batches):
            out = module(kjt, next_kjt=nxt) if prefetch else module(kjt)
            loss = (out - 1.0).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        client.flush()
        return (losses, client.state_dict(), sum(s["lookups"] for s in client.stats()) - lookups, module,
                client.prefetch_hits)
    finally:
        client.close()


def test_prefetch_rides_on_pushes_made_in_backward_hooks(cluster):
    base = _train_with_hooks(cluster, "hooks_base", prefetch=False)
    fast = _train_with_hooks(cluster, "hooks_prefetch", prefetch=True)
    hooks = fast[3].graph.find_nodes(op="call_function", target=ops.ps_push_in_backward)
    assert len(hooks) == 2 and all(h.kwargs["next_kjt"].name == "next_kjt" for h in hooks)
    assert fast[0] == base[0] and base[0][-1] < base[0][0]        # same losses, and it learns
    for key in base[1]:
        assert torch.equal(fast[1][key], base[1][key]), key       # same tables
    assert fast[2] == base[2] == 8                                 # no extra lookups ...
    assert (fast[4], base[4]) == (6, 0)                            # ... and all but the first rode on a push


def test_a_push_from_backward_takes_the_lookups_grad_and_leaves_none_behind(cluster):
    """``ps_push_in_backward`` on a lookup's answer (a leaf) pushes what autograd stored in ``.grad`` (then drops it:
    no copy kept alive, none made for a push still being sent) and trains as an explicit push of that gradient."""
    hooked = PSClient(_tables(), cluster.server_names, optimizer="sgd", name="leaf_hook", seed=8)
    explicit = PSClient(_tables(), cluster.server_names, optimizer="sgd", name="leaf_explicit", seed=8)
    try:
        kjt, initial = _kjt(), hooked.state_dict()["t0.weight"]
        part = hooked.lookup(0, kjt)
        assert part.is_leaf and part.requires_grad
        ops.ps_push_in_backward("leaf_hook", 0, kjt, part).pow(2).sum().backward()
        assert part.grad is None
        hooked.flush()
        reference = explicit.lookup(0, kjt)
        reference.pow(2).sum().backward()
        explicit.push(0, kjt, reference)
        after, expected = hooked.state_dict(), explicit.state_dict()
        assert not torch.equal(after["t0.weight"], initial)
        assert all(torch.equal(after[k], expected[k]) for k in expected)
    finally:
        hooked.close()
        explicit.close()
