"""The requests a parameter server answers, whatever transport carries them.

:class:`ServerEndpoints` holds one :class:`~scheduling.ps.server.PSServer` and has one method per request
(``configure``, ``lookup``, ``peek``, ``push``, ``push_lookup``, ``batch``, ``state_dict``,
``load_state_dict``, ``save``, ``set_delays``, ``stats``, ``dynamic_stats``, and the checkpoints by shard
``save_shards``, ``save_status``, ``load_shards``: :mod:`scheduling.ps.dcp_shards`); ``batch`` carries several ordered
requests in one message (a client's coalesced pushes, :mod:`scheduling.ps.coalesce`); ``peek`` is a read-only lookup
(:mod:`scheduling.ps.peek`: no step of a dynamic table); ``dynamic_stats`` answers a namespace's dynamic tables'
counters alone. The ordered ones (``lookup``, ``peek``, ``push``, ``push_lookup``) apply the request order the
client asked for (:mod:`scheduling.ps.ordering`; a lookup's place among the group's lookups, rule 3, only where it
steps a dynamic table: a peek, or a lookup of a namespace with no dynamic table here, drops it), so the tables, the
optimizer, the step order and the fused path are the same on every transport; :meth:`ServerEndpoints.submit` starts one without waiting
for its turn, so that a waiting request holds none of the server's threads:

- ``torch_rpc``: the module-level ``_rpc_<method>`` functions of :mod:`scheduling.ps.server` call the
  process-wide endpoints (:func:`scheduling.ps.start_server` sets their server); the ordered ones are
  ``async_execution`` functions answering with a ``torch.futures.Future``;
- ``ray``: :class:`AsyncEndpoints` is the Ray actor (:mod:`scheduling.ps.transport.ray_transport`), an asyncio actor
  whose ordered requests are coroutines; a client calls ``handle.lookup.remote(...)`` and waits with
  ``ray.get``.

Both transports start the ordered requests here (``_ordered``, ``_submit``), which keep the server's own
statistics (``PSServer.stats``, :mod:`scheduling.ps.server_stats`): each lookup and push is timed, and each
request counts as pending until it is answered.

Source: torch.fx paper §6.2.3 (parameter-server fetches); Ray actors (a class whose methods are the calls;
AsyncIO actors); ``torch.distributed.rpc.functions.async_execution``.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from .ordering import Done, Order, in_order, submit, without_index
from .peek import peek
from .server_stats import dynamic_stats

__all__ = ["Endpoints", "ServerEndpoints", "AsyncEndpoints", "METHODS", "DEFAULT_WORKER_THREADS"]

DEFAULT_WORKER_THREADS = 16
"""Threads that serve one server's requests unless told otherwise (``num_worker_threads``)."""

METHODS = ("configure", "lookup", "peek", "push", "push_lookup", "batch", "state_dict", "load_state_dict", "save",
           "set_delays", "stats", "dynamic_stats", "changes", "save_shards", "save_status", "load_shards")
"""The requests every transport carries (``PSClient`` calls only these)."""


