"""Finding the embedding modules of a traced model, and deciding which can move to parameter servers.

:func:`find_embeddings` is the matcher of :func:`scheduling.parameter_servers`: it returns the movable modules
(each with every ``call_module`` node calling it) and, for every other embedding module, why it stays local.
A module moves only as a whole: if one of its calls cannot move, none does (a table lives in one place).

Rules, one check each (:data:`CHECKS`), in the order they are tried::

    nn.EmbeddingBag(mode="max")        -> local: the servers pool by sum or mean
    max_norm set                       -> local: renormalises looked-up rows in place, on the trainer
    scale_grad_by_freq                 -> local: scales gradients by in-batch frequency; the servers do not
    nn.Embedding padding row not zero  -> local: the servers return zeros for padding ids
    weights not float32                -> local: the servers hold float32 tables initialised from them
                                          (meta weights move: the servers initialise those tables)
    EBC tables the servers reject      -> local: e.g. a feature read by two tables (the error of table_specs)
    frozen and trainable tables mixed  -> local: one client pushes gradients for all its tables or none
    a weight also read elsewhere       -> local: a get_attr node or another module shares the Parameter
    output modified in place           -> local: the in-place op would act on the remote lookup's result
    arguments the module cannot take   -> local: the call does not bind to the module's forward

Embedding modules inside another leaf module (called as one node) are reported too: they cannot be reached.

Source: torch.fx paper §6 (matchers that return None for "no match"). Matchers are pure.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxdist.graph_module import GraphModule
from fxdist.node import Node
from recsys.embedding import embedding_kind

EmbeddingModule = Any
"""An embedding module: torchrec's ``EmbeddingBagCollection`` / ``EmbeddingCollection`` (untyped) or
``nn.EmbeddingBag`` / ``nn.Embedding``; which attributes it has depends on its kind (``Candidate.kind``)."""

__all__ = ["Candidate", "NotMoved", "find_embeddings", "inplace_user", "is_inplace", "call_arguments"]


@dataclass
class Candidate:
    """A movable embedding module and the nodes calling it."""

    qualname: str
    """Its path in the traced module."""
    module: EmbeddingModule
    """The module."""
    kind: str
    """See :func:`recsys.embedding.embedding_kind`."""
    nodes: list[Node]
    """Every ``call_module`` node calling it, in graph order."""


@dataclass(frozen=True)
class NotMoved:
    """An embedding module that stays on the trainer, and why."""

    module: str
    """Qualified name of the module."""
    type: str
    """Its class name."""
    nodes: tuple[str, ...]
    """Names of the nodes calling it (or of the leaf module hiding it)."""
    reason: str
    """Why it cannot move."""

    def message(self) -> str:
        """One line for warnings: ``<module> (<type>, node %<n>): <reason>``."""
        nodes = ", ".join(f"%{n}" for n in self.nodes)
        return f"{self.module} ({self.type}, {'node' if len(self.nodes) == 1 else 'nodes'} {nodes}): {self.reason}"


_INPLACE_FUNCTIONS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem}
_VIEWS = {"values", "to_dict", "view", "reshape", "narrow", "select", "split", "chunk", "unbind", "squeeze",
          "unsqueeze", "transpose", "permute", "flatten", "t", "expand", "view_as", "__getitem__"}


def is_inplace(node: Node, modules: dict[str, nn.Module]) -> bool:
    """Whether ``node`` modifies its first argument in place (``x.add_(1)``, ``operator.iadd``, a module or
    call with ``inplace=True``)."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if node.op == "call_module":
        return bool(getattr(modules.get(str(node.target)), "inplace", False))
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_function" and node.target in _INPLACE_FUNCTIONS:
        return True
    return node.op in ("call_method", "call_function") and name.endswith("_") and not name.startswith("_")


def inplace_user(node: Node, modules: dict[str, nn.Module]) -> Node | None:
    """The first node modifying ``node``'s value (or a view of it, a KeyedTensor's values) in place, or None."""
    for user in node.users:
        if user.args and user.args[0] is node and is_inplace(user, modules):
            return user
        view = (user.op == "call_method" and user.target in _VIEWS) or (
            user.op == "call_function" and user.target in (operator.getitem, torch.split, torch.chunk))
        if view and user.args and user.args[0] is node:
            found = inplace_user(user, modules)
            if found is not None:
                return found
    return None


def call_arguments(m: nn.Module, node: Node) -> list[Any]:
    """The arguments of ``node``'s call of ``m``, bound to ``m.forward``'s parameters, defaults filled in, in
    the signature's order.

    Raises:
        TypeError: the call does not bind (:func:`find_embeddings` leaves such modules local).
    """
    bound = inspect.signature(m.forward).bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return list(bound.arguments.values())


def _weights(kind: str, m: EmbeddingModule) -> list[torch.Tensor]:
    if kind == "ebc":
        return [m.embedding_bags[c.name].weight for c in m.embedding_bag_configs()]
    if kind == "ec":
        return [m.embeddings[c.name].weight for c in m.embedding_configs()]
    return [m.weight]


