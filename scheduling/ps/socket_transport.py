"""The ``socket`` transport: one persistent TCP connection per (client process, server), tensors sent raw.

A lean alternative to ``torch_rpc`` (issue 32: on 2 cores TensorPipe's request handling, I/O loop and
unpickling cost the server processes more CPU than the table work itself). A server
(:mod:`scheduling.ps.socket_server`) listens on a TCP port; every :class:`SocketTransport` of a process shares
one connection to it (``TCP_NODELAY``), opened on the first request. A message is

- a 16-byte header ``<BBHIQ``: kind (request, answer, error), method (index in :data:`WIRE_METHODS`), the
  number ``n`` of raw buffers, the length of the metadata, the request id;
- ``n`` buffer lengths (``<nQ``), then the metadata: the arguments (or the answer, or the server's exception)
  pickled with protocol 5, every dense CPU tensor replaced by an out-of-band buffer (:func:`dumps`);
- the ``n`` buffers, each a tensor's bytes, sent with ``sendmsg`` from the tensor's own memory and received
  with ``recv_into`` a fresh ``torch.empty`` (no per-element work, no copy beyond the kernel's).

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

Servers are named by ``"host:port"`` or by a name registered with :func:`register_servers` (clients given only
registered names pick this transport, :func:`scheduling.ps.transport.transport_of`).

Source: Python ``socket`` (``sendmsg``, ``recv_into``, ``TCP_NODELAY``); PEP 574 (pickle protocol 5,
out-of-band buffers).
"""

from __future__ import annotations

import collections
import copyreg
import io
import itertools
import os
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import torch

from .endpoints import METHODS

__all__ = ["SocketTransport", "WIRE_METHODS", "register_servers", "unregister_servers", "is_socket_server",
           "dumps", "send_message", "recv_message", "Undecodable", "tune", "SOCKET_BUFFER_BYTES", "parse_address", "REQUEST", "ANSWER", "ERROR",
           "route_locally", "send_thread", "BACKGROUND_METHODS"]

WIRE_METHODS = (*METHODS, "stop")
"""Method numbers on the wire: the endpoints' requests, then ``stop`` (the server leaves its serving loop)."""
_METHOD_NUMBERS = {m: i for i, m in enumerate(WIRE_METHODS)}
REQUEST, ANSWER, ERROR = 0, 1, 2
"""Message kinds: a request; its answer; the server's exception instead of an answer."""
_HEADER = struct.Struct("<BBHIQ")
_MAX_IOV = 512  # buffers per sendmsg call (the kernel's IOV_MAX is 1024)
SOCKET_BUFFER_BYTES = 4 << 20
"""Send and receive buffer of every connection (``SO_SNDBUF``/``SO_RCVBUF``): a few steps' messages, so that a
sender rarely waits in ``sendmsg`` for the other side to read (the kernel may cap it: ``net.core.wmem_max``)."""


BACKGROUND_METHODS = frozenset({"push", "push_lookup", "batch"})
"""Requests a connection's sender thread may send (when :func:`send_thread` is on): a client's pushes, alone
(``push``), with the next lookup (``push_lookup``) or coalesced (``batch``); their arguments are fresh objects
the caller no longer changes."""
SEND_THREAD_MIN_CPUS = 8
"""``FXDIST_SOCKET_SEND_THREAD=auto`` (the default) turns the sender thread on where this process may run on at
least this many CPUs: a host with cores to spare beside its trainers and servers. Below it (2 cores shared by two
trainers and a server) the thread would only add a hand-over to the same CPU work."""


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


def tune(sock: socket.socket) -> None:
    """``TCP_NODELAY`` and :data:`SOCKET_BUFFER_BYTES` buffers on ``sock`` (a listener: before ``listen``)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)

_ADDRESSES: dict[str, str] = {}
_ADDRESSES_LOCK = threading.Lock()


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


def register_servers(addresses: Mapping[str, str]) -> None:
    """Let clients of this process name socket servers by name: ``{name: "host:port"}`` (later ones win)."""
    with _ADDRESSES_LOCK:
        _ADDRESSES.update(addresses)


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


# ---- the wire: pickle protocol 5 with tensors out of band -----------------------------------------------------
def _rebuild(buffer: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over the received bytes ``buffer`` (uint8, its own memory): no copy."""
    return buffer.view(dtype).view(shape)


def _reduce_tensor(t: torch.Tensor) -> Any:
    if type(t) is torch.Tensor:   # the usual case, a plain dense CPU tensor: its memory through numpy, no view ops
        try:
            array = t.detach().numpy()   # refuses other devices and layouts, quantized, conj/neg views, bfloat16
        except (RuntimeError, TypeError):
            array = None
        if array is not None and array.flags.c_contiguous:
            return _rebuild, (pickle.PickleBuffer(cast(Any, array)), t.dtype, tuple(t.shape))
    if t.layout is not torch.strided or t.is_quantized or t.device.type == "meta":
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)  # rare: torch's own (in-band) pickling
    flat = t.detach()
    if flat.device.type != "cpu" or flat.is_conj() or flat.is_neg() or not flat.is_contiguous():  # else: no copy
        flat = flat.cpu().resolve_conj().resolve_neg().contiguous()
    flat = flat.view(-1).view(torch.uint8)
    return _rebuild, (pickle.PickleBuffer(cast(Any, flat.numpy())), t.dtype, tuple(t.shape))


