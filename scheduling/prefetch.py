"""Cross-step prefetch for :func:`scheduling.async_rpc` (``prefetch=True``): start the next step's lookups
inside this step.

Within one step a lookup can only overlap the compute that does not need its answer (in a DLRM: the bottom
MLP's forward). The next step's lookup, though, depends only on the next batch's ids, which the data
loader already has. The pass adds one input per looked-up batch, ``next_<name>`` (default None), and has
this step's push to each server ask for the next batch's lookup in the same request::

    %ps_push_start = ps_push_start(ps, 0, %kjt, %ps_lookup_wait, %ps_backward, next_kjt=%next_kjt)
    ...bottom MLP backward, optimizer step...
    %ps_push_settle = ps_push_settle(%ps_push_start)  # left in flight when it carries the lookup

The server applies the push, then looks up the next batch and answers both: the lookup of step ``t + 1``
overlaps the rest of step ``t`` and the start of step ``t + 1``, costs no extra round trip, and is exact
(it follows the push). Step ``t + 1``'s ``ps_lookup_start`` takes the prefetched answer (and the push
with it). Call ``PSClient.flush()`` when training stops, to wait for the last of them. "Exact" is about
this trainer's own pushes; with several trainers, the prefetched lookup sees the others' pushes as of when
it was served, a fraction of a step earlier than without prefetch (their interleaving is not deterministic anyway). With ``max_staleness >= 1`` a separate
``ps_prefetch(ps, 0, %next_kjt)`` starts right after this step's own lookup instead, so it overlaps the
whole step but misses this step's push (one step of staleness, the bound the option allows).

Call the module with the next batch: ``gm(dense, kjt, labels, next_kjt=next_batch_kjt)``
(:func:`lookahead` pairs each batch with the next one); without it (None) nothing is prefetched. The added
inputs are always graph inputs: ``next_<input>`` for each input a prefetched lookup's ids are computed from, in
the order the lookups are met, after the existing inputs.
A forward whose pushes run in backward from ``ps_push_in_backward`` hooks (a training forward, without the
backward in the graph) gets the same: the hook's push carries the next lookup. A lookup is prefetched when

- its batch is a function of the graph's inputs alone: an input itself, a conversion of inputs by a function
  marked ``fxdist_batch_conversion`` (e.g. :func:`scheduling.placement.conversions.bag_to_kjt`), or any chain of
  side-effect-free nodes from inputs (``ids[:, j]``, ``.long()``, ``.view(-1)``,
  ``KeyedJaggedTensor.from_lengths_sync(...)``), replayed on the ``next_`` inputs by a
  :class:`~scheduling.batch_replay.BatchReplay` submodule (:mod:`scheduling.batch_replay` says what breaks
  that: a parameter, a module's output, a random op, an impure call, a value modified in place);
- its client reads that server once a step (the client keeps one prefetched lookup per server);
- (without ``max_staleness``) the graph pushes to that server, in the graph or by one such hook: otherwise
  the pass cannot know when the prefetch would be exact.

A batch of constants only (``self.pos(torch.arange(20))``: a tensor the trace stored, a buffer the graph does not
update, calls on no input) is the same every step: it is computed once, by a ``BatchReplay`` without inputs, and
each step's push asks for the next step's lookup of it (no ``next_`` input is added for it).

Every other lookup keeps the in-step schedule, with one :class:`PrefetchWarning` per lookup, naming the user's
call of the module (from the nodes' ``stack_trace``; ``batch %<node>`` only in a graph without one)::

    async_rpc_prefetch: the lookup of module 'emb' (at model.py:31 in forward: `e = self.emb(self.proj(x)...)`)
    is not prefetched: its ids depend on the output of module 'proj' (servers 0, 1); it keeps the in-step schedule

Every lookup's outcome is recorded in ``gm.meta["fxdist"]["prefetch"]["lookups"]``: ``{module path (the client's
name when unknown): {"prefetched": bool, "reason": str | None, "where": "file:line" | None, "servers": [int]}}``
(the ``parameter_servers`` pass's modules; a group's modules share one lookup, so one outcome), and the warnings'
text in ``["not_prefetched"]``.

Source: torchrec ``TrainPipelineSparseDist`` (starts batch ``i + 1``'s input distribution during batch
``i``); torch.fx paper §6.2.3 (move the start as early as its inputs allow).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar, cast

from fxdist.errors import location_of_stack_trace
from fxdist.graph import Graph
from fxdist.graph_module import GraphModule
from fxdist.node import Node

from .async_pairs import node_arg, trace_meta
from .batch_replay import input_reason, replay_module
from .ps import ops

__all__ = ["add_prefetch", "lookahead", "PrefetchWarning"]

T = TypeVar("T")


class PrefetchWarning(UserWarning):
    """A parameter-server lookup is not prefetched (the message names it and says why)."""


class _NextBatches:
    """The nodes holding the next step's batches, made once per batch, after the inputs."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.made: dict[Node, Node] = {}
        self.last: Node | None = None  # the last node made (or moved) after the inputs
        self.replayed: set[Node] = set()  # this step's batches computed by a BatchReplay

    def _cursor(self) -> Node:
        return self.last or [n for n in self.graph.nodes if n.op == "placeholder"][-1]

    def input(self, node: Node) -> Node:
        """The placeholder ``next_<node>`` (default None), created after the last placeholder."""
        if node not in self.made:
            last = [n for n in self.graph.nodes if n.op == "placeholder"][-1]
            with self.graph.inserting_after(last):
                self.made[node] = self.graph.placeholder(f"next_{node.target}", default_value=None)
        return self.made[node]

    def reason(self, batch: Any) -> str | None:
        """Why the next step's ``batch`` cannot be made here, or None."""
        return None if isinstance(batch, Node) and batch in self.made else input_reason(batch)

    def of(self, batch: Node, lookup: str) -> Node:
        """The node holding the next step's batch (call after :meth:`reason` said None): ``next_<batch>`` for
        an input; for a conversion of inputs only by a function marked ``fxdist_batch_conversion`` (e.g.
        ``nn.EmbeddingBag``'s ``(input, offsets)`` -> KeyedJaggedTensor), the same conversion of their ``next_``
        inputs; otherwise a :class:`~scheduling.batch_replay.BatchReplay` submodule called on the inputs
        (replacing ``batch`` in this step too, so both steps' batches come from its results)."""
        if batch in self.made:
            return self.made[batch]
        if batch.op == "placeholder":
            return self.input(batch)
        if (batch.op == "call_function" and getattr(batch.target, "fxdist_batch_conversion", False)
                and all(n.op == "placeholder" for n in batch.all_input_nodes)):
            nexts = {n: self.input(n) for n in batch.all_input_nodes}
            nxt = self._add(lambda: self.graph.node_copy(batch, nexts.__getitem__))
        else:
            nxt = self._replay(batch, lookup)
        nxt.meta["async_rpc_prefetch"] = batch.name
        self.made[batch] = nxt
        return nxt

    def _add(self, make: Any) -> Node:
        """Put ``make()`` (a new node, or an existing one, moved) after the inputs and the nodes added so far."""
        cursor = self._cursor()
        with self.graph.inserting_after(cursor):
            node = make()
        if node.prev is not cursor:  # an existing node: move it
            cursor.append(node)
        self.last = node
        return node

    def _replay(self, batch: Node, lookup: str) -> Node:
        graph, root = self.graph, cast(GraphModule, self.graph.owning_module)  # the pass runs on a GraphModule
        module, inputs = replay_module(batch, lookup)
        name, count = f"prefetch_{batch.name}", 1
        while hasattr(root, name):
            count += 1
            name = f"prefetch_{batch.name}_{count}"
        root.add_submodule(name, module)
        nexts = tuple(self.input(n) for n in inputs)
        current = self._add(lambda: graph.call_module(name, tuple(inputs)))
        current.meta.update(trace_meta(batch))
        batch.replace_all_uses_with(current)
        _erase_unused(graph, batch)
        nxt = self._add(lambda: graph.call_module(name, nexts, {"next_batch": True}))
        self.made[current] = nxt
        self.replayed.add(current)
        return nxt

    def hoist(self, sites: list[Any]) -> None:
        """Move the lookups of the batches now computed at the top (:meth:`_replay`) up there too, in order, with
        their ``ps_prefetch``: their only input is that batch (lookups that must follow a write keep their place)."""
        for site in sites:
            if node_arg(site.start, 2, "kjt") in self.replayed and not site.after:
                self._add(lambda: site.start)  # noqa: B023  (_add calls it at once, inside this iteration)
                for user in [u for u in site.start.users if u.target is ops.ps_prefetch]:  # max_staleness: with it
                    self._add(lambda: user)  # noqa: B023  (_add calls it at once, inside this iteration)


