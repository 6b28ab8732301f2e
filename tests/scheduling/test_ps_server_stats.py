"""A server's own statistics (:mod:`scheduling.ps.server_stats`), kept by the request handlers of both transports."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from scheduling.ps.dynamic import DynamicSpec
from scheduling.ps.endpoints import AsyncEndpoints, ServerEndpoints
from scheduling.ps.server import PSServer
from scheduling.ps.server_stats import ServerStats, table_stats
from scheduling.ps.shard_plan import TableSpec, plan_shards

NS = "fxdist-job-optimized:sparse.ebc"
TABLES = [TableSpec("fixed", 20, 4, ("fa",)),
          TableSpec("dyn", 10, 4, ("fb",), dynamic=DynamicSpec(capacity=3, min_count=1))]


def _server() -> PSServer:
    srv = PSServer("ps0")
    srv.configure(NS, plan_shards(TABLES, 1), 0, "rowwise_adagrad", {"lr": 0.5}, seed=3)
    return srv


def _batch(step: int):
    """Batch size 2, two features; the dynamic feature sees 4 new ids each step (capacity 3: evictions)."""
    fixed = torch.tensor([1, 2, 3])
    dyn = torch.arange(4) + 100 * step
    return ("fa", "fb"), torch.cat([fixed, dyn]), torch.tensor([2, 1, 2, 2]), None


def test_histogram_buckets_are_cumulative_with_le_bounds_and_inf():
    s = ServerStats(buckets=(0.001, 0.01))
    for seconds in (0.001, 0.005, 0.02):                        # on a bound counts in it ("le")
        s.observe("push", "ns", seconds)
    t = s.snapshot()["timings"][("push", "ns")]
    assert t["buckets"] == [(0.001, 1), (0.01, 2), (math.inf, 3)]
    assert t["count"] == 3 and t["sum"] == pytest.approx(0.026)
    assert s.snapshot()["timings"].keys() == {("push", "ns")}


@pytest.mark.parametrize("buckets", [(), (0.0, 1.0), (0.1, 0.1), (0.2, 0.1)])
def test_bad_buckets_are_refused(buckets):
    with pytest.raises(ValueError, match="increasing positive seconds"):
        ServerStats(buckets=buckets)


def test_track_counts_a_request_pending_until_its_answer_once():
    s, answers = ServerStats(), []
    finish = s.track(lambda value, error: answers.append(value))
    assert s.pending == 1
    finish(7, None)
    finish(8, None)                                             # a second report does not go below zero
    assert s.pending == 0 and answers == [7, 8]


def _check_after_requests(srv: PSServer, lookups: int, pushes: int) -> None:
    timings = srv.stats.snapshot()["timings"]
    assert timings[("lookup", NS)]["count"] == lookups and timings[("push", NS)]["count"] == pushes
    assert timings[("lookup", NS)]["sum"] > 0 and srv.stats.pending == 0


def test_torch_rpc_handlers_time_each_request_and_count_the_waiting_one_pending():
    """``ServerEndpoints.submit`` is what the ``torch_rpc`` server's ``async_execution`` handlers call."""
    srv = _server()
    ends = ServerEndpoints(srv)
    answers: dict[str, object] = {}

    def done(key):
        return lambda value, error: answers.setdefault(key, error if error is not None else value)

    grad = torch.ones(2, 8)
    ends.submit("push", (NS, _batch(0), grad, ("torch-rpc-client", 1, 10.0)), done("push"))  # #1 waits for #0
    assert srv.stats.pending == 1 and not answers
    ends.submit("lookup", (NS, _batch(0), None, ("torch-rpc-client", 0, 10.0)), done("lookup"))
    assert tuple(answers["lookup"].shape) == (2, 8) and isinstance(answers["push"], int)
    ends.submit_batch([("push_lookup", (NS, _batch(1), grad, _batch(2), None, ("torch-rpc-client", 2, 10.0)))], done("batch"))
    assert answers["batch"][0][1] is None
    _check_after_requests(srv, lookups=2, pushes=2)


def test_ray_actor_handlers_time_each_request_and_count_the_waiting_one_pending():
    """``AsyncEndpoints`` is the Ray actor's class (``PSActor``), awaited here in process."""
    srv = _server()
    ends = AsyncEndpoints(srv, num_worker_threads=2)

    async def run():
        grad = torch.ones(2, 8)
        push = asyncio.ensure_future(ends.push(NS, _batch(0), grad, ("ray-client", 1, 10.0)))
        for _ in range(50):                                    # the push reaches its wait (on the pool's thread)
            await asyncio.sleep(0.01)
            if srv.stats.pending == 1:
                break
        pending_while_waiting = srv.stats.pending
        out = await ends.lookup(NS, _batch(0), None, ("ray-client", 0, 10.0))
        return pending_while_waiting, out, await push, await ends.push_lookup(NS, _batch(1), grad, _batch(2),
                                                                              None, ("ray-client", 2, 10.0))

    pending, out, pushed, both = asyncio.run(run())
    assert pending == 1 and tuple(out.shape) == (2, 8) and isinstance(pushed, int) and tuple(both[1].shape) == (2, 8)
    _check_after_requests(srv, lookups=2, pushes=2)


def test_table_stats_per_table_with_the_dynamic_tables_counters():
    srv = _server()
    for step in range(3):
        out = srv.lookup(NS, _batch(step))
        srv.push(NS, _batch(step), torch.ones_like(out))
    stats = {t["table"]: t for t in table_stats(srv)}
    fixed, dyn = stats["fixed"], stats["dyn"]
    assert fixed["namespace"] == dyn["namespace"] == NS
    assert fixed["rows"] == 20 and not fixed["dynamic"] and fixed["inserts"] == fixed["evictions"] == 0
    assert fixed["bytes"] == 20 * 4 * 4 + 20 * 4                 # fp32 rows + row-wise Adagrad state
    counters = srv.shards[f"{NS}/dyn@0"].dynamic.stats()
    assert dyn["dynamic"] and dyn["rows"] == counters["rows"] == 3
    assert dyn["inserts"] == counters["inserts"] == 12 and dyn["evictions"] == counters["evictions"] > 0
    assert dyn["bytes"] == 3 * 4 * 4 + 3 * 4
