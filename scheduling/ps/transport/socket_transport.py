"""The ``socket`` transport: one persistent TCP connection per (client process, server), tensors sent raw.

A lean alternative to ``torch_rpc`` (made because on 2 cores TensorPipe's request handling, I/O loop and
unpickling cost the server processes more CPU than the table work itself). A server
(:mod:`scheduling.ps.transport.socket_server`) listens on a TCP port; every :class:`SocketTransport` of a process shares
one connection to it (``TCP_NODELAY``), opened on the first request. A message (:mod:`scheduling.ps.transport.socket_wire`)
is a 16-byte header, the buffer lengths, the arguments pickled with protocol 5 and every dense CPU tensor in them
as a raw buffer, sent with ``sendmsg`` from the tensor's own memory and received with ``recv_into`` fresh
memory (``shm_arena.fresh_bytes``: no per-element work, no copy beyond the kernel's).

Where the server runs on the client's host, the connection also has a shared-memory arena
(:mod:`scheduling.ps.transport.shm_arena`; ``FXDIST_SOCKET_SHM_BYTES``, 0: off): a message whose buffers hold at least
512 KiB (a push's gradients) has them copied into it and sends their offsets instead (``socket_wire.SHM_DATA``);
a request carries a block for its answer (``SHM_REPLY``, sized by the method's last answer), into which the
server copies a large answer (a lookup's the client then uses where it lies, :data:`LENT_METHODS`; others it copies
out). Anything that does not fit goes inline.

A reader thread per connection matches answers to requests by id and completes their
``torch.futures.Future``. Pushes (:data:`BACKGROUND_METHODS`, sent from autograd hooks in backward) may be pickled
and sent by a sender thread of the connection instead of the calling thread (:func:`send_thread`): where the
trainer's main thread bounds the step (servers on cores of their own) that takes a push's pickling and its
``sendmsg`` off it (0.1-0.35 ms a step of a trainer's main thread at 26 tables x 128 ids x 16-64 floats,
``benchmarks/trainer_step.py``); every other request first sends the ones queued before it, so a connection's
requests leave in the order they were made. A process-wide watchdog thread fails the requests left unanswered after
their ``timeout_s``. The transport contract of :mod:`scheduling.ps.transport` holds: a request that cannot be sent
raises ``RuntimeError`` (a push left to the sender thread, from its ``wait()``); ``wait()`` raises a plain ``RuntimeError`` for a transport failure (timeout,
connection lost: a killed server fails its requests at once) and the server's own exception otherwise.

Each connection opens with the mutual handshake of :mod:`scheduling.ps.transport.auth`: the client proves it holds
the job key and refuses a server that does not (the key given to :func:`register_servers` for that address, else
the process's, ``auth.job_key()``; none: the connection is not opened). Requests that carry tables
(``configure``, ``load_state_dict``) are checked against the servers' frame limits before they leave.

Servers are named by ``"host:port"`` or by a name registered with :func:`register_servers` (clients given only
registered names pick this transport, :func:`scheduling.ps.transport.transport_of`).

Source: Python ``socket`` (``sendmsg``, ``recv_into``, ``TCP_NODELAY``); PEP 574 (pickle protocol 5,
out-of-band buffers); TensorPipe's ``shm`` channel for the arena.
"""

from __future__ import annotations

import collections
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import torch

from ..endpoints import METHODS
from . import auth
from .shm_arena import MIN_MESSAGE_BYTES, Arena, arena_bytes, block_bytes, hand_over
from .socket_wire import (
    ANSWER,
    ERROR,
    HEADER,
    REQUEST,
    SOCKET_BUFFER_BYTES,
    Frame,
    FrameLimits,
    Undecodable,
    dumps,
    recv_frame,
    recv_message,
    send_message,
    tune,
)
from .tls import job_tls, wrap_client

__all__ = ["SocketTransport", "WIRE_METHODS", "register_servers", "unregister_servers", "is_socket_server",
           "parse_address", "route_locally", "send_thread", "BACKGROUND_METHODS", "LENT_METHODS",
           # the wire (scheduling.ps.transport.socket_wire), re-exported
           "dumps", "send_message", "recv_message", "recv_frame", "Frame", "Undecodable", "tune",
           "SOCKET_BUFFER_BYTES", "REQUEST", "ANSWER", "ERROR"]

