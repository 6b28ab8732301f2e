"""Lookups whose ids are computed from the graph's inputs: which ones :mod:`scheduling.prefetch` can start a
step early, why the others cannot, and the module that replays the computation on the next batch's inputs.

A lookup's batch (the ``KeyedJaggedTensor`` a ``ps_lookup`` reads) is often computed in ``forward``: one
``(B, F)`` id tensor sliced per feature (``ids[:, j]``), cast (``.long()``), reshaped (``.view(-1)``), or a
``KeyedJaggedTensor.from_lengths_sync(...)`` built from it. When every node from the graph's inputs
(placeholders) to that batch is side-effect free, the batch is a function of the inputs alone, and the
next step's batch is the same function of the next step's inputs::

    %ids = placeholder[ids]; %next_ids = placeholder[next_ids](default None)
    %prefetch_sync = call_module[prefetch_sync](%ids)                       # this step's batch
    %prefetch_sync_1 = call_module[prefetch_sync](%next_ids, next_batch=True)  # the next step's

The submodule (:class:`BatchReplay`) holds that function as a GraphModule (the nodes copied from the graph)
and returns the same object for the same input objects (not modified in place since, same ``_version``): the
client matches a prefetched lookup with the next step's by identity (``PSClient.lookup_async``), so the batch
this step builds from ``next_ids`` must be the very object the next step's lookup reads.

Not a function of the inputs alone (see :func:`input_reason`): a batch depending on a parameter (``get_attr``),
on a buffer that the graph may update (one of a module the graph calls, e.g. running statistics, or one modified
in place), on a module's output (``call_module``), on a random op, on an impure call (an RPC's answer, an
in-place op), or on a value that an impure call may modify in place. Constants count as part of the function:
tensors the trace stored (``torch.arange(20)`` in ``forward`` becomes ``get_attr _tensor_constant0``), buffers
the graph does not update, and calls on no input at all; a batch of constants only (positions
``torch.arange(L)``) is the same every step, so it is looked up ahead too. A buffer changed between steps
(outside the graph) is noticed: :class:`BatchReplay` computes the batch again when a constant's values changed.

Source: torch.fx paper §6.2.3 (move each start as early as its inputs allow); torchrec
``TrainPipelineSparseDist`` (the next batch's input distribution runs during this batch).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from fxdist.graph import Graph
from fxdist.graph_module import GraphModule
from fxdist.node import Node, is_random_op

from .ps import ops

__all__ = ["BatchReplay", "chain_of", "input_reason", "replay_module"]

_KEEP = 4  # this step's batch, the next one, and slack
_RANDOM_METHODS = frozenset({"bernoulli", "bernoulli_", "multinomial", "normal_", "uniform_", "random_",
                             "exponential_", "geometric_", "cauchy_", "log_normal_"})


def _stamp(objects: tuple[Any, ...], constants: tuple[torch.Tensor, ...] = ()) -> tuple[Any, ...]:
    return (tuple((weakref.ref(o), getattr(o, "_version", None)) for o in objects),
            tuple((c, c._version, c.detach().clone()) for c in constants))


def _same(stamp: tuple[Any, ...], objects: tuple[Any, ...], constants: tuple[torch.Tensor, ...] = ()) -> bool:
    """The same input objects, not modified since; the same constants' values (a constant written in place with
    the same values, e.g. DDP's broadcast of the buffers, still matches)."""
    inputs, consts = stamp
    return (all(ref() is o and getattr(o, "_version", None) == version for (ref, version), o in zip(inputs, objects))
            and all(c is now and (c._version == version or torch.equal(copy, now))
                    for (c, version, copy), now in zip(consts, constants)))


class BatchReplay(nn.Module):
    """A lookup's batch as a function of graph inputs: ``forward(*inputs)`` -> the batch.

    Shapes: whatever the copied nodes take and give (typically ids ``(B, F)`` in, a ``KeyedJaggedTensor`` out).

    The last few results are kept: the same input objects, not modified in place since (same ``_version``),
    give the same output object. ``next_batch=True`` (the call on the ``next_<input>`` inputs) returns None
    when any input is None (the next batch was not given: nothing to prefetch).

    Args:
        chain: a GraphModule computing the batch from the inputs, side-effect free.
        lookup: what the batch is looked up by (for ``repr``).
    """

    def __init__(self, chain: GraphModule, lookup: str = "") -> None:
        super().__init__()
        self.chain = chain
        self.lookup = lookup
        self._recent: list[tuple[tuple[Any, ...], Any]] = []
        self._constants = [str(n.target) for n in chain.graph.nodes if n.op == "get_attr"]

    def forward(self, *inputs: Any, next_batch: bool = False) -> Any:
        if next_batch and any(x is None for x in inputs):
            return None
        constants = tuple(t for t in (_attr(self.chain, name) for name in self._constants) if isinstance(t, torch.Tensor))
        for stamp, out in self._recent:
            if _same(stamp, inputs, constants):
                return out
        out = self.chain(*inputs)
        try:
            self._recent.append((_stamp(inputs, constants), out))
        except TypeError:  # an input without weak references (e.g. an int): nothing to match next time
            return out
        del self._recent[:-_KEEP]
        return out

    def __getstate__(self) -> dict[str, Any]:  # deepcopy / pickle: results are per process and object
        state = dict(super().__getstate__())
        state["_recent"] = []
        return state

    def extra_repr(self) -> str:
        return f"lookup={self.lookup!r}" if self.lookup else ""


