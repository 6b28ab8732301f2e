"""Cross-step prefetch for :func:`scheduling.async_rpc` (``prefetch=True``): start the next step's lookups
inside this step.

Within one step a lookup can only overlap the compute that does not need its answer (in a DLRM: the bottom
MLP's forward). The next step's lookup, though, depends only on the next batch's ids, which the data
loader already has. The pass adds one input per looked-up batch, ``next_<name>`` (default None), and has
this step's push to each server ask for the next batch's lookup in the same request::

    %ps_push_start = ps_push_start(ps, 0, %kjt, %ps_fetch_wait, %ps_backward, next_kjt=%next_kjt)
    ...bottom MLP backward, optimizer step...
    %ps_push_settle = ps_push_settle(%ps_push_start)  # left in flight when it carries the lookup

The server applies the push, then looks up the next batch and answers both: the lookup of step ``t + 1``
overlaps the rest of step ``t`` and the start of step ``t + 1``, costs no extra round trip, and is exact
(it follows the push). Step ``t + 1``'s ``ps_fetch_start`` takes the prefetched answer (and the push
with it). Call ``PSClient.flush()`` when training stops, to wait for the last of them. "Exact" is about
this trainer's own pushes; with several trainers, the prefetched lookup sees the others' pushes as of when
it was served, a fraction of a step earlier than without prefetch (their interleaving is not deterministic anyway). With ``max_staleness >= 1`` a separate
``ps_prefetch(ps, 0, %next_kjt)`` starts right after this step's own lookup instead, so it overlaps the
whole step but misses this step's push (one step of staleness, the bound the option allows).

Call the module with the next batch: ``gm(dense, kjt, labels, next_kjt=next_batch_kjt)``
(:func:`lookahead` pairs each batch with the next one); without it (None) nothing is prefetched.
A forward whose pushes run in backward from ``ps_push_in_backward`` hooks (a training forward, without the
backward in the graph) gets the same: the hook's push carries the next lookup. A lookup is prefetched only
when its batch is a graph input (or converted in the graph from inputs only, by a function marked
``fxdist_batch_conversion``, e.g. :func:`scheduling.placement_ops.bag_to_kjt`), and (without ``max_staleness``) only when the graph pushes to that server,
in the graph or by one such hook: otherwise the pass cannot know when the prefetch would be exact. Others
keep the in-step schedule.

Source: torchrec ``TrainPipelineSparseDist`` (starts batch ``i + 1``'s input distribution during batch
``i``); torch.fx paper §6.2.3 (move the start as early as its inputs allow).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from fxdist.graph import Graph
from fxdist.node import Node

from .ps import ops
from .rpc_kinds import node_arg

__all__ = ["add_prefetch", "lookahead", "async_rpc_prefetch"]

T = TypeVar("T")


def _next_input(graph: Graph, batch: Node, made: dict[Node, Node]) -> Node:
    """The placeholder ``next_<batch>`` (default None), created after the last placeholder."""
    if batch not in made:
        last = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(last):
            made[batch] = graph.placeholder(f"next_{batch.target}", default_value=None)
    return made[batch]


def _next_batch(graph: Graph, batch: Any, made: dict[Node, Node], dry_run: bool = False) -> Node | None:
    """The node holding the next step's batch: ``next_<batch>`` for an input, or, for a batch converted in the
    graph from inputs only by a function marked ``fxdist_batch_conversion`` (e.g. ``nn.EmbeddingBag``'s
    ``(input, offsets)`` -> KeyedJaggedTensor), the same conversion of their ``next_`` inputs (created once,
    after the inputs). None when the batch is neither. ``dry_run``: only say whether it would be None."""
    if not isinstance(batch, Node):
        return None
    if batch.op == "placeholder":
        return batch if dry_run else _next_input(graph, batch, made)
    if not (batch.op == "call_function" and getattr(batch.target, "fxdist_batch_conversion", False)):
        return None
    if not all(n.op == "placeholder" for n in batch.all_input_nodes):
        return None
    if dry_run or batch in made:
        return made.get(batch, batch)
    nexts = {n: _next_input(graph, n, made) for n in batch.all_input_nodes}
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        made[batch] = graph.node_copy(batch, lambda n: nexts[n])
    made[batch].meta["async_rpc_prefetch"] = batch.name
    return made[batch]


def add_prefetch(graph: Graph, sites: list[Any], max_staleness: int | None) -> list[Node]:
    """Add the prefetches (after the RPCs were split and scheduled); returns the nodes that start them:
    push starts given ``next_kjt``, or (``max_staleness >= 1``) new ``ps_prefetch`` nodes.

    ``sites`` are the pass's :class:`~scheduling.async_rpc_pass.RPCSite` list.

    Raises:
        ValueError: the graph has a ``*args``/``**kwargs`` input (a new input cannot follow it).
    """
    if any(n.op == "placeholder" and str(n.target).startswith("*") for n in graph.nodes):
        raise ValueError("async_rpc(prefetch=True): the graph has a *args/**kwargs input; the next batch "
                         "cannot be added as an input after it")
    stale = bool(max_staleness)
    made: dict[Node, Node] = {}
    added = []
    reads = [s for s in sites if s.pair.family == "ps" and s.pair.kind == "read" and s.dest is not None]
    for site in reads:
        if sum(s.dest == site.dest for s in reads) > 1:  # one prefetch slot per (client, server)
            continue
        batch = node_arg(site.start, 2, "kjt")
        if _next_batch(graph, batch, made, dry_run=True) is None:
            continue
        pushes = [s for s in sites if s.pair.kind == "write" and s.dest == site.dest]
        hooks = [n for n in graph.nodes if n.op == "call_function" and n.target is ops.ps_push_in_backward
                 and ("ps", *n.args[:2]) == site.dest]
        if not (stale or pushes or len(hooks) == 1):  # its pushes, if any, run outside the graph
            continue
        nxt = _next_batch(graph, batch, made)
        if stale:
            with graph.inserting_after(site.start):
                node = graph.call_function(ops.ps_prefetch, (site.dest[1], site.dest[2], nxt),
                                           {"max_staleness": max_staleness, "after": site.start})
            node.meta["async_rpc_prefetch"] = site.start.meta.get("async_rpc", site.start.name)
        elif not pushes:  # the push runs in backward, from this node's hook: it carries the lookup
            node = hooks[0]
            node.update_kwarg("next_kjt", nxt)
        else:  # the last push to the server carries the lookup: one request, answered after the push
            pos = {n: i for i, n in enumerate(graph.nodes)}
            last = max(pushes, key=lambda s: pos[s.start])
            node = last.start
            node.update_kwarg("next_kjt", nxt)
            if last.wait.target is ops.ps_push_wait and not last.wait.users:
                last.wait.target = ops.ps_push_settle  # do not hold the step's end for the next lookup
        added.append(node)
    return added


def async_rpc_prefetch(gm: Any) -> Any:
    """``async_rpc(gm, prefetch=True)``, as a one-argument pass (``fxdist.optimize(passes=("async_rpc_prefetch",))``)."""
    from .async_rpc_pass import async_rpc

    return async_rpc(gm, prefetch=True)


def lookahead(batches: Iterable[T]) -> Iterator[tuple[T, T | None]]:
    """``(batch, next batch)`` pairs; the last batch is paired with None.

    >>> list(lookahead("abc"))
    [('a', 'b'), ('b', 'c'), ('c', None)]
    """
    it = iter(batches)
    try:
        current = next(it)
    except StopIteration:
        return
    for nxt in it:
        yield current, nxt
        current = nxt
    yield current, None