WIRE_METHODS = (*METHODS, "stop", "attach_shm")
"""Method numbers on the wire: the endpoints' requests, then ``stop`` (the server leaves its serving loop) and
``attach_shm`` (the server maps the client's shared-memory arena, :mod:`scheduling.ps.transport.shm_arena`)."""
_METHOD_NUMBERS = {m: i for i, m in enumerate(WIRE_METHODS)}
BACKGROUND_METHODS = frozenset({"push", "push_lookup", "batch"})
"""Requests a connection's sender thread may send (when :func:`send_thread` is on): a client's pushes, alone
(``push``), with the next lookup (``push_lookup``) or coalesced (``batch``); their arguments are fresh objects
the caller no longer changes."""
LENT_METHODS = frozenset({"lookup", "push_lookup", "batch"})
"""Requests whose answers, when they come through the shared-memory arena, are used where they lie instead of
copied out: lookups, whose rows the client pools into new tensors at once (or uses within the step)."""
_LENT_NUMBERS = frozenset(_METHOD_NUMBERS[m] for m in LENT_METHODS)
SEND_THREAD_MIN_CPUS = 8
"""``FXDIST_SOCKET_SEND_THREAD=auto`` (the default) turns the sender thread on where this process may run on at
least this many CPUs: a host with cores to spare beside its trainers and servers. Below it (2 cores shared by two
trainers and a server) the thread would only add a hand-over to the same CPU work."""


ATTACH_TIMEOUT_S = 5.0
"""Seconds each step of handing a connection's shared-memory arena to its server may take (or the request's
timeout, if shorter); a live server answers within milliseconds. Past it the connection stays inline and the arena
is unmapped."""


def send_thread() -> bool:
    """Whether this process's connections send pushes from a sender thread: ``FXDIST_SOCKET_SEND_THREAD`` =
    ``1`` (yes), ``0`` (no) or ``auto`` (the default: yes with at least :data:`SEND_THREAD_MIN_CPUS` CPUs
    available to the process, ``os.sched_getaffinity``). Read when a connection opens.

    Raises:
        ValueError: any other value of ``FXDIST_SOCKET_SEND_THREAD``.
    """
    value = os.environ.get("FXDIST_SOCKET_SEND_THREAD", "auto").strip().lower()
    if value in ("1", "0"):
        return value == "1"
    if value != "auto":
        raise ValueError(f"FXDIST_SOCKET_SEND_THREAD={value!r}: expected 1, 0 or auto")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cpus >= SEND_THREAD_MIN_CPUS


_ADDRESSES: dict[str, str] = {}
_ADDRESSES_LOCK = threading.Lock()
_KEYS: dict[str, bytes] = {}
"""``"host:port"`` -> the job key its server holds, where :func:`register_servers` was given one."""
_CHECKED_METHODS = frozenset({"configure", "load_state_dict"})
"""Requests that may carry whole tables: their size is checked against ``FrameLimits.from_env()`` before sending."""


_LOCAL: dict[str, Callable[[str, tuple], torch.futures.Future]] = {}
"""``"host:port"`` of a server this process hosts -> the function that calls it directly (:func:`route_locally`)."""


def route_locally(address: str, call: Callable[[str, tuple], torch.futures.Future] | None) -> None:
    """Send this process's requests to the server at ``address`` to ``call(method, args)`` (a Future of the
    answer, as ``call_async`` returns; e.g. :func:`scheduling.ps.in_trainers.call_local` of a server this
    process hosts) instead of over the socket; ``call=None`` ends that."""
    if call is None:
        _LOCAL.pop(address, None)
    else:
        _LOCAL[address] = call


def register_servers(addresses: Mapping[str, str], auth_key: bytes | None = None) -> None:
    """Let clients of this process name socket servers by name: ``{name: "host:port"}`` (later ones win);
    ``auth_key``: the job key those servers hold (None: the process's, :func:`scheduling.ps.transport.auth.job_key`).

    Raises:
        ValueError: an ``auth_key`` shorter than ``auth.MIN_KEY_BYTES``.
    """
    key = None if auth_key is None else auth.require_key(auth_key)
    with _ADDRESSES_LOCK:
        _ADDRESSES.update(addresses)
        for address in addresses.values():
            if key is not None:
                _KEYS[address] = key


