"""Cross-step prefetch (:mod:`scheduling.prefetch`, ``async_rpc(prefetch=True)``) on hand-built graphs (no servers
needed): which lookups are prefetched, and how. Lookups computed from the inputs, against real servers:
test_prefetch_inputs.py."""

from __future__ import annotations

import operator

import pytest
import torch

import scheduling
from fxdist.graph import Graph
from scheduling.prefetch import PrefetchWarning
from scheduling.ps import ops
from tests.scheduling._graphs import before
from tests.scheduling._graphs import graph_module as _gm
from tests.scheduling._graphs import push_fetch_graph as _push_fetch_graph


def test_no_exact_prefetch_without_the_push_or_with_two_lookups_per_server(client):
    with pytest.warns(PrefetchWarning) as record:
        gm = scheduling.async_rpc(_gm(_push_fetch_graph()), prefetch=True)
    assert [str(w.message) for w in record] == [
        "async_rpc_prefetch: the lookup of client 'graph_ps' (batch %kjt) is not prefetched: its client reads that "
        "server 2 times a step (e.g. its module is called 2 times) and keeps one prefetched lookup per server "
        "(server 0); the graph pushes no gradient to its server (a frozen table, or pushes outside the graph), so "
        "nothing tells when an exact prefetch may start (max_staleness >= 1 prefetches anyway) (server 1); it keeps "
        "the in-step schedule"]
    g = gm.graph
    prefetches = g.find_nodes(op="call_function", target=ops.ps_prefetch)
    # server 0 is fetched twice in the step (one prefetch slot per server): not prefetched; server 1 is
    # never pushed to in the graph (its pushes may run outside it): prefetched only when staleness is allowed
    assert prefetches == []
    stale = scheduling.async_rpc(_gm(_push_fetch_graph()), prefetch=True, max_staleness=1).graph
    prefetches = stale.find_nodes(op="call_function", target=ops.ps_prefetch)
    assert [p.args[:2] for p in prefetches] == [("graph_ps", 1)]
    assert prefetches[0].prev.name == "ps_lookup_start_2" and prefetches[0].kwargs["after"].name == "ps_lookup_start_2"


def _train_step_graph(client_name: str) -> Graph:
    g = Graph()
    kjt, x = g.placeholder("kjt"), g.placeholder("x")
    parts = [g.call_function(ops.ps_lookup, (client_name, s, kjt)) for s in (0, 1)]
    loss = g.call_function(torch.sum, (g.call_function(operator.mul, (parts[0], parts[1])),))
    done = g.call_function(ops.ps_backward, (loss,))
    for s in (0, 1):
        g.call_function(ops.ps_push, (client_name, s, kjt, parts[s], done))
    g.call_function(torch.relu, (x,), name="bottom_backward")
    g.output(done)
    return g


def test_exact_prefetch_rides_on_the_push_and_stale_prefetch_follows_the_lookup(client):
    gm = scheduling.async_rpc(_gm(_train_step_graph("graph_ps")), prefetch=True)
    g = gm.graph
    assert [n.name for n in g.nodes if n.op == "placeholder"] == ["kjt", "x", "next_kjt"]
    nxt = g.find_nodes(op="placeholder")[-1]
    assert nxt.args == (None,) and "next_kjt = None" in gm.code     # an optional input
    pushes = g.find_nodes(op="call_function", target=ops.ps_push_start)
    assert [p.kwargs.get("next_kjt") for p in pushes] == [nxt, nxt]  # each push asks for the next lookup
    assert g.find_nodes(op="call_function", target=ops.ps_prefetch) == []
    settles = g.find_nodes(op="call_function", target=ops.ps_push_settle)
    assert [s.args[0] for s in settles] == pushes                   # not waited at the step's end
    assert before(g, "ps_push_start_1", "bottom_backward")
    stale = scheduling.async_rpc(_gm(_train_step_graph("graph_ps")), prefetch=True, max_staleness=1).graph
    pf = stale.find_nodes(op="call_function", target=ops.ps_prefetch)
    assert [p.prev.target for p in pf] == [ops.ps_lookup_start, ops.ps_lookup_start]
    assert all(p.kwargs["max_staleness"] == 1 for p in pf)
    assert all("next_kjt" not in p.kwargs for p in stale.find_nodes(op="call_function", target=ops.ps_push_start))
    assert "P" in scheduling.format_timeline(stale).split("ps_prefetch ")[1].splitlines()[0]


def test_prefetch_without_a_push_is_warned_and_varargs_refused(client):
    g = Graph()
    x, ids = g.placeholder("x"), g.placeholder("ids")
    key = g.call_function(operator.add, (ids, 1))   # computed from an input: prefetchable, but nothing pushes
    g.output(g.call_function(operator.mul, (g.call_function(ops.ps_lookup, ("graph_ps", 0, key)), x)))
    with pytest.warns(PrefetchWarning, match=r"the lookup of client 'graph_ps' \(batch %add\) is not prefetched: "
                      r"the graph pushes no gradient to its server .*\(server 0\)"):
        gm = scheduling.async_rpc(_gm(g), prefetch=True)
    assert gm.graph.find_nodes(op="call_function", target=ops.ps_prefetch) == []
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["x", "ids"]
    v = Graph()
    kjt, rest = v.placeholder("kjt"), v.placeholder("*rest")
    v.output((v.call_function(ops.ps_lookup, ("graph_ps", 0, kjt)), rest))
    with pytest.raises(ValueError, match=r"\*args/\*\*kwargs input"):
        scheduling.async_rpc(_gm(v), prefetch=True)
