"""``Graph.lint``: the well-formedness checks of torch.fx's ``Graph.lint`` (torch/fx/graph.py), with errors that
name the node and a fix.

Source: torch/fx/graph.py ``Graph.lint``. Each error is a ``RuntimeError`` whose message reads
``Graph.lint: %add_1 (call_function[target=operator.add]) <what is wrong>. <how to fix it>`` and keeps
torch.fx's key phrase (e.g. "was used before it has been defined"), plus a note showing the printed
graph with the offending node marked ``>>>``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from fxdist.node import Node

if TYPE_CHECKING:
    from fxdist.graph import Graph

__all__ = ["lint_graph"]


def _describe(node: Node) -> str:
    try:
        target = Node._pretty_print_target(node.target)
    except Exception:
        target = repr(node.target)
    return f"%{node.name} ({node.op}[target={target}])"


def _marked_graph(graph: Graph, culprit: Node) -> str:
    lines = ["graph with the offending node marked:"]
    for n in graph.nodes:
        try:
            text = n.format_node()
        except Exception:
            text = f"%{n.name} : {n.op}[target={n.target!r}]"
        lines.append(("  >>> " if n is culprit else "      ") + str(text))
    return "\n".join(lines)


def _fail(graph: Graph, node: Node, what: str, fix: str) -> RuntimeError:
    err = RuntimeError(f"Graph.lint: {_describe(node)} {what}. {fix}")
    err.add_note(_marked_graph(graph, node))
    return err


def _check_node(graph: Graph, node: Node, legal_ops: Any, seen: set[Node], seen_names: set[str]) -> None:
    if node.op not in legal_ops or node.op == "root":
        raise _fail(graph, node, f"had unknown opcode {node.op!r}",
                    f"Set node.op to one of {[o for o in legal_ops if o != 'root']}.")
    if node.graph is not graph:
        raise _fail(graph, node, "does not belong to this Graph (its .graph is another Graph)",
                    "Nodes cannot be shared; copy it with graph.node_copy(node, arg_transform=...).")
    _check_target_type(graph, node)
    if node not in graph._find_nodes_lookup_table:
        raise _fail(graph, node, "is not added to the side table used by find_nodes",
                    "Create nodes with Graph.create_node() (or its helpers) instead of Node(...).")
    _check_arg_structure(graph, node)
    for arg in node._input_nodes:
        if arg.graph is not graph:
            raise _fail(graph, node, f"uses %{arg}, which belongs to another graph (it does not belong to "
                        f"this Graph)", "If you copied nodes from another graph, pass arg_transform= to "
                        "node_copy() to remap its inputs.")
        if arg._erased:
            raise _fail(graph, node, f"uses %{arg}, which was erased from the graph",
                        f"Point {node.name} at a live node first (node.replace_input_with(old, new)).")
        if arg not in seen:
            raise _fail(graph, node, f"uses %{arg} before it is defined (Argument '{arg}' was used before it "
                        f"has been defined)", f"Keep nodes topologically ordered: move %{node} after "
                        f"%{arg} (e.g. {arg}.append({node})) or insert %{arg} earlier.")
    seen.add(node)
    if node.name in seen_names:
        raise _fail(graph, node, f"reuses a name: Node redefined name {node.name}",
                    "Names must be unique; create nodes through the Graph API, or node._rename(new_name).")
    seen_names.add(node.name)


def _check_target_type(graph: Graph, node: Node) -> None:
    if node.op == "call_function":
        if not callable(node.target):
            raise _fail(graph, node, f"has target {node.target!r} of type {torch.typename(node.target)} but a "
                        "Callable is expected", "Use a function object as a call_function target.")
    elif not isinstance(node.target, str):
        raise _fail(graph, node, f"has target {node.target!r} of type {torch.typename(node.target)} but a "
                    "str is expected", f"A {node.op} target is a name or dotted path string.")


def _check_arg_structure(graph: Graph, node: Node) -> None:
    if not isinstance(node.args, tuple):
        raise _fail(graph, node, f"has args of type {type(node.args).__name__}, not a tuple",
                    "Assign node.args = tuple(...).")
    if not isinstance(node.kwargs, dict) or not all(isinstance(k, str) for k in node.kwargs):
        raise _fail(graph, node, "has kwargs that are not a dict with str keys", "Assign node.kwargs = {...}.")
    found: dict[Node, None] = {}
    _collect_nodes(node.args, found)
    _collect_nodes(node.kwargs, found)
    if list(found) != list(node._input_nodes):
        raise _fail(graph, node, f"has stale use-def data: all_input_nodes={list(node._input_nodes)} but its "
                    f"args/kwargs hold {list(found)}", "Never set node._args/_kwargs directly; assign "
                    "node.args/node.kwargs.")
    for arg in found:
        if node not in arg.users:
            raise _fail(graph, node, f"uses %{arg} but is missing from {arg}.users",
                        "Never edit node.users directly; assign node.args/node.kwargs.")
    for user in node.users:
        if node not in user._input_nodes:
            raise _fail(graph, node, f"lists %{user} as a user, but %{user} does not use it",
                        "Never edit node.users directly; assign node.args/node.kwargs.")


def _collect_nodes(a: Any, found: dict[Node, None]) -> None:
    """Record every Node inside ``a`` (same traversal as ``map_aggregate``), in order, without copying."""
    if isinstance(a, Node):
        found[a] = None
    elif isinstance(a, (tuple, list)):
        for x in a:
            _collect_nodes(x, found)
    elif isinstance(a, dict):
        for x in a.values():
            _collect_nodes(x, found)
    elif isinstance(a, slice):
        for x in (a.start, a.stop, a.step):
            _collect_nodes(x, found)


def _check_targets_exist(graph: Graph, root: Any) -> None:
    for node in graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        atoms = cast(str, node.target).split(".")
        obj = root
        for i, atom in enumerate(atoms):
            nxt = getattr(obj, atom, None)
            seen_qualname = ".".join(atoms[:i]) or "the root module"
            if nxt is None:
                raise _fail(graph, node, f"target {node.target} references nonexistent attribute {atom} of "
                            f"{seen_qualname}", "Add it to the owning module (add_submodule, register_buffer, "
                            "register_parameter) or fix the target path.")
            if node.op == "call_module" and not isinstance(nxt, torch.nn.Module):
                raise _fail(graph, node, f"target {node.target}: {atom} of {seen_qualname} does not reference "
                            "an nn.Module", "call_module targets must be submodules; use get_attr + "
                            "call_function for other callables.")
            obj = nxt


def lint_graph(graph: Graph, legal_ops: Any) -> None:
    """Run every check on ``graph``; raise the first fault found (see module docstring)."""
    seen: set[Node] = set()
    seen_names: set[str] = set()
    for node in graph.nodes:
        _check_node(graph, node, legal_ops, seen, seen_names)
    if graph.owning_module is not None:
        _check_targets_exist(graph, graph.owning_module)
