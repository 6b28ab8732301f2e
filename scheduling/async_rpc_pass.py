"""The ``async_rpc`` pass: overlap blocking RPCs with computation and with each other.

Source: torch.fx paper §6.2.3 (program scheduling: "replace each blocking call by a non-blocking start and a
separate wait, and move the start as early as possible").

Before (``ps_lookup`` blocks for a round trip each)::

    %kjt = placeholder; %dense = placeholder
    %ps_lookup = ps_lookup(ps, 0, %kjt); %ps_lookup_1 = ps_lookup(ps, 1, %kjt)
    %bottom = call_module[bottom](%dense) ...

After (both lookups in flight while the bottom MLP runs)::

    %ps_lookup_start = ps_lookup_start(ps, 0, %kjt); %ps_lookup_start_1 = ps_lookup_start(ps, 1, %kjt)
    %bottom = call_module[bottom](%dense)
    %ps_lookup_wait = ps_lookup_wait(%ps_lookup_start); %ps_lookup_wait_1 = ps_lookup_wait(%ps_lookup_start_1)

Steps (one function each):
  1. :func:`split_rpcs`: each blocking RPC node (see :mod:`scheduling.async_pairs`) becomes a start node and
     a wait node at its place; its users now use the wait.
  2. :func:`order_constraints`: a write (parameter-server push) and any other RPC to the same destination
     keep their order: the earlier one's wait must precede the later one's start.
  3. :func:`hoist_starts`: each start moves up to just after the last of its inputs and of the waits it must
     follow (never above a non-RPC impure node that uses one of its inputs, which could mutate it).
  4. :func:`sink_waits`: each wait moves down to just before the first of its users, of the starts it must
     precede, and of the output.

Without ``max_staleness`` the trained model is unchanged: every push is waited before the next conflicting
fetch in the graph, and before the graph returns. With ``max_staleness=k``, push waits become
``ps_push_defer`` (the push stays in flight past the end of the step) and fetches wait until at most ``k``
pushes to their server are still in flight. A ``PSClient(ordered=True)`` (the default) has each server apply
its requests in issue order, so such fetches still see every earlier push and training stays exact; with
``ordered=False`` they may miss up to ``k`` steps of updates.

With ``prefetch=True`` the next step's lookups start inside this step (:mod:`scheduling.prefetch`).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar, TextIO, cast

from fxdist.graph import Graph
from fxdist.graph_module import GraphModule
from fxdist.node import Node
from fxdist.passes.pass_base import PassBase, PassResult

from .async_pairs import AsyncPair, destination, pair_for, presplit_pair_for, trace_meta
from .prefetch import add_prefetch
from .timeline import format_timeline

__all__ = ["async_rpc", "async_rpc_prefetch", "AsyncRPC", "RPCSite", "split_rpcs", "order_constraints", "hoist_starts", "sink_waits"]


@dataclass
class RPCSite:
    """One RPC after step 1: its start and wait nodes and what it talks to."""

    index: int
    """Position among the graph's RPCs, in original order."""
    pair: AsyncPair
    """The blocking -> async mapping used."""
    start: Node
    """The node starting the RPC (returns a handle)."""
    wait: Node
    """The node waiting for it (or deferring a push)."""
    dest: Any
    """Destination (None: unknown, overlaps every other)."""
    after: list["RPCSite"] = field(default_factory=list)
    """RPCs whose wait must come before this start (step 2)."""
    before: list["RPCSite"] = field(default_factory=list)
    """RPCs whose start must come after this wait (step 2)."""


def split_rpcs(graph: Graph, max_staleness: int | None = None) -> list[RPCSite]:
    """Step 1: replace every blocking RPC node by a start node and a wait node, at the same place.

    The start gets the blocking node's args and kwargs (plus ``max_staleness`` for parameter-server
    fetches when given); the wait (or, for writes with ``max_staleness``, the defer node) takes the start.
    A start + wait the graph already has (a ``presplit`` pair, e.g. ``ray.get(ray_remote(...))``) is kept as is.
    """
    sites: list[RPCSite] = []
    for node in list(graph.nodes):
        pair = pair_for(node)
        if pair is None:
            pair = presplit_pair_for(node)
            if pair is not None:
                start = cast(Node, node.args[0])  # presplit_pair_for checked it is a Node
                start.meta["async_rpc"] = node.meta["async_rpc"] = node.name
                sites.append(RPCSite(len(sites), pair, start, node, destination(start, pair)))
            continue
        kwargs = dict(node.kwargs)
        if max_staleness is not None and pair.kind == "read" and pair.family == "ps":
            kwargs["max_staleness"] = max_staleness
        finish = pair.defer if (max_staleness is not None and pair.defer is not None) else pair.wait
        with graph.inserting_before(node):
            start = graph.call_function(pair.start, node.args, kwargs)
            wait = graph.call_function(finish, (start,))
        for new in (start, wait):
            new.meta.update(trace_meta(node))
            new.meta["async_rpc"] = node.name
        node.replace_all_uses_with(wait)
        graph.erase_node(node)
        sites.append(RPCSite(len(sites), pair, start, wait, destination(node, pair)))
    return sites


def _overlaps(a: Any, b: Any) -> bool:
    return a is None or b is None or a == b


def order_constraints(sites: list[RPCSite]) -> None:
    """Step 2: for each pair (earlier, later) where one is a write and the destinations may overlap,
    record that the earlier's wait precedes the later's start."""
    for j, later in enumerate(sites):
        for earlier in sites[:j]:
            if "write" in (earlier.pair.kind, later.pair.kind) and _overlaps(earlier.dest, later.dest):
                later.after.append(earlier)
                earlier.before.append(later)


