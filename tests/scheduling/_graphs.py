"""Helpers for the scheduling tests: clients that need no servers, graph order queries, a hand-built step."""

from __future__ import annotations

import operator

import torch

from fxdist.graph import Graph
from fxdist.graph_module import GraphModule
from scheduling.ps import PSClient, ops
from scheduling.ps.shard_plan import TableSpec


def offline_client(name: str, num_servers: int = 2, sharding: str = "table_wise") -> PSClient:
    """A registered client whose servers are never contacted (for tracing and graph tests)."""
    tables = [TableSpec(f"t{i}", 20, 4, (f"f{i}",)) for i in range(2)]
    return PSClient(tables, [f"ps{i}" for i in range(num_servers)], sharding=sharding, name=name,
                    configure=False)


def order(graph: Graph) -> list[str]:
    """Node names in graph order."""
    return [n.name for n in graph.nodes]


def before(graph: Graph, a: str, b: str) -> bool:
    """Whether node ``a`` comes before node ``b``."""
    names = order(graph)
    return names.index(a) < names.index(b)


def graph_module(graph: Graph) -> GraphModule:
    """The graph in a module with no submodules."""
    return GraphModule(torch.nn.Module(), graph)


def push_fetch_graph() -> Graph:
    """A step of client ``graph_ps``: a lookup on server 0, its push, a second lookup on 0 and one on 1."""
    g = Graph()
    kjt, x = g.placeholder("kjt"), g.placeholder("x")
    f0 = g.call_function(ops.ps_lookup, ("graph_ps", 0, kjt))
    loss = g.call_function(torch.sum, (g.call_function(operator.mul, (f0, x)),))
    done = g.call_function(ops.ps_backward, (loss,))
    g.call_function(ops.ps_push, ("graph_ps", 0, kjt, f0, done))
    g.call_function(torch.relu, (x,), name="dense_work")
    again = g.call_function(ops.ps_lookup, ("graph_ps", 0, kjt))     # same server: must see the push
    other = g.call_function(ops.ps_lookup, ("graph_ps", 1, kjt))     # other server: independent
    g.output((again, other, done))
    return g
