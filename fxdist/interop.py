"""Conversion between fxdist and torch.fx GraphModules: ``from_torch_fx`` and ``to_torch_fx``.

The only module under ``fxdist/`` that imports ``torch.fx`` (docs/CONTRACTS.md). Both directions copy
the node list one node at a time, keeping opcode, target, the structure of args/kwargs, node name,
type annotation and a shallow copy of ``meta``; the new GraphModule *shares* the submodules,
parameters and buffers of the old one (no tensor is copied), so a model can go to torch.compile or
torch.ao and come back.

Limits: graphs whose torch.fx code generator is not the plain ``CodeGen`` (``_PyTreeCodeGen`` from
``concrete_args``/pytree inputs, ``_BoxedCodeGen``) are refused with a ValueError, because fxdist
would generate a different ``forward`` signature. A node name that one side reserves and the other
does not is renamed by the receiving graph's namespace (e.g. torch.fx allows ``operator``).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch.fx
from torch import nn

from fxdist.graph import Graph
from fxdist.graph_module import GraphModule
from fxdist.node import Node

__all__ = ["from_torch_fx", "to_torch_fx"]


def _map(a: Any, fn: Callable[[Any], Any], kind: type) -> Any:
    """Rebuild tuples/lists/dicts/slices of an argument, applying ``fn`` to each ``kind`` leaf."""
    if isinstance(a, kind):
        return fn(a)
    if isinstance(a, tuple):
        items = [_map(x, fn, kind) for x in a]
        return type(a)(*items) if hasattr(type(a), "_fields") else tuple(items)
    if isinstance(a, list):
        return [_map(x, fn, kind) for x in a]
    if isinstance(a, dict):
        return {k: _map(v, fn, kind) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(_map(a.start, fn, kind), _map(a.stop, fn, kind), _map(a.step, fn, kind))
    return a


def _copy_nodes(src_nodes: Any, dst_graph: Any, src_kind: type) -> None:
    """Append a copy of every node of ``src_nodes`` to ``dst_graph`` (either library's Graph)."""
    env: dict[Any, Any] = {}

    def lookup(n: Any) -> Any:
        try:
            return env[n]
        except KeyError:
            raise RuntimeError(f"node {n.name!r} is used before it is defined (or belongs to another graph); "
                               "run graph.lint() on the source graph") from None

    for node in src_nodes:
        new = dst_graph.create_node(node.op, node.target, _map(node.args, lookup, src_kind),
                                    _map(node.kwargs, lookup, src_kind), name=node.name, type_expr=node.type)
        new.meta = copy.copy(node.meta)
        env[node] = new


def from_torch_fx(gm: torch.fx.GraphModule) -> GraphModule:
    """Convert a torch.fx GraphModule into an fxdist one that shares its submodules and parameters.

    Args:
        gm: a ``torch.fx.GraphModule`` (e.g. from ``torch.fx.symbolic_trace``).

    Returns:
        An fxdist ``GraphModule`` with the same nodes (op, target, args, names, types, meta), the
        same class name and a copy of ``gm.meta``.

    Raises:
        TypeError: ``gm`` is not a torch.fx GraphModule.
        ValueError: ``gm.graph`` uses a non-default code generator (pytree/boxed calling convention).
    """
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(f"from_torch_fx expects a torch.fx.GraphModule, got {type(gm).__name__}")
    codegen = gm.graph._codegen
    if type(codegen) is not torch.fx.graph.CodeGen:
        raise ValueError(f"from_torch_fx: {gm.__class__.__name__}'s graph uses {type(codegen).__name__} (a pytree or "
                         "boxed calling convention), which fxdist does not generate; trace without concrete_args "
                         "/ pytree inputs")
    graph = Graph()
    _copy_nodes(gm.graph.nodes, graph, torch.fx.Node)
    result = GraphModule(gm, graph, class_name=gm.__class__.__name__)
    result.meta = dict(getattr(gm, "meta", {}))
    return result


def to_torch_fx(gm: GraphModule) -> torch.fx.GraphModule:
    """Convert an fxdist GraphModule into a torch.fx one that shares its submodules and parameters.

    The result can be given to ``torch.compile``, ``torch.ao`` or any torch.fx pass.

    Args:
        gm: an fxdist ``GraphModule``.

    Returns:
        A ``torch.fx.GraphModule`` with the same nodes, class name and a copy of ``gm.meta``.

    Raises:
        TypeError: ``gm`` is not an fxdist GraphModule.
    """
    if not isinstance(gm, GraphModule):
        raise TypeError(f"to_torch_fx expects an fxdist GraphModule, got {type(gm).__name__}")
    graph = torch.fx.Graph()
    _copy_nodes(gm.graph.nodes, graph, Node)
    root: nn.Module = gm
    result = torch.fx.GraphModule(root, graph, class_name=type(gm).__name__)
    result.meta = dict(gm.meta)
    return result