def _erase_unused(graph: Graph, node: Node) -> None:
    """Erase ``node`` and, in turn, its inputs that are left unused (pure nodes only)."""
    todo, erased = [node], set()
    while todo:
        n = todo.pop()
        if n in erased or n.users or n.op in ("placeholder", "output") or n.is_impure():
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        erased.add(n)
        todo.extend(inputs)


def _lookup_names(graph: Graph) -> dict[str, str]:
    """client name -> the module(s) it serves (from the ``parameter_servers`` pass's record), when known:
    ``"module 'emb'"``, or for a group of modules sharing one client ``"modules 'a' (+52 grouped with it)"``."""
    served = _served(graph)
    return {client: f"module '{q[0]}'" if len(q) == 1 else f"modules '{q[0]}' (+{len(q) - 1} grouped with it)"
            for client, q in served.items()}


def _served(graph: Graph) -> dict[str, list[str]]:
    """client name -> the modules it serves, in the ``parameter_servers`` pass's record (empty when unknown)."""
    owner = graph.owning_module
    clients = getattr(owner, "meta", {}).get("fxdist", {}).get("placement", {}).get("clients", {})
    served: dict[str, list[str]] = {}
    for qualname, client in clients.items():
        served.setdefault(client, []).append(qualname)
    return served


