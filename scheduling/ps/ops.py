"""Leaf functions through which models talk to the parameter servers.

Each is registered with :func:`fxdist.wrap` (one ``call_function`` node when traced; call them as
``ops.ps_lookup(...)`` so the tracer's patch of this module's globals applies) and, except the pure
:func:`ps_pool`, with :func:`fxdist.node.has_side_effect` (dead-code elimination keeps them).
Clients are named by a string (:func:`scheduling.ps.get_client`), so the nodes hold only constants and
tensors.

Blocking baseline          -> what :func:`scheduling.async_rpc` makes of it
``ps_lookup(c, s, kjt)``    -> ``h = ps_lookup_start(c, s, kjt)`` ... ``ps_lookup_wait(h)``
``ps_push(c, s, kjt, t, after)`` -> ``h = ps_push_start(c, s, kjt, t, after)`` ... ``ps_push_wait(h)``
(``async_rpc(prefetch=True)``)   -> ``ps_push_start(..., next_kjt=n)`` asks for the next step's lookup too,
                                 ``ps_push_settle(h)`` leaves it in flight until that lookup is fetched
                                 (with ``max_staleness >= 1``: ``ps_prefetch(c, s, n)`` after the lookup)

Source: torch.fx paper §6.2.3; torch/fx/_symbolic_trace.py ``wrap`` (leaf functions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import fxdist
from fxdist.node import has_side_effect

from .client import get_client

__all__ = ["PendingRPC", "ps_lookup", "ps_lookup_start", "ps_lookup_wait", "ps_push", "ps_push_start",
           "ps_push_wait", "ps_push_settle", "ps_push_defer", "ps_push_in_backward", "ps_prefetch", "ps_pool", "ps_backward", "rpc_wait"]


@dataclass
class PendingRPC:
    """An RPC in flight: the Future plus what is needed to finish it (returned by the start functions)."""

    future: torch.futures.Future
    """The ``rpc_async`` Future."""
    client: str
    """Name of the :class:`~scheduling.ps.PSClient`."""
    server: int
    """Server index in the client's list."""


@has_side_effect
def ps_lookup(client: str, server: int, kjt: Any) -> torch.Tensor:
    """Blocking lookup (``rpc_sync``): pooled sums ``(B, D_s)`` of server ``server``'s shards for ``kjt``."""
    return get_client(client).lookup(server, kjt)


@has_side_effect
def ps_lookup_start(client: str, server: int, kjt: Any, max_staleness: int | None = None) -> PendingRPC:
    """Start a lookup (``rpc_async``); finish it with :func:`ps_lookup_wait`.

    Deferred pushes to the server are waited first, leaving at most ``max_staleness`` in flight.
    """
    return PendingRPC(get_client(client).lookup_async(server, kjt, max_staleness), client, server)


@has_side_effect
def ps_lookup_wait(pending: PendingRPC) -> torch.Tensor:
    """Wait for a lookup; same value as :func:`ps_lookup`."""
    return get_client(pending.client).finish_lookup(pending.future, pending.server)


@has_side_effect
def ps_push(client: str, server: int, kjt: Any, fetched: torch.Tensor, after: Any = None) -> int:
    """Blocking push of ``fetched.grad`` to the server (``after``: a value that must exist first, e.g. the
    result of :func:`ps_backward`; it only orders the node). Returns the number of rows updated."""
    return get_client(client).push(server, kjt, fetched)


@has_side_effect
def ps_push_start(client: str, server: int, kjt: Any, fetched: torch.Tensor, after: Any = None,
                  next_kjt: Any = None) -> PendingRPC:
    """Start a push (``rpc_async``); finish it with :func:`ps_push_wait` or :func:`ps_push_defer`.

    ``next_kjt`` (not None): the same request prefetches the lookup of that next batch (the handle then
    completes with it; see ``PSClient.push_async``)."""
    return PendingRPC(get_client(client).push_async(server, kjt, fetched, next_kjt), client, server)


@has_side_effect
def ps_push_wait(pending: PendingRPC) -> int:
    """Wait for a push; returns the number of rows updated."""
    return get_client(pending.client).finish_push(pending.future, pending.server)


