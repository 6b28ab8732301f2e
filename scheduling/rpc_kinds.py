"""Which call targets are blocking RPCs, and what the ``async_rpc`` pass turns each into.

One :class:`AsyncPair` per blocking target (a table, one entry a line)::

    torch.distributed.rpc.rpc_sync(to, f, args)  -> fut = rpc_async(to, f, args); rpc_wait(fut)     read
    ps_fetch(client, server, kjt)                -> h = ps_fetch_start(...); ps_fetch_wait(h)        read
    ps_push(client, server, kjt, t, after)       -> h = ps_push_start(...); ps_push_wait(h) / defer  write

A *read* may run concurrently with any other read; a *write* is ordered after every earlier RPC and
before every later one to the same destination (``None`` = unknown destination, overlaps everything).
A plain ``rpc_sync`` is assumed to be a read (it usually fetches values); register your own pair with
``kind="write"`` for remote calls that update state.

Source: torch.fx paper §6.2.3.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Literal

from torch.distributed import rpc

from fxdist.node import Node

from .ps import ops

__all__ = ["AsyncPair", "register_async_pair", "pair_for", "destination", "node_arg"]


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


def node_arg(node: Node, position: int, keyword: str, default: Any = None) -> Any:
    """Argument ``position`` of ``node`` (given positionally or as ``keyword``)."""
    if position < len(node.args):
        return node.args[position]
    return node.kwargs.get(keyword, default)


def destination(node: Node, pair: AsyncPair) -> Hashable | None:
    """A hashable name of where the RPC goes, or None when some part of it is computed in the graph."""
    parts = []
    for pos, kw in pair.dest_args:
        value = node_arg(node, pos, kw)
        if isinstance(value, Node):
            return None
        try:
            hash(value)
        except TypeError:
            return None
        parts.append(value)
    return (pair.family, *parts)


register_async_pair(AsyncPair(rpc.rpc_sync, rpc.rpc_async, ops.rpc_wait, "read", ((0, "to"),)))
register_async_pair(AsyncPair(ops.ps_fetch, ops.ps_fetch_start, ops.ps_fetch_wait, "read",
                              ((0, "client"), (1, "server")), family="ps"))
register_async_pair(AsyncPair(ops.ps_push, ops.ps_push_start, ops.ps_push_wait, "write",
                              ((0, "client"), (1, "server")), family="ps", defer=ops.ps_push_defer))