def unregister_servers(names: Iterable[str]) -> None:
    """Forget the names (connections already open stay until their server closes them)."""
    with _ADDRESSES_LOCK:
        for name in names:
            _ADDRESSES.pop(name, None)


def is_socket_server(server: Any) -> bool:
    """Whether ``server`` is a name registered with :func:`register_servers`."""
    return isinstance(server, str) and server in _ADDRESSES


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``.

    Raises:
        ValueError: not ``host:port`` with an integer port.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"transport 'socket': server address {address!r} is not 'host:port' (nor a name "
                         f"registered with register_servers: {sorted(_ADDRESSES)})")
    return host, int(port)


# ---- the client side -------------------------------------------------------------------------------------------
class _Connection:
    """One TCP connection to a server: requests sent under a lock (pushes possibly by a sender thread, see
    :func:`send_thread`), answers read by a daemon thread."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address = address
        key = _KEYS.get(address) or auth.require_key()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tune(self.sock)  # before connecting: the receive window is agreed then
        try:
            self.sock.settimeout(timeout_s)
            self.sock.connect(parse_address(address))
            creds = job_tls()
            if creds is not None:   # TLS first: the handshake and every message inside it
                self.sock = wrap_client(self.sock, creds, min(timeout_s, auth.HANDSHAKE_TIMEOUT_S))
            auth.client_handshake(self.sock, key, min(timeout_s, auth.HANDSHAKE_TIMEOUT_S), address)
        except OSError as e:
            self.sock.close()
            raise RuntimeError(f"transport 'socket': cannot connect to server {address}: {e}") from e
        self.sock.settimeout(None)
        self.pending: dict[int, torch.futures.Future] = {}
        self.deadlines: dict[float, collections.deque[tuple[float, int]]] = {}   # per timeout: see _watch
        self.dead: str | None = None
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._outbox: collections.deque[tuple[int, int, str, tuple]] = collections.deque()  # (rid, number, method, args)
        self._outbox_wake = threading.Condition()
        self.background = send_thread()
        self.arena: Arena | None = None
        """The shared-memory arena the server mapped (same host), None: every message inline."""
        self._blocks: dict[int, list[int | None]] = {}   # request id -> [its buffers' arena block, its answer's]
        self._reply_bytes: dict[int, int] = {}    # method number -> the block its last answer took in the arena
        self.shm_requests = self.shm_answers = 0
        """Requests sent and answers read with their buffers in the arena."""
        self.attached: torch.futures.Future | None = None
        """The ``attach_shm`` request's Future (True: the server mapped the arena), None where none was sent."""
        threading.Thread(target=self._read, name=f"fxdist-socket-{address}", daemon=True).start()
        if self.background:
            threading.Thread(target=self._send_loop, name=f"fxdist-socket-send-{address}", daemon=True).start()
        self._attach_shm(timeout_s)

    def _attach_shm(self, timeout_s: float) -> None:
        """Where the server runs on this host: create an arena (an anonymous file whose size is sealed) and hand
        it to the server (``shm_arena.hand_over``: its descriptor over a Unix socket, never a name), without waiting
        (a server that is slow to answer, or busy, must not hold up this connection's first request): messages go
        inline until it is mapped. The last step's answer precedes the answers of every later request (the server
        installs the arena in its reader thread), and the reader thread, on reading it, sets ``arena``; where a
        step fails (refused, another host, past :data:`ATTACH_TIMEOUT_S`, the connection lost) the arena is
        closed and ``arena`` stays None (messages inline). ``attached``: a Future of the outcome (True: mapped;
        its ``wait()`` raises a RuntimeError saying why where a step failed).

        Raises:
            ValueError: ``FXDIST_SOCKET_SHM_BYTES`` is not a number of bytes.
        """
        nbytes = arena_bytes()
        try:
            same_host = self.sock.getpeername()[0] == self.sock.getsockname()[0]
        except OSError:
            same_host = False
        arena = Arena.create(nbytes) if nbytes and same_host else None
        if arena is None:
            return

        def installed(future: torch.futures.Future) -> bool:
            mapped = False
            try:
                mapped = future.value() is True and self.dead is None   # raises why it failed
            finally:
                if mapped:
                    self.arena = arena
                else:
                    arena.close()
            return mapped

        self.attached = hand_over(arena, self.call, min(timeout_s, ATTACH_TIMEOUT_S)).then(installed)

    def _send(self, number: int, rid: int, meta: bytes, buffers: Sequence[Any]) -> None:
        """Send request ``rid`` (call under ``_send_lock``): its buffers through the arena when they hold at least
        ``MIN_MESSAGE_BYTES`` and fit, with a block for the answer when the last answer of this method took one.

        Raises:
            OSError: the connection failed.
        """
        arena, placed, reply = self.arena, None, None
        if arena is not None and arena.ring is not None:
            lengths = [memoryview(b).nbytes for b in buffers]
            data = arena.ring.alloc(block_bytes(lengths)) if sum(lengths) >= MIN_MESSAGE_BYTES else None
            if data is not None:
                placed = arena.put(data, buffers)
                self.shm_requests += 1
            capacity = self._reply_bytes.get(number, 0)
            answer = arena.ring.alloc(capacity) if capacity else None
            if answer is not None:
                reply = (answer, capacity)
            if data is not None or answer is not None:
                self._blocks[rid] = [data, answer]   # before sending: the answer may come before sendmsg returns
        send_message(self.sock, REQUEST, number, rid, meta, buffers, placed=placed, reply=reply)

    def call(self, method: str, args: tuple, timeout_s: float) -> torch.futures.Future:
        number = _METHOD_NUMBERS.get(method)
        if number is None:
            raise ValueError(f"transport 'socket': unknown method {method!r} (known: {WIRE_METHODS})")
        future: torch.futures.Future = torch.futures.Future()
        if self.background and method in BACKGROUND_METHODS:   # pickled and sent by the sender thread
            rid = next(self._ids)
            self.pending[rid] = future
            with self._outbox_wake:
                self._outbox.append((rid, number, method, args))
                self._outbox_wake.notify()
            if self.dead is not None:   # failed before it could be sent (else _fail fails its Future)
                self.pending.pop(rid, None)
                raise RuntimeError(f"transport 'socket': sending {method} to server {self.address} failed: "
                                   f"{self.dead}")
            _watch(self, rid, timeout_s)
            return future
        meta, buffers = dumps(args)  # before the lock: pickling runs outside it
        if method in _CHECKED_METHODS:   # a clear error here rather than a connection the server drops
            try:
                FrameLimits.from_env().check_size(len(meta), [memoryview(b).nbytes for b in buffers])
            except ValueError as e:
                raise ValueError(f"transport 'socket': {method} to server {self.address}: {e}") from None
        rid = next(self._ids)
        self.pending[rid] = future
        try:
            if self.dead is not None:
                raise OSError(self.dead)
            with self._send_lock:
                self._send_outbox()   # the pushes queued before this request leave first
                self._send(number, rid, meta, buffers)
        except OSError as e:
            self.pending.pop(rid, None)
            self._fail(f"sending to server {self.address} failed: {e}")
            raise RuntimeError(f"transport 'socket': sending {method} to server {self.address} failed: {e}") from e
        _watch(self, rid, timeout_s)
        return future

    def _send_outbox(self) -> None:
        """Pickle and send the queued pushes, oldest first (call under ``_send_lock``). A push that does not pickle
        fails its own Future; a send that fails raises ``OSError`` (the caller fails the connection).

        Raises:
            OSError: the connection failed.
        """
        while self._outbox:
            rid, number, method, args = self._outbox.popleft()
            try:
                meta, buffers = dumps(args)
            except Exception as e:  # noqa: BLE001  (this request alone is lost: it fails, the connection goes on)
                future = self.pending.pop(rid, None)
                if future is not None and not future.done():
                    future.set_exception(RuntimeError(f"transport 'socket': {method} to server {self.address} "
                                                      f"could not be pickled: {type(e).__name__}: {e}"))
                continue
            self._send(number, rid, meta, buffers)

    def _send_loop(self) -> None:
        """The sender thread: sends what :meth:`call` queues until the connection fails."""
        while self.dead is None:
            with self._outbox_wake:
                while not self._outbox and self.dead is None:
                    self._outbox_wake.wait()
            try:
                with self._send_lock:
                    self._send_outbox()
            except Exception as e:  # noqa: BLE001  (OSError, or a message cut short: the connection is done)
                self._fail(f"sending to server {self.address} failed: {type(e).__name__}: {e}")

    def _read(self) -> None:
        header = bytearray(HEADER.size)
        try:
            while True:
                kind, method, rid, value, _, nbytes, shared = recv_frame(self.sock, header, self.arena, self._lent)
                if self.arena is not None:
                    self._release(rid, method, nbytes)
                    self.shm_answers += shared
                future = self.pending.pop(rid, None)
                if future is None:  # its wait ran out: dropped
                    continue
                if isinstance(value, Undecodable):
                    future.set_exception(RuntimeError(f"transport 'socket': the answer of server {self.address} "
                                                      f"could not be unpickled: {value.why}"))
                elif kind == ERROR:
                    future.set_exception(value)
                else:
                    future.set_result(value)
        except Exception as e:  # noqa: BLE001  (EOF, reset, a broken message: the connection is done)
            self._fail(f"connection to server {self.address} lost: {type(e).__name__}: {e}")
        finally:
            self.sock.close()

    def _lent(self, rid: int, method: int) -> int | None:
        """The answer block of request ``rid``, taken off its blocks, where its answer is a lookup's
        (:data:`LENT_METHODS`): the answer's tensors view the block and free it when they are gone
        (``Arena.lend``). Other answers (a ``state_dict`` one may keep for long, holding the ring) are copied out."""
        blocks = self._blocks.get(rid)
        if blocks is None or method not in _LENT_NUMBERS:
            return None
        answer, blocks[1] = blocks[1], None
        return answer

    def _release(self, rid: int, method: int, nbytes: int) -> None:
        """Request ``rid`` is answered: free its arena blocks but a lent answer block (the server read the
        request's when it came; an answer block it did not use is free again) and size the next answer block of
        ``method`` to this answer."""
        ring = cast(Any, cast(Arena, self.arena).ring)
        for first in self._blocks.pop(rid, ()):
            if first is not None:
                ring.free(first)
        self._reply_bytes[method] = nbytes if nbytes >= MIN_MESSAGE_BYTES else 0

    def _fail(self, why: str) -> None:
        """Mark the connection dead and fail every request still waiting on it (a plain RuntimeError)."""
        if self.dead is None:
            self.dead = why
        with self._outbox_wake:   # queued pushes are failed below with the rest; the sender thread ends
            self._outbox.clear()
            self._outbox_wake.notify()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for rid in list(self.pending):
            future = self.pending.pop(rid, None)
            if future is not None and not future.done():
                future.set_exception(RuntimeError(f"transport 'socket': {self.dead}"))

    def expire(self, rid: int, timeout_s: float) -> None:
        future = self.pending.pop(rid, None)
        if future is not None and not future.done():
            future.set_exception(RuntimeError(f"transport 'socket': no answer from server {self.address} within "
                                              f"{timeout_s} s"))