def _source(graph: Graph, module: str | None, fallback: Node) -> str | None:
    """``<file>:<line> in <function>: `<source>``` of the user's call of ``module`` (the first node the
    ``parameter_servers`` pass made for it with a ``stack_trace``), else of ``fallback``; None without one."""
    nodes = [n for n in graph.nodes if module is not None and n.meta.get("parameter_servers") == module]
    trace = next((n.meta["stack_trace"] for n in [*nodes, fallback] if n.meta.get("stack_trace")), None)
    return location_of_stack_trace(trace)


def _file_line(where: str | None) -> str | None:
    """``"model.py:31"`` of a :func:`_source` description."""
    found = re.match(r"(.*?:\d+) in ", where or "")
    return found.group(1) if found else None


def _warn(graph: Graph, skipped: dict[tuple[str, str], dict[str, list[int]]], names: dict[str, str],
          lookups: dict[str, tuple[Node, list[int]]]) -> None:
    """One PrefetchWarning per lookup not prefetched, naming the user's call of the module (``batch %<node>``
    in a graph without stack traces); the messages go to ``gm.meta["fxdist"]["prefetch"]["not_prefetched"]``,
    every lookup's outcome (``lookups``: client -> (its first fetch start, servers)) to ``["lookups"]``."""
    messages, served, record = [], _served(graph), {}
    whys: dict[str, str] = {}
    for (client, batch), reasons in skipped.items():
        what = names.get(client, f"client '{client}'")
        why = "; ".join(f"{r} (server{'s' * (len(s) > 1)} {', '.join(map(str, s))})" for r, s in reasons.items())
        whys[client] = f"{whys[client]}; {why}" if client in whys else why
        where = _source(graph, next(iter(served.get(client) or []), None), lookups[client][0])
        messages.append(f"async_rpc_prefetch: the lookup of {what} ({f'at {where}' if where else f'batch %{batch}'}) "
                        f"is not prefetched: {why}; it keeps the in-step schedule")
        warnings.warn(messages[-1], PrefetchWarning, stacklevel=4)
    for client, (start, servers) in lookups.items():
        for key in served.get(client) or [client]:
            record[key] = {"prefetched": client not in whys, "reason": whys.get(client),
                           "where": _file_line(_source(graph, key if key != client else None, start)),
                           "servers": sorted(servers)}
    owner = graph.owning_module
    if owner is not None and isinstance(getattr(owner, "meta", None), dict):
        owner.meta.setdefault("fxdist", {}).setdefault("prefetch", {}).update(not_prefetched=messages, lookups=record)