class _Pickler(pickle.Pickler):
    dispatch_table = {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}


def dumps(obj: Any) -> tuple[bytes, list[Any]]:
    """``(metadata, buffers)``: ``obj`` pickled (protocol 5), each plain ``torch.Tensor`` in it as one raw buffer
    (its bytes, a view of the tensor's memory when it is contiguous on the CPU)."""
    buffers: list[Any] = []
    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=lambda b: buffers.append(b.raw())).dump(obj)
    return out.getvalue(), buffers


def send_message(sock: socket.socket, kind: int, method: int, rid: int, meta: bytes, buffers: Sequence[Any]) -> None:
    """Send one message (header, buffer lengths, metadata, buffers) with ``sendmsg``, however many calls it takes.

    Raises:
        OSError: the connection failed.
    """
    lengths = [memoryview(b).nbytes for b in buffers]
    parts = [memoryview(_HEADER.pack(kind, method, len(buffers), len(meta), rid) + struct.pack(f"<{len(buffers)}Q", *lengths)
                        + meta)]
    parts += [memoryview(b).cast("B") for b, n in zip(buffers, lengths) if n]
    while parts:
        sent = sock.sendmsg(parts[:_MAX_IOV])
        while parts and sent >= parts[0].nbytes:
            sent -= parts[0].nbytes
            parts.pop(0)
        if sent:
            parts[0] = parts[0][sent:]


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, size = 0, view.nbytes
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("connection closed by the peer")
        got += n


def _recv_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view of ``views`` from the stream, in order: one ``recvmsg_into`` call when the bytes are there
    (a scatter read), else as many as it takes."""
    i = 0
    while i < len(views):
        n = sock.recvmsg_into(views[i:i + _MAX_IOV])[0]
        if n == 0:
            raise ConnectionError("connection closed by the peer")
        while i < len(views) and n >= views[i].nbytes:
            n -= views[i].nbytes
            i += 1
        if n:
            views[i] = views[i][n:]


def recv_message(sock: socket.socket, header: bytearray) -> tuple[int, int, int, Any]:
    """Receive one message: ``(kind, method, request id, the unpickled object)``; tensors land in fresh memory
    (a ``torch.empty`` each, all filled by one scatter read). ``header``: a reusable ``bytearray`` of the
    header's size.

    Raises:
        ConnectionError: the peer closed the connection; OSError: it failed.
    """
    _recv_into(sock, memoryview(header))
    kind, method, count, meta_len, rid = _HEADER.unpack(header)
    head = bytearray(8 * count + meta_len)
    _recv_into(sock, memoryview(head))
    lengths = struct.unpack_from(f"<{count}Q", head)
    buffers = [torch.empty(n, dtype=torch.uint8) for n in lengths]
    _recv_all(sock, [memoryview(cast(Any, b.numpy())) for b, n in zip(buffers, lengths) if n])
    try:
        value = pickle.loads(memoryview(head)[8 * count:], buffers=buffers)
    except Exception as e:  # noqa: BLE001  (the message was read whole: the connection goes on)
        value = Undecodable(f"{type(e).__name__}: {e}")
    return kind, method, rid, value


class Undecodable:
    """What :func:`recv_message` returns for a message whose metadata did not unpickle (``why`` says why)."""

    def __init__(self, why: str) -> None:
        self.why = why


# ---- the client side -------------------------------------------------------------------------------------------
class _Connection:
    """One TCP connection to a server: requests sent under a lock (pushes possibly by a sender thread, see
    :func:`send_thread`), answers read by a daemon thread."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tune(self.sock)  # before connecting: the receive window is agreed then
        try:
            self.sock.settimeout(timeout_s)
            self.sock.connect(parse_address(address))
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
        threading.Thread(target=self._read, name=f"fxdist-socket-{address}", daemon=True).start()
        if self.background:
            threading.Thread(target=self._send_loop, name=f"fxdist-socket-send-{address}", daemon=True).start()

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
        rid = next(self._ids)
        self.pending[rid] = future
        try:
            if self.dead is not None:
                raise OSError(self.dead)
            with self._send_lock:
                self._send_outbox()   # the pushes queued before this request leave first
                send_message(self.sock, REQUEST, number, rid, meta, buffers)
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
            send_message(self.sock, REQUEST, number, rid, meta, buffers)

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
        header = bytearray(_HEADER.size)
        try:
            while True:
                kind, _, rid, value = recv_message(self.sock, header)
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
    """Requests over this process's connections to socket servers (:mod:`scheduling.ps.socket_server`).

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
