"""Text timeline of the RPCs of a graph: which are in flight while each node runs.

One row per node, one column per RPC (in order of first appearance)::

    node                   | 0 1
    kjt                    |
    ps_lookup_start         | S
    ps_lookup_start_1       | | S
    bottom_0               | | |
    ps_lookup_wait          | W |
    ps_lookup_wait_1        |   W

``B`` marks a blocking RPC (start and wait in one node), ``S`` a start, ``|`` in flight, ``W`` its wait (or
defer), ``P`` the prefetch of the next step's lookup (in flight past the output). The footer counts the non-RPC nodes each RPC overlaps.
"""

from __future__ import annotations

from fxdist.graph import Graph
from fxdist.node import Node

from .async_pairs import pair_for

__all__ = ["format_timeline"]


def _start_of(node: Node) -> Node | None:
    """The start node a wait/defer node finishes, else None."""
    if "async_rpc" in node.meta and len(node.args) == 1 and isinstance(node.args[0], Node) \
            and "async_rpc" in node.args[0].meta:
        return node.args[0]
    return None


def format_timeline(graph: Graph, name_width: int = 28) -> str:
    """The timeline of ``graph``'s RPCs as text (see the module docstring)."""
    columns: dict[Node, int] = {}
    open_: set[int] = set()
    overlap: dict[int, int] = {}
    lines = [f"{'node':<{name_width}} | RPCs in flight"]
    for node in graph.nodes:
        marks: dict[int, str] = {c: "|" for c in open_}
        start = _start_of(node)
        if pair_for(node) is not None:
            col = columns.setdefault(node, len(columns))
            marks[col] = "B"
        elif "async_rpc_prefetch" in node.meta:
            col = columns.setdefault(node, len(columns))
            marks[col] = "P"
            open_.add(col)
            overlap[col] = 0
        elif start is not None and start in columns:
            col = columns[start]
            marks[col] = "W"
            open_.discard(col)
        elif "async_rpc" in node.meta:
            col = columns.setdefault(node, len(columns))
            marks[col] = "S"
            open_.add(col)
            overlap[col] = 0
        else:
            for c in open_:
                overlap[c] = overlap.get(c, 0) + (node.op not in ("placeholder", "output"))
        width = len(columns)
        row = " ".join(marks.get(c, " ") for c in range(width)).rstrip()
        lines.append(f"{node.name[:name_width]:<{name_width}} | {row}")
    lines.append(f"{len(columns)} RPCs; non-RPC nodes overlapped per RPC: "
                 + (", ".join(f"{c}:{overlap.get(c, 0)}" for c in range(len(columns))) or "none"))
    return "\n".join(lines)