def _site_reason(site: Any, reads: list[Any], sites: list[Any], stale: bool, nb: _NextBatches) -> str | None:
    """Why this step cannot start the next step's lookup of ``site``, or None."""
    count = sum(s.dest == site.dest for s in reads)
    if count > 1:  # one prefetch slot per (client, server)
        return (f"its client reads that server {count} times a step (e.g. its module is called {count} times) and "
                "keeps one prefetched lookup per server")
    reason = nb.reason(node_arg(site.start, 2, "kjt"))
    if reason is not None or stale:
        return reason
    pushes = [s for s in sites if s.pair.kind == "write" and s.dest == site.dest]
    hooks = [n for n in site.start.graph.nodes if n.op == "call_function" and n.target is ops.ps_push_in_backward
             and ("ps", *n.args[:2]) == site.dest]
    if not (pushes or len(hooks) == 1):
        return ("the graph pushes no gradient to its server (a frozen table, or pushes outside the graph), so "
                "nothing tells when an exact prefetch may start (max_staleness >= 1 prefetches anyway)"
                if not hooks else f"{len(hooks)} backward pushes go to its server, and only one can carry it")
    return None


def add_prefetch(graph: Graph, sites: list[Any], max_staleness: int | None) -> list[Node]:
    """Add the prefetches (after the RPCs were split and scheduled); returns the nodes that start them:
    push starts given ``next_kjt``, or (``max_staleness >= 1``) new ``ps_prefetch`` nodes.

    ``sites`` are the pass's :class:`~scheduling.async_rpc_pass.RPCSite` list. Each parameter-server lookup not
    prefetched gets one :class:`PrefetchWarning` naming its module (or client), the user's call of it and why
    (the messages are also kept in ``gm.meta["fxdist"]["prefetch"]["not_prefetched"]``); every lookup's outcome
    goes to ``gm.meta["fxdist"]["prefetch"]["lookups"]`` (see the module docstring).

    Raises:
        ValueError: the graph has a ``*args``/``**kwargs`` input (a new input cannot follow it).
    """
    if any(n.op == "placeholder" and str(n.target).startswith("*") for n in graph.nodes):
        raise ValueError("async_rpc(prefetch=True): the graph has a *args/**kwargs input; the next batch "
                         "cannot be added as an input after it")
    stale = bool(max_staleness)
    nb = _NextBatches(graph)
    names = _lookup_names(graph)
    added: list[Node] = []
    skipped: dict[tuple[str, str], dict[str, list[int]]] = {}
    reads = [s for s in sites if s.pair.family == "ps" and s.pair.kind == "read" and s.dest is not None]
    lookups: dict[str, tuple[Node, list[int]]] = {}
    for site in reads:
        lookups.setdefault(str(site.dest[1]), (site.start, []))[1].append(site.dest[2])
        batch = node_arg(site.start, 2, "kjt")
        reason = _site_reason(site, reads, sites, stale, nb)
        if reason is not None:
            key = (str(site.dest[1]), batch.name if isinstance(batch, Node) else repr(batch))
            servers = skipped.setdefault(key, {}).setdefault(reason, [])
            if site.dest[2] not in servers:
                servers.append(site.dest[2])
            continue
        nxt = nb.of(batch, names.get(site.dest[1], str(site.dest[1])))
        added.append(_start_prefetch(graph, site, sites, nxt, max_staleness))
    nb.hoist(reads)
    _warn(graph, skipped, names, lookups)
    return added


def _start_prefetch(graph: Graph, site: Any, sites: list[Any], nxt: Node, max_staleness: int | None) -> Node:
    """Have the push (or, with staleness, a new ``ps_prefetch`` after the lookup) start the next lookup."""
    if max_staleness:
        with graph.inserting_after(site.start):
            node = graph.call_function(ops.ps_prefetch, (site.dest[1], site.dest[2], nxt),
                                       {"max_staleness": max_staleness, "after": site.start})
        node.meta["async_rpc_prefetch"] = site.start.meta.get("async_rpc", site.start.name)
        return node
    pushes = [s for s in sites if s.pair.kind == "write" and s.dest == site.dest]
    if not pushes:  # the push runs in backward, from this node's hook: it carries the lookup
        node = next(n for n in graph.nodes if n.op == "call_function" and n.target is ops.ps_push_in_backward
                    and ("ps", *n.args[:2]) == site.dest)
        node.update_kwarg("next_kjt", nxt)
        return node
    # the last push to the server carries the lookup: one request, answered after the push
    pos = {n: i for i, n in enumerate(graph.nodes)}
    last = max(pushes, key=lambda s: pos[s.start])
    last.start.update_kwarg("next_kjt", nxt)
    if last.wait.target is ops.ps_push_wait and not last.wait.users:
        last.wait.target = ops.ps_push_settle  # do not hold the step's end for the next lookup
    return last.start


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