_CONNECTIONS: dict[str, _Connection] = {}
_CONNECTIONS_LOCK = threading.Lock()


def _connection(address: str, timeout_s: float) -> _Connection:
    """This process's connection to ``address``, opened (again, after it failed) when needed.

    Raises:
        RuntimeError: the server cannot be reached.
    """
    conn = _CONNECTIONS.get(address)
    if conn is not None and conn.dead is None:
        return conn
    with _CONNECTIONS_LOCK:
        conn = _CONNECTIONS.get(address)
        if conn is None or conn.dead is not None:
            conn = _CONNECTIONS[address] = _Connection(address, timeout_s)
        return conn


# ---- timeouts: one watchdog thread per process ------------------------------------------------------------------
_QUEUES: list[tuple[_Connection, float, collections.deque[tuple[float, int]]]] = []
"""Per connection and timeout: its requests' ``(deadline, request id)`` in the order sent (so deadlines ascend); the
watchdog drops the answered ones when it next looks."""
_WAKE = threading.Condition()
_WATCHDOG: list[threading.Thread] = []


def _watch(conn: _Connection, rid: int, timeout_s: float) -> None:
    """Fail request ``rid`` of ``conn`` unless answered within ``timeout_s`` seconds: one append to its queue (no lock);
    the watchdog is woken only when the queue was empty, as it may sleep past this deadline then."""
    queue = conn.deadlines.get(timeout_s)
    if queue is None:
        queue = _new_queue(conn, timeout_s)
    queue.append((time.monotonic() + timeout_s, rid))
    if len(queue) == 1:
        with _WAKE:
            _start_watchdog()
            _WAKE.notify()


