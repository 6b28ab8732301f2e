"""The async_rpc pass (:mod:`scheduling.async_rpc_pass`) on hand-built and traced graphs (no servers needed);
its ``prefetch=True`` schedule is in test_prefetch.py."""

from __future__ import annotations

import io
import operator

import pytest
import torch
import torch.distributed.rpc as rpc

import fxdist
import scheduling
from fxdist.graph import Graph
from scheduling.async_rpc_pass import AsyncRPC
from scheduling.ps import ops
from tests.scheduling._graphs import before, order
from tests.scheduling._graphs import graph_module as _gm
from tests.scheduling._graphs import push_fetch_graph as _push_fetch_graph


def test_two_fetches_start_at_top_and_wait_before_first_user(client):
    g = Graph()
    kjt, x = g.placeholder("kjt"), g.placeholder("x")
    f0 = g.call_function(ops.ps_lookup, ("graph_ps", 0, kjt))
    f1 = g.call_function(ops.ps_lookup, ("graph_ps", 1, kjt))
    h = g.call_function(torch.relu, (x,))
    h = g.call_function(torch.tanh, (h,))
    a = g.call_function(operator.add, (f0, h))
    g.output(g.call_function(operator.add, (a, f1)))
    gm = scheduling.async_rpc(_gm(g))
    assert order(gm.graph) == ["kjt", "x", "ps_lookup_start", "ps_lookup_start_1", "relu", "tanh",
                               "ps_lookup_wait", "add", "ps_lookup_wait_1", "add_1", "output"]
    assert gm.graph.find_nodes(op="call_function", target=ops.ps_lookup) == []
    wait = next(n for n in gm.graph.nodes if n.name == "ps_lookup_wait")
    assert wait.target is ops.ps_lookup_wait and wait.args[0].target is ops.ps_lookup_start
    assert "ps_lookup_start('graph_ps', 0, kjt)" in gm.code.replace("scheduling_ps_ops_", "")


def test_fetch_whose_input_depends_on_dense_compute(client):
    g = Graph()
    x, ids = g.placeholder("x"), g.placeholder("ids")
    h = g.call_function(torch.relu, (x,))
    key = g.call_function(operator.add, (ids, 1))           # the request is computed
    h2 = g.call_function(torch.tanh, (h,))
    h3 = g.call_function(torch.sigmoid, (h2,))
    f = g.call_function(ops.ps_lookup, ("graph_ps", 0, key))
    g.output(g.call_function(operator.mul, (f, h3)))
    gm = scheduling.async_rpc(_gm(g))
    names = order(gm.graph)
    assert names.index("ps_lookup_start") == names.index("add") + 1   # right after its input
    assert names.index("ps_lookup_wait") == names.index("mul") - 1    # right before its user
    assert before(gm.graph, "ps_lookup_start", "tanh") and before(gm.graph, "sigmoid", "ps_lookup_wait")


def test_push_is_waited_before_a_conflicting_fetch(client):
    gm = scheduling.async_rpc(_gm(_push_fetch_graph()))
    g = gm.graph
    assert before(g, "ps_backward", "ps_push_start")
    assert order(g).index("ps_push_start") == order(g).index("ps_backward") + 1
    # the conflicting fetch starts as soon as the push is done, and overlaps the dense work
    assert order(g).index("ps_lookup_start_1") == order(g).index("ps_push_wait") + 1
    assert before(g, "ps_lookup_start_1", "dense_work") and before(g, "dense_work", "ps_lookup_wait_1")
    # the fetch from the other server is independent of the push: hoisted to the top
    assert order(g).index("ps_lookup_start_2") == order(g).index("ps_lookup_start") + 1


def test_max_staleness_defers_pushes_and_bounds_fetches(client):
    gm = scheduling.async_rpc(_gm(_push_fetch_graph()), max_staleness=1)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.ps_push_defer in targets and ops.ps_push_wait not in targets
    starts = gm.graph.find_nodes(op="call_function", target=ops.ps_lookup_start)
    assert [n.kwargs["max_staleness"] for n in starts] == [1, 1, 1]
    with pytest.raises(ValueError, match="max_staleness"):
        scheduling.async_rpc(_gm(_push_fetch_graph()), max_staleness=-1)


def test_plain_rpc_sync_becomes_rpc_async_and_wait():
    g = Graph()
    x = g.placeholder("x")
    r0 = g.call_function(rpc.rpc_sync, ("w0", torch.add, (x, 1)))
    r1 = g.call_function(rpc.rpc_sync, ("w1", torch.add, (x, 2)))
    y = g.call_function(torch.relu, (x,))
    g.output(g.call_function(operator.add, (g.call_function(operator.add, (r0, r1)), y)))
    gm = scheduling.async_rpc(_gm(g))
    assert order(gm.graph) == ["x", "rpc_async", "rpc_async_1", "relu", "rpc_wait", "rpc_wait_1", "add",
                               "add_1", "output"]
    assert all(n.target is rpc.rpc_async for n in gm.graph.find_nodes(op="call_function", target=rpc.rpc_async))


def test_waits_and_pushes_survive_dead_code_elimination(client):
    gm = scheduling.async_rpc(_gm(_push_fetch_graph()))
    gm.graph.eliminate_dead_code()
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(ops.ps_push_start) == 1 and targets.count(ops.ps_push_wait) == 1
    assert targets.count(ops.ps_lookup_start) == 3


def test_verbose_prints_tables_and_timelines(client):
    buf = io.StringIO()
    scheduling.async_rpc(_gm(_push_fetch_graph()), verbose=True, file=buf)
    text = buf.getvalue()
    assert "== before async_rpc ==" in text and "== after async_rpc ==" in text
    assert "opcode" in text and "ps_push_start" in text
    before_part, after_part = text.split("== after async_rpc ==")
    assert "| B" in before_part and "| S" in after_part and "W" in after_part


def test_pass_object_reports_modification(client):
    result = AsyncRPC()(_gm(_push_fetch_graph()))
    assert result.modified
    assert AsyncRPC.name == "async-rpc"
    g = Graph()
    g.output(g.call_function(torch.relu, (g.placeholder("x"),)))
    assert not AsyncRPC()(_gm(g)).modified


def test_leaves_trace_as_single_impure_nodes(client):
    from scheduling.ps import PSEmbeddingBagCollection

    gm = fxdist.symbolic_trace(PSEmbeddingBagCollection("graph_ps"))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [ops.ps_lookup, ops.ps_lookup, ops.ps_pool]
    assert calls[0].is_impure() and not calls[2].is_impure()
