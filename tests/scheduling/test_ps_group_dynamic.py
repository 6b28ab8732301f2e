"""Several trainers sharing dynamic tables (:mod:`scheduling.ps.ordering`, rule 3): a lookup of a dynamic table is a
step of it (admission, LRU refresh, eviction, slot assignment), so the servers serve a group's lookups in ``(count,
index, rank)`` order; two runs whose requests arrive in opposite orders give the same tables, id maps, counters and
losses, equal to one process applying the lookups in rank order.

Trainers are threads sending the requests a ``PSClient(world_size=2)`` sends (its orders spelt out) to one server:
in this process (:class:`~scheduling.ps.endpoints.ServerEndpoints`) or a Ray actor (``PSActor``); the spawned
trainers of ``test_ps_group.py`` cover the clients themselves over ``torch_rpc``, with prefetch.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from typing import Any

import pytest
import torch

from scheduling.ps.dynamic import DynamicSpec
from scheduling.ps.endpoints import ServerEndpoints
from scheduling.ps.ordering import parked_requests
from scheduling.ps.server import PSServer
from scheduling.ps.shard_plan import TableSpec, plan_shards

WORLD, STEPS = 2, 6
TABLES = [TableSpec("fixed", 20, 4, ("fa",)),
          TableSpec("dyn", 5, 4, ("fb", "fc"), dynamic=DynamicSpec(capacity=5, min_count=1)),
          TableSpec("dyn2", 4, 2, ("fd",), dynamic=DynamicSpec(capacity=4, min_count=2, expire_steps=3))]
KEYS = ("fa", "fb", "fc", "fd")
WIDTH = 4 + 4 + 4 + 2


def _configure(srv: Any) -> None:
    srv.configure("ns", plan_shards(TABLES, 1), 0, "rowwise_adagrad", {"lr": 0.3}, seed=3)


def _batch(rank: int, step: int, index: int, batch_size: int = 4) -> tuple:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + index)
    lengths = torch.randint(0, 4, (len(KEYS) * batch_size,), generator=gen)
    n = lengths.view(len(KEYS), batch_size).sum(1).tolist()
    fixed = torch.randint(0, 20, (n[0],), generator=gen)
    raw = torch.randint(0, 12, (sum(n[1:]),), generator=gen) * (1 << 40) + 77     # raw 64-bit ids, shared by ranks
    return KEYS, torch.cat([fixed, raw]), lengths.int(), None


def _loss_and_grad(out: torch.Tensor, rank: int, step: int) -> tuple[float, torch.Tensor]:
    """A least-squares loss of the pooled rows ``(B, WIDTH)`` and its gradient (what backward would push)."""
    out = out.clone().requires_grad_(True)
    target = torch.linspace(-1, 1, out.shape[0]) * (rank + 1) + step
    loss = ((out.sum(1) - target) ** 2).mean()
    loss.backward()
    return loss.item(), out.grad / WORLD


class _Local:
    """Requests to a server in this process, blocking as the ``torch_rpc`` handlers answer them."""

    def __init__(self) -> None:
        self.srv = PSServer("ps0")
        _configure(self.srv)
        self.ends = ServerEndpoints(self.srv)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.ends, method)(*args)

    def state(self) -> dict[str, Any]:
        return self.srv.state_dict("ns")


class _Actor:
    """Requests to a Ray server actor (``PSActor``: the ``ray`` transport's asyncio endpoints)."""

    def __init__(self) -> None:
        import ray

        from scheduling.ps.transport.ray_transport import server_actor_class

        self.ray = ray
        self.actor = server_actor_class().remote("ps0")
        self.ray.get(self.actor.configure.remote("ns", plan_shards(TABLES, 1), 0, "rowwise_adagrad", {"lr": 0.3}, 3))

    def call(self, method: str, *args: Any) -> Any:
        return self.ray.get(getattr(self.actor, method).remote(*args), timeout=60)

    def state(self) -> dict[str, Any]:
        return self.ray.get(self.actor.state_dict.remote("ns"))


def _trainer(target: Any, rank: int, schedule: str, delay: Any, group: str, lookups: int, out: dict) -> None:
    """What trainer ``rank`` sends for ``STEPS`` steps: ``lookups`` lookups a step (``schedule="blocking"``: each
    waited before the push; ``"prefetch"``: the next step's first lookup rides on the push, ``push_lookup``;
    ``"stale"``: as ``max_staleness=1``, the next step's lookup leaves before this step's push), with
    ``delay(rank, step)`` seconds of sleep before each request. Each request carries the order a
    ``PSClient(world_size=2)`` gives it: its pushes before it (count) and, for a lookup, its lookups since then."""
    key, seq, count, since_push, losses = f"{group}-c{rank}", 0, 0, 0, []

    def order(lookup: bool) -> tuple:
        nonlocal seq, since_push
        seq += 1
        since_push += lookup
        return (key, seq - 1, 20.0, (group, rank, WORLD, count, since_push - 1 if lookup else None))

    answer = None
    for step in range(STEPS):
        grads = []
        for index in range(lookups):
            time.sleep(delay(rank, step))
            if answer is None:
                answer = target.call("lookup", "ns", _batch(rank, step, index), None, order(True))
            loss, grad = _loss_and_grad(answer, rank, step)
            losses.append(loss)
            grads.append(grad)
            answer = None
        time.sleep(delay(rank, step))
        if schedule == "stale" and step + 1 < STEPS:
            answer = target.call("lookup", "ns", _batch(rank, step + 1, 0), None, order(True))
        for index, grad in enumerate(grads):  # one push of the step's summed gradient per lookup's batch
            last = index == len(grads) - 1
            if schedule == "prefetch" and last and step + 1 < STEPS:
                count, since_push = count + 1, 0
                seq += 1
                _, answer = target.call("push_lookup", "ns", _batch(rank, step, index), grad, _batch(rank, step + 1, 0),
                                        None, (key, seq - 1, 20.0, (group, rank, WORLD, count - 1, 0)))
                since_push = 1
            else:
                target.call("push", "ns", _batch(rank, step, index), grad, order(False))
                count, since_push = count + 1, 0
    out[rank] = losses


def _run(target: Any, schedule: str, delay: Any, lookups: int = 1) -> tuple[dict[int, list[float]], dict[str, Any]]:
    group, losses = uuid.uuid4().hex, {}
    threads = [threading.Thread(target=_trainer, args=(target, r, schedule, delay, group, lookups, losses))
               for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(losses) == list(range(WORLD)), "a trainer thread failed"
    return losses, target.state()


def _reference(lookups: int = 1, stale: bool = False) -> tuple[dict[int, list[float]], dict[str, Any]]:
    """One process, no ordering: every trainer's lookups in (count, index, rank) order, each count's pushes after
    its lookups in rank order (``stale``: the step-``k + 1`` batch looked up before the step-``k`` push)."""
    events = []  # (sort key, kind, rank, (step, batch index))
    for rank in range(WORLD):
        for step in range(STEPS):
            count = lookups * step
            if not stale or step == 0:
                events += [((count, 0, i, rank), "lookup", rank, (step, i)) for i in range(lookups)]
            if stale and step + 1 < STEPS:
                events.append(((count, 0, int(step == 0), rank), "lookup", rank, (step + 1, 0)))
            events += [((count + i, 1, 0, rank), "push", rank, (step, i)) for i in range(lookups)]
    srv = PSServer("ref")
    _configure(srv)
    losses: dict[int, list[float]] = {r: [] for r in range(WORLD)}
    answers: dict[tuple[int, int, int], torch.Tensor] = {}
    for _, kind, rank, (step, i) in sorted(events, key=lambda e: e[0]):
        if kind == "lookup":
            answers[rank, step, i] = srv.lookup("ns", _batch(rank, step, i))
            continue
        loss, grad = _loss_and_grad(answers.pop((rank, step, i)), rank, step)
        losses[rank].append(loss)
        srv.push("ns", _batch(rank, step, i), grad)
    return losses, srv.state_dict("ns")


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def same(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        return bool(x == y)
    return a.keys() == b.keys() and all(same(a[k]["weight"], b[k]["weight"]) and same(a[k]["state"], b[k]["state"])
                                        and same(a[k]["dynamic"], b[k]["dynamic"]) for k in a)


def _rank_late(late: int, seconds: float = 0.03) -> Any:
    """Trainer ``late``'s requests arrive ``seconds`` after the other's (and a little random jitter)."""
    rng = random.Random(late)
    return lambda rank, step: (seconds if rank == late else 0.0) + rng.random() * 0.005


def _check(runs: list[tuple[dict, dict]], reference: tuple[dict, dict]) -> None:
    ref_losses, ref_state = reference
    assert ref_state["ns/dyn@0"]["dynamic"]["counters"]["evictions"] > 0         # small enough to evict
    assert ref_state["ns/dyn2@0"]["dynamic"]["counters"]["evictions"] > 0
    for losses, state in runs:
        assert losses == ref_losses
        assert _same_state(state, ref_state)


@pytest.mark.parametrize("schedule", ["blocking", "prefetch"])
def test_two_trainers_step_dynamic_tables_in_rank_order_whatever_arrives_first(schedule):
    runs = [_run(_Local(), schedule, _rank_late(late)) for late in (0, 1)]     # opposite arrival orders
    _check(runs, _reference())
    assert parked_requests() == 0


def test_several_lookups_per_step_are_served_in_count_index_rank_order():
    _check([_run(_Local(), "blocking", _rank_late(late), lookups=2) for late in (1, 0)], _reference(lookups=2))


def test_stale_lookups_sent_before_the_push_are_ordered_too():
    """As ``async_rpc(prefetch=True, max_staleness=1)``: the next step's lookup leaves before this step's push."""
    _check([_run(_Local(), "stale", _rank_late(late)) for late in (0, 1)], _reference(stale=True))


def test_dynamic_lookups_in_order_over_a_ray_actor(local_ray):
    _check([_run(_Actor(), schedule, _rank_late(late)) for schedule, late in (("prefetch", 0), ("blocking", 1))],
           _reference())


def _order(group: str, rank: int, seq: int, count: int, index: int | None, timeout_s: float = 5.0) -> tuple:
    return (f"{group}-c{rank}", seq, timeout_s, (group, rank, WORLD, count, index))


def test_a_lookup_waits_for_the_lower_ranks_lookup_and_times_out_naming_it():
    local, group = _Local(), uuid.uuid4().hex
    with pytest.raises(RuntimeError, match=r"server ps0: lookup \(count 0, index 0\) of rank 1 waited 0.3 s for "
                                           r"rank 0's lookup \(count 0, index 0\): every trainer .* same lookups"):
        local.call("lookup", "ns", _batch(1, 0, 0), None, _order(group, 1, 0, 0, 0, timeout_s=0.3))


def test_fixed_tables_and_peeks_do_not_wait_for_the_other_trainers_lookups():
    local, group = _Local(), uuid.uuid4().hex
    fixed = PSServer("ps1")
    fixed.configure("fx", plan_shards([TABLES[0]], 1), 0, "sgd", {"lr": 0.1}, seed=3)
    ends = ServerEndpoints(fixed)
    batch = (("fa",), torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1, 0], dtype=torch.int32), None)
    # rank 1's first lookup, before rank 0's: served at once where no dynamic table is (its index dropped)
    assert ends.lookup("fx", batch, None, _order(group + "f", 1, 0, 0, 0, timeout_s=0.3)).shape == (4, 4)
    # a peek of the dynamic tables carries no index either: rules 1 and 2 only
    assert local.call("peek", "ns", _batch(1, 0, 0), None, _order(group, 1, 0, 0, None, 0.3)).shape == (4, WIDTH)
    assert "ns" in local.srv.dynamic_namespaces and "fx" not in fixed.dynamic_namespaces


def test_dynamic_stats_request_answers_the_tables_counters_without_their_rows():
    local = _Local()
    for step in range(4):
        out = local.srv.lookup("ns", _batch(0, step, 0))
        local.srv.push("ns", _batch(0, step, 0), torch.ones_like(out))
    stats = local.call("dynamic_stats", "ns")
    assert sorted(stats) == ["dyn", "dyn2"]                                   # the fixed table left out
    for name in ("dyn", "dyn2"):
        table = local.srv.shards[f"ns/{name}@0"].dynamic
        assert table is not None and stats[name] == table.stats()
        assert stats[name]["rows"] == table.state_dict()["map_ids"].numel() > 0
    assert stats["dyn"]["evictions"] > 0 and local.call("dynamic_stats", "other") == {}