def _new_queue(conn: _Connection, timeout_s: float) -> collections.deque[tuple[float, int]]:
    with _WAKE:
        queue = conn.deadlines.get(timeout_s)
        if queue is None:
            queue = conn.deadlines[timeout_s] = collections.deque()
            _QUEUES.append((conn, timeout_s, queue))
        return queue


def _start_watchdog() -> None:
    """Start the watchdog unless it runs (call under ``_WAKE``)."""
    if not _WATCHDOG or not _WATCHDOG[0].is_alive():
        _WATCHDOG[:] = [threading.Thread(target=_expire_loop, name="fxdist-socket-watchdog", daemon=True)]
        _WATCHDOG[0].start()


def _due(now: float) -> tuple[list[tuple[_Connection, int, float]], float | None]:
    """The requests past their deadline (taken off their queues, with the answered ones before them) and the earliest
    deadline left (None: nothing waits). Call under ``_WAKE``."""
    due, earliest = [], None
    for entry in list(_QUEUES):
        conn, timeout_s, queue = entry
        while queue and (queue[0][1] not in conn.pending or queue[0][0] <= now):
            deadline, rid = queue.popleft()
            if deadline <= now and rid in conn.pending:
                due.append((conn, rid, timeout_s))
        if queue:
            earliest = queue[0][0] if earliest is None else min(earliest, queue[0][0])
        elif conn.dead is not None:   # a failed connection takes no more requests
            _QUEUES.remove(entry)
            conn.deadlines.pop(timeout_s, None)
    return due, earliest


