"""Which call targets are blocking RPCs, and what the ``async_rpc`` pass turns each into.

One :class:`AsyncPair` per blocking target (a table, one entry a line)::

    torch.distributed.rpc.rpc_sync(to, f, args)  -> fut = rpc_async(to, f, args); rpc_wait(fut)     read
    ps_lookup(client, server, kjt)                -> h = ps_lookup_start(...); ps_lookup_wait(h)        read
    ps_push(client, server, kjt, t, after)       -> h = ps_push_start(...); ps_push_wait(h) / defer  write
    ray_call(handle, "m", *args)                 -> ref = ray_remote(handle, "m", *args); ray.get(ref)  read
      (scheduling.ray_calls; a traced ray.get(handle.m.remote(x)) is already such a start + wait pair)

A *read* may run concurrently with any other read; a *write* is ordered after every earlier RPC and
before every later one to the same destination (``None`` = unknown destination, overlaps everything).
A plain ``rpc_sync`` is assumed to be a read (it usually fetches values); register your own pair with
``kind="write"`` for remote calls that update state.

A pair with ``presplit=True`` is also recognised already split: a wait node whose argument is a start node
used by nothing else (code that starts and waits itself, as ``ray.get(handle.m.remote(x))`` does); the pass
then only moves the two. Transport-specific pairs live in their own modules, which register them when they are
imported (:mod:`scheduling.ray_calls` for Ray): a graph can call ``ray_remote`` / ``ray_call`` only once that
module is imported, so this module names none of them and the pass never imports Ray.

Source: torch.fx paper §6.2.3.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Literal

from torch.distributed import rpc

from fxdist.node import Node

from .ps import ops

__all__ = ["AsyncPair", "register_async_pair", "pair_for", "presplit_pair_for", "destination", "node_arg", "trace_meta"]


@dataclass(frozen=True)
class AsyncPair:
    """How to make one blocking RPC target asynchronous."""

    blocking: Callable[..., Any]
    """The blocking target (``call_function`` target) found in graphs."""
    start: Callable[..., Any]
    """Called with the blocking call's args/kwargs; returns a handle (Future)."""
    wait: Callable[..., Any]
    """Called with the handle; returns what the blocking call returned."""
    kind: Literal["read", "write"]
    """Reads may overlap each other; writes are ordered with every RPC to the same destination."""
    dest_args: tuple[tuple[int, str], ...]
    """(position, keyword) of the arguments naming the destination; all must be constants."""
    family: str = "rpc"
    """Destinations compare equal only within one family (``"ps"`` for the parameter-server ops)."""
    defer: Callable[..., Any] | None = None
    """For writes: called instead of ``wait`` when the pass runs with ``max_staleness``."""
    presplit: bool = False
    """Also recognise ``wait(start(...))`` (the start used only there) as this RPC, already split."""


_PAIRS: dict[Any, AsyncPair] = {}


def register_async_pair(pair: AsyncPair) -> AsyncPair:
    """Teach the pass a new blocking RPC target (later registrations win)."""
    _PAIRS[pair.blocking] = pair
    return pair


def pair_for(node: Node) -> AsyncPair | None:
    """The pair whose blocking target ``node`` calls, or None."""
    if node.op != "call_function":
        return None
    try:
        return _PAIRS.get(node.target)
    except TypeError:  # unhashable target
        return None


def presplit_pair_for(node: Node) -> AsyncPair | None:
    """The ``presplit`` pair for which ``node`` is the wait of a start node that only it uses, or None."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
        return None
    start = node.args[0]
    for pair in _PAIRS.values():
        if (pair.presplit and node.target is pair.wait and start.op == "call_function" and start.target is pair.start
                and len(start.users) == 1):
            return pair
    return None


def node_arg(node: Node, position: int, keyword: str, default: Any = None) -> Any:
    """Argument ``position`` of ``node`` (given positionally or as ``keyword``)."""
    if position < len(node.args):
        return node.args[position]
    return node.kwargs.get(keyword, default)


def trace_meta(node: Node) -> dict[str, Any]:
    """The metadata that points at the user's code (``stack_trace``, ``nn_module_stack``), for the nodes a pass
    puts in ``node``'s place."""
    return {k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")}


def destination(node: Node, pair: AsyncPair) -> Hashable | None:
    """A hashable name of where the RPC goes, or None when some part of it is computed in the graph (an
    attribute of the module, ``get_attr``, counts as a constant: e.g. a Ray actor handle)."""
    parts: list[Any] = []
    for pos, kw in pair.dest_args:
        value = node_arg(node, pos, kw)
        if isinstance(value, Node) and value.op == "get_attr":
            parts.append(("get_attr", value.target))
            continue
        if isinstance(value, Node):
            return None
        try:
            hash(value)
        except TypeError:
            return None
        parts.append(value)
    return (pair.family, *parts)


register_async_pair(AsyncPair(rpc.rpc_sync, rpc.rpc_async, ops.rpc_wait, "read", ((0, "to"),)))
register_async_pair(AsyncPair(ops.ps_lookup, ops.ps_lookup_start, ops.ps_lookup_wait, "read",
                              ((0, "client"), (1, "server")), family="ps"))
register_async_pair(AsyncPair(ops.ps_push, ops.ps_push_start, ops.ps_push_wait, "write",
                              ((0, "client"), (1, "server")), family="ps", defer=ops.ps_push_defer))