def _attr(module: nn.Module, path: str) -> Any:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _where(node: Node) -> str:
    """``at <file>:<line> in <function>: `<source>``` of the user's code that made ``node`` (its ``stack_trace``),
    else ``node %<name>`` (a hand-built graph)."""
    from fxdist.errors import location_of_stack_trace

    where = location_of_stack_trace(node.meta.get("stack_trace"))
    return f"at {where}" if where else f"node %{node.name}"


def _buffer_reason(node: Node, root: Any) -> str | None:
    """Why buffer ``node.target`` may change within the graph (None: a constant of the step): a module the graph
    calls owns it (it may update it, e.g. running statistics), or a node modifies it in place."""
    target = str(node.target)
    what = ("the tensor constant" if target.startswith("_tensor_constant") else f"buffer '{target}'")
    for n in node.graph.nodes:
        if n.op == "call_module" and target.startswith(f"{n.target}."):
            return f"its ids depend on {what}, which module '{n.target}' may update"
        if n.op == "get_attr" and n.target == node.target:
            for user in n.users:
                if user.op in ("call_function", "call_method") and user.is_impure() and "async_rpc" not in user.meta \
                        and getattr(user.target, "__module__", None) != ops.__name__:
                    return (f"its ids depend on {what}, which the impure call {_target_name(user)} ({_where(user)}) "
                            "may modify in place")
    return None


def _target_name(node: Node) -> str:
    if node.op == "call_method":
        return f"'.{node.target}()'"
    module, name = getattr(node.target, "__module__", None), getattr(node.target, "__name__", node.target)
    return f"'{module}.{name}'" if module and module != "builtins" else f"'{name}'"


def _is_random(node: Node) -> bool:
    if node.op == "call_method":
        return node.target in _RANDOM_METHODS
    return is_random_op(node.op, node.target) or not node.is_impure(impure_random=False)


def _own_reason(node: Node, root: Any) -> str | None:
    """Why ``node`` itself is not part of a function of the inputs (None: it is)."""
    if node.op == "get_attr":
        if root is not None:
            if node.target in dict(root.named_parameters()):
                return f"its ids depend on parameter '{node.target}'"
            if node.target in dict(root.named_buffers()):
                return _buffer_reason(node, root)  # None: a buffer the graph does not update is a constant
        return None  # a constant the trace stored
    if node.op == "call_module":
        return f"its ids depend on the output of module '{node.target}'"
    if node.op in ("call_function", "call_method") and node.is_impure():
        kind = "the random op" if _is_random(node) else "the impure call"
        return f"its ids depend on {kind} {_target_name(node)} ({_where(node)})"
    return None


def chain_of(batch: Node) -> tuple[list[Node], list[str]]:
    """(the nodes ``batch`` is computed from, ``batch`` included, in graph order; the reasons it is not a function
    of the graph's inputs alone, empty when it is). The walk stops at nodes that have a reason."""
    root = batch.graph.owning_module
    seen: dict[Node, None] = {}
    reasons: list[str] = []
    todo = [batch]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen[node] = None
        reason = _own_reason(node, root)
        if reason is not None:
            reasons.append(reason)
        else:
            todo.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(batch.graph.nodes)}
    return sorted(seen, key=order.__getitem__), reasons


def _mutated(chain: list[Node]) -> list[str]:
    """Reasons for chain values that an impure node outside the chain uses (it may modify them in place);
    the parameter-server ops and the RPCs ``async_rpc`` split only read them."""
    inside = set(chain)
    out = []
    for node in chain:
        for user in node.users:
            if user in inside or user.op not in ("call_function", "call_method") or "async_rpc" in user.meta:
                continue
            if getattr(user.target, "__module__", None) == ops.__name__ or not user.is_impure():
                continue
            what = "the input" if node.op == "placeholder" else "the value"
            value = f"%{node.name}" if "stack_trace" not in node.meta else f"computed {_where(node)}"
            out.append(f"its ids depend on {what} {value}, which the impure call {_target_name(user)} "
                       f"({_where(user)}) may modify in place")
    return out


def input_reason(batch: Any) -> str | None:
    """Why the lookup of ``batch`` cannot be replayed on the next batch's inputs, or None when it can (its
    batch is a function of graph inputs alone: see the module docstring). One sentence; several causes are
    joined by ``"; "``."""
    if not isinstance(batch, Node):
        return f"its batch is the constant {batch!r}, not computed from the graph's inputs"
    chain, reasons = chain_of(batch)
    if not reasons:  # no graph input at all: constants only, the same batch every step
        reasons.extend(_mutated(chain))
    return "; ".join(dict.fromkeys(reasons)) or None


def replay_module(batch: Node, lookup: str = "") -> tuple[BatchReplay, list[Node]]:
    """(a :class:`BatchReplay` computing ``batch`` from its graph inputs, those inputs in graph order).
    Call only when :func:`input_reason` gives None."""
    chain, _ = chain_of(batch)
    sub = Graph()
    env: dict[Node, Node] = {}
    inputs = [n for n in chain if n.op == "placeholder"]
    for node in inputs:
        env[node] = sub.placeholder(str(node.target))
    for node in chain:
        if node.op != "placeholder":
            env[node] = sub.node_copy(node, env.__getitem__)
    sub.output(env[batch])
    root = batch.graph.owning_module
    return BatchReplay(GraphModule(root if root is not None else nn.Module(), sub, "BatchFunction"), lookup), inputs