class Endpoints:
    """The request handlers of one parameter server that both transports share (``server``: a ``PSServer``,
    or None before one runs): ordered requests start through one callback (:meth:`submit`,
    :meth:`submit_batch`); :class:`ServerEndpoints` answers them blocking (``torch_rpc``),
    :class:`AsyncEndpoints` awaited (a Ray asyncio actor).

    Raises (every method): RuntimeError when no server runs here yet.
    """

    def __init__(self, server: Any = None) -> None:
        self.server = server
        self.requests = 0
        """Requests received (a ``batch`` counts once, whatever it carries)."""
        self.why_none = "call start_server() first"
        """What the error says when no server runs (a restarted Ray actor: it lost its tables)."""

    def _server(self) -> Any:
        if self.server is None:  # a RuntimeError: clients report the server as unavailable
            raise RuntimeError(f"no parameter server runs in process {os.getpid()}; {self.why_none}")
        return self.server

    def configure(self, *args: Any, **kwargs: Any) -> dict[str, int]:
        """``PSServer.configure``: create the namespace's shards."""
        return self._server().configure(*args, **kwargs)

    ORDERED = ("lookup", "peek", "push", "push_lookup")
    """The requests that follow the client's order (:mod:`scheduling.ps.ordering`) and may wait for it."""

    def _ordered(self, method: str, args: tuple) -> tuple[Order | None, str, str, Any, Any]:
        """``(order, what, server name, push, lookup)`` of one ordered request ``method(*args)``."""
        server = self._server()
        timed = server.stats.timed  # the work's seconds, per request (scheduling.ps.server_stats)
        if method == "lookup":
            namespace, batch, compress, order = _pad(args, 4)
            order = order if namespace in server.dynamic_namespaces else without_index(order)
            return (order, "lookup", server.name, None,
                    timed("lookup", namespace, lambda: server.lookup(namespace, batch, compress)))
        if method == "peek":  # a read-only lookup, ordered as one
            namespace, batch, compress, order = _pad(args, 4)
            return without_index(order), "peek", server.name, None, timed("lookup", namespace, lambda: peek(server, namespace, batch, compress))
        if method == "push":
            namespace, batch, grad, order = _pad(args, 4)
            return order, "push", server.name, timed("push", namespace, lambda: server.push(namespace, batch, grad)), None
        if method == "push_lookup":
            namespace, batch, grad, next_batch, compress, order = _pad(args, 6)
            order = order if namespace in server.dynamic_namespaces else without_index(order)
            return (order, "push+lookup", server.name, timed("push", namespace, lambda: server.push(namespace, batch, grad)),
                    timed("lookup", namespace, lambda: server.lookup(namespace, next_batch, compress)))
        raise ValueError(f"ServerEndpoints: {method!r} is not an ordered request (one of {self.ORDERED})")

    def submit(self, method: str, args: tuple, done: Done) -> None:
        """Start the ordered request ``method(*args)`` (one of :attr:`ORDERED`) without waiting for its turn:
        ``done(answer, None)`` or ``done(None, error)`` reports it, maybe later from another thread
        (:func:`scheduling.ps.ordering.submit`). A request that waits holds no thread.

        Raises:
            RuntimeError: no server runs here (raised here, before anything is started).
        """
        self.requests += 1
        self._submit(method, args, done)

    def _submit(self, method: str, args: tuple, done: Done) -> None:
        order, what, name, push, lookup = self._ordered(method, args)
        submit(order, what, name, self.server.stats.track(done), push=push, lookup=lookup)  # pending until done

    def submit_batch(self, calls: list[tuple[str, tuple]], done: Done) -> None:
        """Start every ordered request ``(method, args)`` of ``calls``, in order (each in its own client's
        order, as if sent one by one); ``done([(answer, error), ...], None)`` once all are answered, one pair
        per call (``error`` None, or the exception that call raised)."""
        self.requests += 1
        answers: list[Any] = [None] * len(calls)
        left = [len(calls)]
        lock = threading.Lock()
        if not calls:
            done([], None)
            return

        def one(i: int, value: Any, error: BaseException | None) -> None:
            answers[i] = (value, error)
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                done(answers, None)

        for i, (method, args) in enumerate(calls):
            try:
                self._submit(method, args, functools.partial(one, i))
            except Exception as e:  # noqa: BLE001  (answered as that call's error, the others go on)
                one(i, None, e)

    def state_dict(self, namespace: str | None = None) -> dict[str, Any]:
        """``PSServer.state_dict`` (copies of the shards)."""
        return self._server().state_dict(namespace)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``PSServer.load_state_dict``."""
        self._server().load_state_dict(state)

    def save(self, directory: str) -> str:
        """``PSServer.save``: ``<directory>/<name>.pt``; returns the path."""
        return self._server().save(directory)

    def save_shards(self, namespace: str, directory: str, paths: dict[str, str]) -> dict[str, Any]:
        """``PSServer.save_shards``: copy this server's shards of ``namespace``, answer, write them (DCP) on a
        background thread."""
        return self._server().save_shards(namespace, directory, paths)

    def save_status(self, namespace: str, directory: str, wait: bool = True) -> dict[str, Any] | None:
        """``PSServer.save_status``: that write's report (None while it runs and ``wait`` is False)."""
        return self._server().save_status(namespace, directory, wait)

    def load_shards(self, namespace: str, directory: str, paths: dict[str, str]) -> dict[str, int]:
        """``PSServer.load_shards``: fill this server's shards of ``namespace`` from a DCP checkpoint folder."""
        return self._server().load_shards(namespace, directory, paths)

    def changes(self, namespace: str, start: bool = False) -> dict[str, Any]:
        """The rows this server changed in ``namespace``'s tables since the last call, then cleared
        (:func:`scheduling.ps.changes.take_changes`); ``start``: start (or restart) recording them instead and
        answer ``{}`` (:func:`scheduling.ps.changes.start_tracking`)."""
        from .changes import start_tracking, take_changes

        server = self._server()
        if start:
            start_tracking(server, namespace)
            return {}
        return take_changes(server, namespace)

    def set_delays(self, fetch_delay_s: float, push_delay_s: float) -> None:
        """Added latency per lookup / push, seconds."""
        server = self._server()
        server.fetch_delay_s, server.push_delay_s = fetch_delay_s, push_delay_s

    def stats(self) -> dict[str, int]:
        """Lookups and pushes served, process id, rows and bytes held."""
        server = self._server()
        return {"lookups": server.num_lookups, "pushes": server.num_pushes, "requests": self.requests,
                "pid": os.getpid(), **server.memory()}

    def dynamic_stats(self, namespace: str) -> dict[str, dict[str, int]]:
        """Per dynamic table of ``namespace`` held here, its counters
        (:func:`scheduling.ps.server_stats.dynamic_stats`): a stats-only request, no copy of the tables."""
        return dynamic_stats(self._server(), namespace)


