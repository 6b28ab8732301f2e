"""Helpers for the scheduling tests: clients that need no servers, graph order queries."""

from __future__ import annotations

from fxdist.graph import Graph

from scheduling.ps import PSClient
from scheduling.ps.config import TableSpec


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