def _module_options(kind: str, m: EmbeddingModule) -> str | None:
    if kind == "bag" and m.mode == "max":
        return "mode='max' pooling: the parameter servers pool by sum or mean"
    if kind in ("bag", "embedding") and m.max_norm is not None:
        return (f"max_norm={m.max_norm} renormalises the looked-up rows in place on the trainer; the parameter "
                "servers cannot honour it")
    if kind in ("bag", "embedding") and m.scale_grad_by_freq:
        return "scale_grad_by_freq scales gradients by in-batch id frequency; the servers' optimizer does not"
    if (kind == "embedding" and m.padding_idx is not None and not m.weight.is_meta
            and bool(m.weight[m.padding_idx].detach().any())):
        return (f"padding_idx={m.padding_idx} and row {m.padding_idx} is not zero: the servers return a zero row "
                "for padding ids (zero that row to move it)")
    return None


def _tables(kind: str, m: EmbeddingModule) -> str | None:
    weights = _weights(kind, m)
    for w in weights:  # meta weights are fine: the servers initialise those tables (parameter_servers' seed)
        if w.dtype != torch.float32:
            return f"its weights are of dtype {w.dtype}; the servers hold float32 tables initialised from them"
    if kind in ("ebc", "ec"):
        from ..ps.shard_plan import table_specs

        try:
            table_specs(m.embedding_bag_configs() if kind == "ebc" else m.embedding_configs())
        except ValueError as e:
            return f"the servers cannot hold its tables: {e}"
    if len({w.requires_grad for w in weights}) > 1:
        return "it mixes frozen and trainable tables (one client pushes gradients for all its tables or none)"
    return None


def _shared(qualname: str, m: nn.Module, nodes: list[Node], gm: GraphModule) -> str | None:
    mine = {id(p) for p in m.parameters()}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target).startswith(qualname + "."):
            return f"its weight is also read directly by %{node.name} (get_attr {node.target})"
    for name, p in gm.named_parameters(remove_duplicate=False):
        if id(p) in mine and not name.startswith(qualname + "."):
            return f"its weight is shared with {name}, which stays on the trainer"
    return None


def _calls(qualname: str, m: nn.Module, nodes: list[Node], modules: dict[str, nn.Module]) -> str | None:
    sig = inspect.signature(m.forward)
    for node in nodes:
        try:
            sig.bind(*node.args, **node.kwargs)
        except TypeError as e:
            return f"the call %{node.name} does not bind to {type(m).__name__}.forward: {e}"
        user = inplace_user(node, modules)
        if user is not None:
            return (f"its output (%{node.name}) is modified in place by %{user.name} ({user.op} {user.target}); "
                    "the in-place op would act on the remote lookup's result; use the out-of-place op")
    return None


CHECKS: list[Callable[..., str | None]] = [
    lambda q, kind, m, nodes, gm, modules: _module_options(kind, m),
    lambda q, kind, m, nodes, gm, modules: _tables(kind, m),
    lambda q, kind, m, nodes, gm, modules: _shared(q, m, nodes, gm),
    lambda q, kind, m, nodes, gm, modules: _calls(q, m, nodes, modules),
]
"""Each ``check(qualname, kind, module, nodes, gm, modules) -> reason | None`` (None: no objection)."""


def find_embeddings(gm: Any) -> tuple[list[Candidate], list[NotMoved]]:
    """The embedding modules ``gm`` calls: those that can move, and those that stay local with the reason.

    Args:
        gm: a GraphModule traced with embedding modules as leaves (see ``EmbeddingLeafTracer``).

    Returns:
        ``(candidates, not_moved)``, each in order of the module's first call in the graph.
    """
    modules = dict(gm.named_modules())
    calls: dict[str, list[Node]] = {}
    hidden: list[NotMoved] = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        m = modules.get(str(node.target))
        if m is not None and embedding_kind(m) is not None:
            calls.setdefault(str(node.target), []).append(node)
        elif m is not None:
            for sub, inner in m.named_modules(prefix=str(node.target)):
                if sub != node.target and embedding_kind(inner) is not None:
                    hidden.append(NotMoved(sub, type(inner).__name__, (node.name,),
                                           f"it is inside leaf module {node.target} ({type(m).__name__}), which "
                                           "the graph calls as one node; trace through that module to move it"))
    found, kept = [], []
    for qualname, nodes in calls.items():
        m = modules[qualname]
        kind = embedding_kind(m)
        assert kind is not None
        reason = next((r for check in CHECKS if (r := check(qualname, kind, m, nodes, gm, modules))), None)
        if reason is None:
            found.append(Candidate(qualname, m, kind, nodes))
        else:
            kept.append(NotMoved(qualname, type(m).__name__, tuple(n.name for n in nodes), reason))
    return found, kept + hidden