class ServerEndpoints(Endpoints):
    """:class:`Endpoints` answering the ordered requests blocking (the ``torch_rpc`` server's handlers).

    Raises (every method): RuntimeError when no server runs here yet.
    """

    def lookup(self, namespace: str, batch: Any, compress: str | None = None, order: Order | None = None,
               ) -> torch.Tensor:
        """Pooled sums ``(B, D_s)`` of the batch, in the request order ``order`` asks for (blocking)."""
        return self._blocking("lookup", (namespace, batch, compress, order))

    def peek(self, namespace: str, batch: Any, compress: str | None = None, order: Order | None = None,
             ) -> torch.Tensor:
        """As :meth:`lookup`, read-only (:func:`scheduling.ps.peek.peek`: no step of a dynamic table)."""
        return self._blocking("peek", (namespace, batch, compress, order))

    def push(self, namespace: str, batch: Any, grad: torch.Tensor, order: Order | None = None) -> int:
        """Apply ``grad`` ``(B, D_s)``; returns the rows updated (blocking)."""
        return self._blocking("push", (namespace, batch, grad, order))

    def push_lookup(self, namespace: str, batch: Any, grad: torch.Tensor, next_batch: Any,
                    compress: str | None = None, order: Order | None = None) -> tuple[int, torch.Tensor]:
        """A push, then the lookup of the next batch, in one request: ``(rows updated, lookup answer)``
        (blocking)."""
        return self._blocking("push_lookup", (namespace, batch, grad, next_batch, compress, order))

    def _blocking(self, method: str, args: tuple) -> Any:
        order, what, name, push, lookup = self._ordered(method, args)
        return in_order(order, what, name, push=push, lookup=lookup)


