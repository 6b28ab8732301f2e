"""Common subexpression elimination over a graph's connectivity: ``CSEPass`` and ``get_CSE_banned_ops``.

Two ``call_function`` (or ``call_method`` / ``call_module``) nodes with the same target and the same
arguments, once each argument Node is replaced by the node that already stands for it, compute the same
value; the later one is dropped and its users read the earlier one. Placeholders, ``get_attr`` and
``output`` nodes are copied unchanged, and so are nodes whose target (or the ATen overload packet of their
target) is banned: random and in-place operators, since two calls of those are not interchangeable.
The pass builds a new Graph; when nothing was merged it returns the module it was given, unmodified.

>>> import torch, fxdist
>>> from fxdist.passes.dialect.common.cse_pass import CSEPass
>>> gm = fxdist.symbolic_trace(lambda x: x.cos() + x.cos())
>>> result = CSEPass()(gm)
>>> result.modified, [n.name for n in result.graph_module.graph.nodes]
(True, ['x', 'cos', 'add', 'output'])

Sources: torch.fx's ``passes/dialect/common/cse_pass.py`` (same names, arguments, banned list and result:
``PassResult(graph_module, modified)``); fxdist's own ``PassBase`` (a frozen dataclass) carries it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.utils._pytree as pytree

from fxdist.graph import Graph
from fxdist.graph_module import GraphModule
from fxdist.node import Node
from fxdist.passes.pass_base import PassBase, PassResult

__all__ = ["CSEPass", "get_CSE_banned_ops"]

_aten = torch.ops.aten
_RANDOM = ("dropout", "_fused_dropout", "_standard_gamma", "bernoulli", "multinomial", "native_dropout",
           "normal", "poisson", "binomial", "rrelu", "rand_like", "rand", "randint", "randn", "randperm")
_INPLACE = ("add_", "sub_", "mul_", "div_", "pow_", "lerp_", "relu_", "sigmoid_", "tanh_")
_COPIED_OPS = ("placeholder", "get_attr", "output")


def get_CSE_banned_ops() -> set[Any]:  # noqa: N802 -- torch.fx's name
    """The ATen overload packets ``CSEPass`` must not merge: random operators and the in-place arithmetic ones.

    Returns:
        A new set of ``torch.ops.aten`` packets (``aten.rand_like``, ``aten.add_``, ...).

    Raises:
        AttributeError: only if this torch build lacks one of the listed ATen operators.
    """
    return {getattr(_aten, name) for name in _RANDOM + _INPLACE}


def _packet(node: Node) -> Any:
    """The node's target, or its ATen overload packet (``aten.add`` for ``aten.add.Tensor``)."""
    return getattr(node.target, "overloadpacket", node.target)


def _key(node: Node, env: dict[Node, Node]) -> tuple[Any, Any] | None:
    """(hashable key, full token) of a node's call with its arguments remapped; None when unhashable."""
    flat_args, args_spec = pytree.tree_flatten(node.args)
    flat_kwargs, kwargs_spec = pytree.tree_flatten(node.kwargs)
    args = tuple(env.get(a, a) if isinstance(a, Node) else a for a in flat_args)
    kwargs = tuple(env.get(a, a) if isinstance(a, Node) else a for a in flat_kwargs)
    try:
        key = (node.op, node.target, hash((args, kwargs)))
    except TypeError:  # a leaf that cannot be hashed (a slice on Python < 3.12, a list...): never merged
        return None
    return key, (node.op, node.target, args, args_spec, kwargs, kwargs_spec)


@dataclass(frozen=True)
class CSEPass(PassBase):
    """Merge repeated pure calls (same target, same remapped arguments) into the first one.

    Args:
        banned_ops: targets or ATen overload packets never merged (``get_CSE_banned_ops()`` for the
            random and in-place ATen operators). ``None``: nothing is banned; only safe on functional graphs.

    Raises:
        KeyError: from ``call``, if the graph uses a node before defining it (a graph that fails ``lint``).
    """

    name: ClassVar[str] = "cse"
    banned_ops: Any = None

    def call(self, gm: GraphModule) -> PassResult:
        """Return ``PassResult(new_module, True)`` with duplicates merged, or ``(gm, False)`` when there were none.

        Raises:
            KeyError: if a node reads a value no earlier node defines.
        """
        banned = self.banned_ops or ()
        new_graph = Graph()
        env: dict[Node, Node] = {}
        seen: dict[Any, tuple[Any, Node]] = {}
        modified = False
        for node in gm.graph.nodes:
            keyed = None if node.op in _COPIED_OPS or _packet(node) in banned else _key(node, env)
            if keyed is not None and keyed[0] in seen and seen[keyed[0]][0] == keyed[1]:
                env[node] = seen[keyed[0]][1]
                modified = True
                continue
            env[node] = new_graph.node_copy(node, lambda a: env[a])
            if keyed is not None and keyed[0] not in seen:
                seen[keyed[0]] = (keyed[1], env[node])
        if not modified:
            return PassResult(gm, False)
        return PassResult(GraphModule(gm, new_graph), True)