def _expire_loop() -> None:
    while True:
        with _WAKE:
            while True:
                now = time.monotonic()
                due, earliest = _due(now)
                if due:
                    break
                _WAKE.wait(None if earliest is None else earliest - now)
        for conn, rid, timeout_s in due:
            conn.expire(rid, timeout_s)


class SocketTransport:
    """Requests over this process's connections to socket servers (:mod:`scheduling.ps.transport.socket_server`).

    Args:
        servers: ``"host:port"`` addresses or names registered with :func:`register_servers`.

    Raises:
        ValueError: a server that is neither a registered name nor ``host:port``.
    """

    name = "socket"

    def __init__(self, servers: Sequence[Any]) -> None:
        self.names = list(servers)
        self.addresses: list[str] = []
        for s in servers:
            address = _ADDRESSES.get(s, s) if isinstance(s, str) else s
            if not isinstance(address, str):
                raise ValueError(f"transport 'socket': servers are 'host:port' addresses or registered names, "
                                 f"got {s!r}")
            parse_address(address)
            self.addresses.append(address)

    def call_async(self, server: int, method: str, args: tuple, timeout_s: float) -> torch.futures.Future:
        """Send ``method(*args)`` to server ``server``: a Future of its answer (``wait()`` raises the server's
        exception, or a plain RuntimeError for a transport failure).

        A server this process hosts (:func:`route_locally`) is called directly, without the socket.

        Raises:
            RuntimeError: the server cannot be reached or the request not sent.
        """
        address = self.addresses[server]
        local = _LOCAL.get(address)
        if local is not None:
            return local(method, args)
        return _connection(address, timeout_s).call(method, args, timeout_s)

    def stop(self, timeout_s: float, names: Sequence[str] | None = None) -> None:
        """Ask every server (or those of ``names``) to leave its serving loop; best effort."""
        futures = []
        for name, address in zip(self.names, self.addresses):
            if names is None or name in names:
                try:
                    futures.append(_connection(address, timeout_s).call("stop", (), timeout_s))
                except RuntimeError:
                    pass
        for future in futures:
            try:
                future.wait()
            except RuntimeError:
                pass