def _positions(graph: Graph) -> dict[Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def hoist_starts(graph: Graph, sites: list[RPCSite]) -> None:
    """Step 3: move each start just after the last node it depends on (in original order of the RPCs)."""
    hoisted: set[Node] = set()
    for site in sites:
        pos = _positions(graph)
        start = site.start
        deps = list(start.all_input_nodes) + [s.wait for s in site.after]
        # a non-RPC impure node using one of the inputs may mutate it: do not move above it
        inputs = set(start.all_input_nodes)
        for n in graph.nodes:
            if n is start:
                break
            if (n.op != "placeholder" and n not in hoisted and pair_for(n) is None and n.is_impure()
                    and inputs.intersection(n.all_input_nodes) and "async_rpc" not in n.meta):
                deps.append(n)
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        anchor = max(deps + placeholders, key=pos.__getitem__, default=None)
        if anchor is None:  # no inputs, no placeholders: first in the graph
            first = next(iter(graph.nodes))
            if first is not start:
                first.prepend(start)
            hoisted.add(start)
            continue
        while anchor.next in hoisted:  # keep starts in their original order
            anchor = anchor.next
        if pos[anchor] < pos[start] and anchor.next is not start:
            anchor.append(start)
        hoisted.add(start)


def sink_waits(graph: Graph, sites: list[RPCSite]) -> None:
    """Step 4: move each wait just before its first user, the first start it must precede, or the output."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    for site in sites:
        pos = _positions(graph)
        targets = list(site.wait.users) + [s.start for s in site.before] + [output]
        target = min(targets, key=pos.__getitem__)
        if pos[target] > pos[site.wait] + 1:
            target.prepend(site.wait)


@dataclass(frozen=True)
class AsyncRPC(PassBase):
    """Pass object for :class:`fxdist.passes.pass_base.PassManager`; see :func:`async_rpc`."""

    name: ClassVar[str] = "async-rpc"
    max_staleness: int | None = None
    """None: no staleness (pushes waited in the step); k >= 0: pushes stay in flight across steps."""
    prefetch: bool = False
    """Start the next step's lookups inside this step (adds ``next_<batch>`` inputs)."""
    verbose: bool = False
    """Print the schedule before and after."""

    def call(self, gm: GraphModule) -> PassResult:
        before = len(gm.graph.nodes)
        gm = async_rpc(gm, max_staleness=self.max_staleness, prefetch=self.prefetch, verbose=self.verbose)
        return PassResult(gm, len(gm.graph.nodes) != before)


def async_rpc(gm: GraphModule, *, max_staleness: int | None = None, prefetch: bool = False,
              verbose: bool = False, file: TextIO | None = None) -> GraphModule:
    """Split every blocking RPC of ``gm`` into start + wait and schedule them for overlap (in place).

    Args:
        gm: a GraphModule (e.g. from ``fxdist.symbolic_trace``) calling ``torch.distributed.rpc.rpc_sync``,
            the parameter-server leaves ``ps_lookup``/``ps_push`` (either transport), or Ray actors
            (``ray.get(handle.m.remote(x))`` traced with :class:`scheduling.ray_calls.RayTracer`).
        max_staleness: None (default) keeps training exact; an int ``k >= 0`` lets pushes stay in flight
            across steps, fetches waiting until at most ``k`` are pending for their server.
        prefetch: also start each parameter-server lookup of the *next* step inside this one, after this
            step's push to the same server (exact with an ordered client), or with ``max_staleness >= 1``
            right after this step's lookup. Adds an input ``next_<input>`` (default None) per graph input a
            prefetched lookup's ids are computed from; warns (``scheduling.prefetch.PrefetchWarning``) once per
            lookup it cannot prefetch, saying why; see :mod:`scheduling.prefetch`.
        verbose: print the graph (``print_tabular``) and the RPC timeline before and after.
        file: where ``verbose`` prints (default ``sys.stdout``).

    Returns:
        ``gm``, changed in place and recompiled.

    Raises:
        ValueError: ``max_staleness`` is negative, or ``prefetch`` on a graph with ``*args`` inputs.
        RuntimeError: the rewritten graph fails ``lint()`` (a bug: please report it).
    """
    if max_staleness is not None and max_staleness < 0:
        raise ValueError(f"async_rpc: max_staleness must be None or >= 0, got {max_staleness}")
    out = file or sys.stdout
    graph = gm.graph
    if verbose:
        _show(graph, "before async_rpc", out)
    sites = split_rpcs(graph, max_staleness)
    order_constraints(sites)
    hoist_starts(graph, sites)
    sink_waits(graph, sites)
    if prefetch:
        add_prefetch(graph, sites, max_staleness)
    graph.lint()
    gm.recompile()
    if verbose:
        _show(graph, "after async_rpc", out)
    return gm


def async_rpc_prefetch(gm: GraphModule) -> GraphModule:
    """``async_rpc(gm, prefetch=True)``, as a one-argument pass (``fxdist.optimize(passes=("async_rpc_prefetch",))``)."""
    return async_rpc(gm, prefetch=True)


NO_RPC = ("no blocking RPC found (torch.distributed.rpc.rpc_sync, or parameter-server ps_lookup/ps_push leaves; "
          "run the parameter_servers pass first to move embedding tables to servers)")
"""Why ``async_rpc`` changes nothing on a graph without blocking RPCs (``fxdist.optimize``'s NoOpPassWarning)."""
async_rpc.fxdist_no_op_reason = NO_RPC  # type: ignore[attr-defined]
async_rpc_prefetch.fxdist_no_op_reason = NO_RPC  # type: ignore[attr-defined]


def _show(graph: Graph, title: str, out: TextIO) -> None:
    print(f"== {title} ==", file=out)
    with contextlib.redirect_stdout(out):
        graph.print_tabular()
    print(format_timeline(graph), file=out)
