"""One message per server for the pushes of a whole model: the clients of one ``parameter_servers`` pass share a
:class:`PushBatcher`.

A model with many embedding modules has one client per module, and each pushes its gradient (with
``async_rpc_prefetch``: and asks for the next batch's lookup) from an autograd hook: 53 modules sent 53
messages per step to their servers, and the trainer spent more time sending them (about 0.55 ms each here) than
computing. The batcher queues those pushes per server instead, and sends each server's queue as one ``batch``
request (:meth:`scheduling.ps.endpoints.ServerEndpoints.submit_batch`) as soon as:

- every push registered for that server in this step's forward is queued (:meth:`PushBatcher.expect` counts
  them as ``ps_push_in_backward`` registers its hooks), or
- backward ends (an autograd engine callback), for pushes whose gradient never came, or
- anything waits for one of them (the next lookup of that server, ``flush``).

Each request in a batch keeps its own client's sequence number and step order (:mod:`scheduling.ps.ordering`),
so the servers apply them exactly as if they came one by one; training is unchanged. Errors keep their class:
a failed message fails every request it carried with the transport's ``RuntimeError``; a request the server
refuses raises its own exception.

Source: the gradient buckets of PyTorch's ``DistributedDataParallel`` (one collective for many parameters,
launched when the bucket is full) and torchrec's one KJT per rank.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PushBatcher", "Queued"]


class _Failed:
    """A message that could not be sent: waited like a Future, raises the transport's error."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def wait(self) -> Any:
        raise self.error

    def done(self) -> bool:
        return True


class Queued:
    """A request in a :class:`PushBatcher` queue, waited like a ``torch.futures.Future``; waiting sends its
    server's queue if it is not sent yet."""

    def __init__(self, batcher: "PushBatcher", server: int) -> None:
        self.batcher, self.server = batcher, server
        self.message: Any = None
        self.index = -1
        self._callbacks: list[Callable[[Any], None]] = []

    def _sent(self, message: Any, index: int) -> None:
        self.message, self.index = message, index
        for callback in self._callbacks:
            self._attach(callback)

    def _attach(self, callback: Callable[[Any], None]) -> None:
        if hasattr(self.message, "add_done_callback"):
            self.message.add_done_callback(lambda _: callback(self))

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        """``callback(self)`` once the answer is here (a transport without callbacks: never; wait instead)."""
        if self.message is None:
            self._callbacks.append(callback)
        else:
            self._attach(callback)

    def wait(self) -> Any:
        """The server's answer to this request.

        Raises:
            RuntimeError: the message failed (transport); the server's exception for this request otherwise.
        """
        if self.message is None:
            self.batcher.send(self.server)
        if self.message is None:  # dropped unsent (its clients closed without flushing)
            raise RuntimeError(f"a queued request to server {self.server} was dropped before it was sent")
        value, error = self.message.wait()[self.index]
        if error is not None:
            raise error
        return value

    value = wait

    def done(self) -> bool:
        return self.message is not None and self.message.done()


class PushBatcher:
    """Per server, the pushes queued by the clients that share it, sent as one ``batch`` request (see the
    module docstring).

    Args:
        transport: how to reach the servers (a client's :mod:`scheduling.ps.transport`; every client sharing
            the batcher names the same servers in the same order).
        timeout_s: the message's RPC timeout, in seconds.
    """

    def __init__(self, transport: Any, timeout_s: float) -> None:
        self.transport, self.timeout_s = transport, timeout_s
        self._queues: dict[int, list[tuple[str, tuple, Queued]]] = collections.defaultdict(list)
        self._pending: collections.Counter[int] = collections.Counter()  # hooks registered, push not queued yet
        self._lock = threading.Lock()
        self._callback_queued = False
        self.messages = 0
        """Batch messages sent so far."""

    def expect(self, server: int) -> None:
        """One more push to ``server`` will come in this step's backward (a hook was registered)."""
        with self._lock:
            self._pending[server] += 1

    def enqueue(self, server: int, method: str, args: tuple) -> Queued:
        """Queue request ``method(*args)`` (numbered by its client already) for ``server``; sends the queue when
        it holds every push this step expects."""
        handle = Queued(self, server)
        with self._lock:
            self._queues[server].append((method, args, handle))
            full = self._pending[server] == 1          # the last push this step expects for the server
            self._pending[server] = max(0, self._pending[server] - 1)
            register = not self._callback_queued
            self._callback_queued = True
        if register:
            try:  # inside backward: send the rest when it ends
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            except RuntimeError:  # not in a backward pass (a push from a graph node): waiting sends it
                with self._lock:
                    self._callback_queued = False
        if full:
            self.send(server)
        return handle

    def _backward_done(self) -> None:
        with self._lock:
            self._callback_queued = False
            self._pending.clear()   # a hook that did not fire in this backward will not fire
        self.send_all()

    def send(self, server: int) -> None:
        """Send ``server``'s queue as one message (nothing when empty)."""
        with self._lock:
            items = self._queues.pop(server, [])
            if not items:
                return
            calls = [(method, args) for method, args, _ in items]
            try:
                message = self.transport.call_async(server, "batch", (calls,), self.timeout_s)
            except RuntimeError as e:
                message = _Failed(e)
            self.messages += 1
        for index, (_, _, handle) in enumerate(items):
            handle._sent(message, index)

    def send_all(self) -> None:
        """Send every server's queue."""
        with self._lock:
            servers = list(self._queues)
        for server in servers:
            self.send(server)

    def drop(self) -> None:
        """Forget everything queued (the clients are closing without waiting)."""
        with self._lock:
            self._queues.clear()
            self._pending.clear()
