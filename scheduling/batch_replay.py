"""Lookups whose ids are computed from the graph's inputs: which ones :mod:`scheduling.prefetch` can start a
step early, why the others cannot, and the module that replays the computation on the next batch's inputs.

A lookup's batch (the ``KeyedJaggedTensor`` a ``ps_fetch`` reads) is often computed in ``forward``: one
``(B, F)`` id tensor sliced per feature (``ids[:, j]``), cast (``.long()``), reshaped (``.view(-1)``), or a
``KeyedJaggedTensor.from_lengths_sync(...)`` built from it. When every node from the graph's inputs
(placeholders) to that batch is side-effect free, the batch is a function of the inputs alone, and the
next step's batch is the same function of the next step's inputs::

    %ids = placeholder[ids]; %next_ids = placeholder[next_ids](default None)
    %prefetch_sync = call_module[prefetch_sync](%ids)                       # this step's batch
    %prefetch_sync_1 = call_module[prefetch_sync](%next_ids, next_batch=True)  # the next step's

The submodule (:class:`BatchReplay`) holds that function as a GraphModule (the nodes copied from the graph)
and returns the same object for the same input objects (not modified in place since, same ``_version``): the
client matches a prefetched lookup with the next step's by identity (``PSClient.fetch_async``), so the batch
this step builds from ``next_ids`` must be the very object the next step's lookup reads.

Not a function of the inputs alone (see :func:`input_reason`): a batch depending on a parameter or buffer
(``get_attr``), on a module's output (``call_module``), on a random op, on an impure call (an RPC's answer,
an in-place op), or on a value that an impure call may modify in place. Constants stored by the trace
(``get_attr`` of a plain tensor attribute) count as part of the function.

Source: torch.fx paper §6.2.3 (move each start as early as its inputs allow); torchrec
``TrainPipelineSparseDist`` (the next batch's input distribution runs during this batch).
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from fxdist._impure import _RANDOM_FUNCTIONS
from fxdist.graph import Graph
from fxdist.graph_module import GraphModule
from fxdist.node import Node, _get_qualified_name

from .ps import ops

__all__ = ["BatchReplay", "chain_of", "input_reason", "replay_module"]

_KEEP = 4  # this step's batch, the next one, and slack
_RANDOM_METHODS = frozenset({"bernoulli", "bernoulli_", "multinomial", "normal_", "uniform_", "random_",
                             "exponential_", "geometric_", "cauchy_", "log_normal_"})


def _stamp(objects: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((weakref.ref(o), getattr(o, "_version", None)) for o in objects)


def _same(stamp: tuple[Any, ...], objects: tuple[Any, ...]) -> bool:
    return all(ref() is o and getattr(o, "_version", None) == version for (ref, version), o in zip(stamp, objects))


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

    def forward(self, *inputs: Any, next_batch: bool = False) -> Any:
        if next_batch and any(x is None for x in inputs):
            return None
        for stamp, out in self._recent:
            if _same(stamp, inputs):
                return out
        out = self.chain(*inputs)
        try:
            self._recent.append((_stamp(inputs), out))
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


def _target_name(node: Node) -> str:
    if node.op == "call_method":
        return f"'.{node.target}()'"
    try:
        return f"'{_get_qualified_name(node.target)}'"
    except Exception:  # noqa: BLE001 - any callable: its repr will do
        return f"'{getattr(node.target, '__name__', node.target)}'"


def _is_random(node: Node) -> bool:
    if node.op == "call_method":
        return node.target in _RANDOM_METHODS
    try:
        return node.target in _RANDOM_FUNCTIONS or not node.is_impure(impure_random=False)
    except TypeError:  # unhashable target
        return not node.is_impure(impure_random=False)


def _own_reason(node: Node, root: Any) -> str | None:
    """Why ``node`` itself is not part of a function of the inputs (None: it is)."""
    if node.op == "get_attr":
        if root is not None:
            if node.target in dict(root.named_parameters()):
                return f"its ids depend on parameter '{node.target}'"
            if node.target in dict(root.named_buffers()):
                return f"its ids depend on buffer '{node.target}'"
        return None  # a constant the trace stored
    if node.op == "call_module":
        return f"its ids depend on the output of module '{node.target}'"
    if node.op in ("call_function", "call_method") and node.is_impure():
        kind = "the random op" if _is_random(node) else "the impure call"
        return f"its ids depend on {kind} {_target_name(node)} (node %{node.name})"
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
            out.append(f"its ids depend on {what} %{node.name}, which the impure call {_target_name(user)} "
                       f"(node %{user.name}) may modify in place")
    return out


def input_reason(batch: Any) -> str | None:
    """Why the lookup of ``batch`` cannot be replayed on the next batch's inputs, or None when it can (its
    batch is a function of graph inputs alone: see the module docstring). One sentence; several causes are
    joined by ``"; "``."""
    if not isinstance(batch, Node):
        return f"its batch is the constant {batch!r}, not computed from the graph's inputs"
    chain, reasons = chain_of(batch)
    if not reasons:
        if not any(n.op == "placeholder" for n in chain):
            reasons.append("its ids depend on no graph input (a constant batch)")
        else:
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
