"""Pickling a ``Graph`` without recursion: nodes are saved as a flat list of specs whose Node
arguments are indices, so a 100k-node graph pickles as easily as a 3-node one (a naive pickle follows
``_next`` pointers and overflows the stack after ~1000 nodes).

Saved per node: name, op, target, args/kwargs (Nodes replaced by ``_NodeRef(index)``), type, meta and
any extra attributes set on the node (Nodes of this graph inside their plain lists/tuples/dicts are
replaced by references too). The graph's namespace is saved as its used names and counters,
so names made after unpickling continue exactly where they would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fxdist._namespace import Namespace
from fxdist.node import Node, map_aggregate, map_arg

if TYPE_CHECKING:
    from fxdist.graph import Graph

__all__ = ["graph_getstate", "graph_setstate"]

_NODE_FIELDS = frozenset({
    "graph", "_name", "_op", "_target", "type", "_input_nodes", "users", "_args", "_kwargs", "_prev",
    "_next", "_erased", "_sort_key", "_repr_fn", "meta"})
_REBUILT_GRAPH_FIELDS = frozenset({"_root", "_insert", "_find_nodes_lookup_table", "_graph_namespace", "_len"})


@dataclass(frozen=True)
class _NodeRef:
    index: int


def _swap_nodes(v: Any, fn: Any) -> Any:
    """``v`` with ``fn`` applied to each Node or _NodeRef inside plain lists, tuples and dicts (types kept);
    used on ``meta`` and extra node attributes, which passes fill with nodes (``meta["view_of"]``)."""
    if isinstance(v, (Node, _NodeRef)):
        return fn(v)
    t = type(v)
    if t is list or t is tuple:
        return t(_swap_nodes(x, fn) for x in v)
    if t is dict:
        return {k: _swap_nodes(x, fn) for k, x in v.items()}
    return v


def graph_getstate(graph: Graph) -> dict[str, Any]:
    """The picklable state of ``graph`` (see module docstring).

    Raises:
        RuntimeError: a node uses a node of another graph (the graph does not lint).
    """
    index = {n: i for i, n in enumerate(graph.nodes)}

    def ref(n: Node) -> _NodeRef:
        if n not in index:
            raise RuntimeError(f"cannot pickle graph: an argument %{n.name} is not a node of this graph; "
                               f"run graph.lint() to find the node using it")
        return _NodeRef(index[n])

    def soft_ref(n: Node) -> Any:  # in meta: a node of another graph is kept as it is
        return _NodeRef(index[n]) if n in index else n

    specs = [
        (n.name, n.op, n.target, map_arg(n.args, ref), map_arg(n.kwargs, ref), n.type,
         _swap_nodes(n.meta, soft_ref),
         _swap_nodes({k: v for k, v in n.__dict__.items() if k not in _NODE_FIELDS}, soft_ref))
        for n in graph.nodes
    ]
    state = {k: v for k, v in graph.__dict__.items() if k not in _REBUILT_GRAPH_FIELDS}
    ns = graph._graph_namespace
    state["_node_specs"] = specs
    state["_namespace_counts"] = (sorted(ns._used_names), dict(ns._base_count))
    return state


def graph_setstate(graph: Graph, state: dict[str, Any]) -> None:
    """Rebuild ``graph`` (freshly ``Graph.__init__``-ed: no owning module, so no hooks fire) in place
    from :func:`graph_getstate`'s output."""
    state = dict(state)
    specs = state.pop("_node_specs")
    used, counts = state.pop("_namespace_counts")
    owner = state.pop("_owning_module", None)
    graph.__dict__.update(state)
    nodes: list[Node] = []

    def deref(a: Any) -> Any:
        return nodes[a.index] if isinstance(a, _NodeRef) else a

    for name, op, target, args, kwargs, type_expr, _meta, _extra in specs:
        n = graph.create_node(op, target, map_aggregate(args, deref), map_aggregate(kwargs, deref),
                              name, type_expr)
        n.name = name
        nodes.append(n)
    for n, spec in zip(nodes, specs):  # meta may point at later nodes: restore it once all exist
        n.meta = _swap_nodes(spec[6], deref)
        n.__dict__.update(_swap_nodes(spec[7], deref))
    ns = Namespace()
    ns._used_names.update(used)
    ns._base_count.update(counts)
    for n in nodes:
        ns.associate_name_with_obj(n.name, n)
    graph._graph_namespace = ns
    graph._owning_module = owner