class AsyncEndpoints(Endpoints):
    """:class:`Endpoints` for an asyncio actor (a Ray actor with ``async`` methods): an ordered request
    is a coroutine that awaits its result, so a request waiting for its turn holds no thread and takes no
    slot of a thread pool; the work itself (tables, optimizer) runs on ``num_worker_threads`` threads of this
    process, never on the event loop. The other requests (``configure``, ``state_dict``...) are plain methods.

    Raises:
        ValueError: ``num_worker_threads`` < 1.
    """

    def __init__(self, server: Any = None, num_worker_threads: int = DEFAULT_WORKER_THREADS) -> None:
        super().__init__(server)
        if num_worker_threads < 1:
            raise ValueError(f"num_worker_threads must be >= 1, got {num_worker_threads}")
        self.num_worker_threads = num_worker_threads
        self._pool: Any = None

    def _submit(self, method: str, args: tuple, done: Done) -> None:
        """As :meth:`ServerEndpoints._submit`, but the work runs on this actor's ``num_worker_threads`` threads,
        never on the event loop (a request waiting for its turn holds none of them)."""
        from concurrent.futures import ThreadPoolExecutor

        order, what, name, push, lookup = self._ordered(method, args)  # raises here when no server runs
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_worker_threads, thread_name_prefix=f"ps-{name}")
        self._pool.submit(submit, order, what, name, self.server.stats.track(done), push=push, lookup=lookup)

    async def _answer(self, start: Callable[[Done], None]) -> Any:
        """Await the answer that ``start(done)`` reports through its callback (from any thread)."""
        import asyncio

        loop = asyncio.get_running_loop()
        answer = loop.create_future()

        def done(value: Any, error: BaseException | None) -> None:
            loop.call_soon_threadsafe(_settle, answer, value, error)

        start(done)
        return await answer

    async def _await(self, method: str, args: tuple) -> Any:
        self.requests += 1
        return await self._answer(functools.partial(self._submit, method, args))

    async def batch(self, calls: list[tuple[str, tuple]]) -> list[tuple[Any, BaseException | None]]:
        """:meth:`ServerEndpoints.submit_batch` (the same callback as the ``torch_rpc`` transport's), awaited:
        ``[(answer, error), ...]``, one pair per call."""
        return await self._answer(functools.partial(self.submit_batch, calls))

    async def lookup(self, namespace: str, batch: Any, compress: str | None = None,
                     order: Order | None = None) -> torch.Tensor:
        """As :meth:`ServerEndpoints.lookup`, awaited."""
        return await self._await("lookup", (namespace, batch, compress, order))

    async def peek(self, namespace: str, batch: Any, compress: str | None = None,
                   order: Order | None = None) -> torch.Tensor:
        """As :meth:`ServerEndpoints.peek`, awaited."""
        return await self._await("peek", (namespace, batch, compress, order))

    async def push(self, namespace: str, batch: Any, grad: torch.Tensor,
                   order: Order | None = None) -> int:
        """As :meth:`ServerEndpoints.push`, awaited."""
        return await self._await("push", (namespace, batch, grad, order))

    async def push_lookup(self, namespace: str, batch: Any, grad: torch.Tensor,
                          next_batch: Any, compress: str | None = None,
                          order: Order | None = None) -> tuple[int, torch.Tensor]:
        """As :meth:`ServerEndpoints.push_lookup`, awaited."""
        return await self._await("push_lookup", (namespace, batch, grad, next_batch, compress, order))


def _settle(answer: Any, value: Any, error: BaseException | None) -> None:
    if answer.cancelled():
        return
    if error is not None:
        answer.set_exception(error)
    else:
        answer.set_result(value)


def _pad(args: tuple, n: int) -> tuple:
    """Positional arguments with the trailing defaults (None) filled in."""
    if len(args) > n:
        raise TypeError(f"expected at most {n} arguments, got {len(args)}")
    return (*args, *([None] * (n - len(args))))