@has_side_effect
def ps_push_settle(pending: PendingRPC) -> int | None:
    """Wait for a push, or, when it also carries the next step's lookup, leave it in flight until that
    lookup is fetched (returns None then; see ``PSClient.settle_push``)."""
    return get_client(pending.client).settle_push(pending.future, pending.server)


@has_side_effect
def ps_push_defer(pending: PendingRPC) -> None:
    """Leave a push in flight; the client's next fetch from that server (or ``flush``) waits for it."""
    get_client(pending.client).defer_push(pending.server, pending.future)


class _PushInBackward:
    def __init__(self, client: str, server: int, kjt: Any, next_kjt: Any) -> None:
        self.client, self.server, self.kjt, self.next_kjt = client, server, kjt, next_kjt

    def __call__(self, grad: torch.Tensor) -> None:
        ps = get_client(self.client)
        ps.defer_push(self.server, ps.push_grad_async(self.server, self.kjt, grad, self.next_kjt))

    def after_accumulate(self, leaf: torch.Tensor) -> None:
        """As a leaf's post-accumulate-grad hook: push ``leaf.grad`` and drop it from the leaf. The gradient reaches
        ``.grad`` before the push holds it, so autograd stores it without a copy, even when the push is sent later
        by another thread (``scheduling.ps.transport.socket_transport.send_thread``)."""
        grad, leaf.grad = leaf.grad, None
        if grad is not None:
            self(grad)


@has_side_effect
def ps_push_in_backward(client: str, server: int, kjt: Any, part: torch.Tensor, next_kjt: Any = None,
                        ) -> torch.Tensor:
    """Push ``part``'s gradient to the server from an autograd hook, as soon as backward computes it;
    returns ``part`` (use the returned tensor downstream).

    The push stays in flight (``PSClient.defer_push``): the next fetch from that server (or ``flush``)
    waits for it, and the server applies it before any later request of this client, so training is as
    with blocking pushes. ``next_kjt`` (set by ``async_rpc(prefetch=True)``): the push also asks for that
    next batch's lookup (``PSClient.push_grad_async``).
    """
    if isinstance(part, torch.Tensor) and part.requires_grad:
        hook = _PushInBackward(client, server, kjt, next_kjt)
        if part.is_leaf:   # a lookup's answer: push what autograd stored in .grad
            part.register_post_accumulate_grad_hook(hook.after_accumulate)
        else:
            part.register_hook(hook)
        batcher = get_client(client).batcher
        if batcher is not None:  # the model's pushes to this server go as one message once all are queued
            batcher.expect(server)
    return part


@has_side_effect
def ps_prefetch(client: str, server: int, next_kjt: Any, max_staleness: int | None = None,
                after: Any = None) -> None:
    """Start the lookup of the next step's batch ``next_kjt`` (nothing when None); that step's
    :func:`ps_lookup_start` of the same object picks it up (see ``PSClient.prefetch``). ``after``: the
    handle of this step's push to the server, only ordering the node after it."""
    if next_kjt is not None:
        get_client(client).prefetch(server, next_kjt, max_staleness)


def ps_pool(client: str, kjt: Any, *parts: torch.Tensor) -> Any:
    """Per-server answers -> torchrec ``KeyedTensor`` ``(B, sum D)`` (see ``PSClient.pool``)."""
    return get_client(client).pool(kjt, parts)


@has_side_effect
def ps_backward(loss: torch.Tensor) -> torch.Tensor:
    """``loss.backward()``; returns ``loss.detach()`` (a token ordering the pushes after backward)."""
    loss.backward()
    return loss.detach()


@has_side_effect
def rpc_wait(future: torch.futures.Future) -> Any:
    """``future.wait()`` for a plain ``torch.distributed.rpc.rpc_async`` Future."""
    return future.wait()


fxdist.wrap("ps_lookup")
fxdist.wrap("ps_lookup_start")
fxdist.wrap("ps_lookup_wait")
fxdist.wrap("ps_push")
fxdist.wrap("ps_push_start")
fxdist.wrap("ps_push_wait")
fxdist.wrap("ps_push_settle")
fxdist.wrap("ps_push_defer")
fxdist.wrap("ps_push_in_backward")
fxdist.wrap("ps_prefetch")
fxdist.wrap("ps_pool")
fxdist.wrap("ps_backward")
fxdist.wrap("rpc_wait")
