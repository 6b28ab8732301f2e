"""The server side of the ``socket`` transport (:mod:`scheduling.ps.transport.socket_transport`).

:class:`SocketServer` listens on a TCP port (port 0: the OS picks a free one, bound at once, so it cannot be
taken between choosing and binding; :attr:`SocketServer.address` is the real one) and serves one
:class:`~scheduling.ps.endpoints.ServerEndpoints`: an accept thread, and one reader thread per connection
that reads a request and starts it. The ordered requests (``lookup``, ``peek``, ``push``, ``push_lookup``,
``batch``) go through :meth:`~scheduling.ps.endpoints.Endpoints.submit` as on ``torch_rpc``
(:mod:`scheduling.ps.ordering`): one whose turn has not come is parked and the reader thread reads on; its
``done(value, error)`` callback, on whichever thread runs it, writes the answer under the connection's send
lock. The other requests (``configure``, ``state_dict``...) run on the reader thread.

Every connection first proves it holds the job's key (:mod:`scheduling.ps.transport.auth`, a mutual HMAC
handshake with a deadline) before a single message is parsed; messages are then read under
:class:`~scheduling.ps.transport.socket_wire.FrameLimits` and decoded by the restricted unpickler
(:mod:`scheduling.ps.transport.safe_pickle`). A server holds at most ``max_connections`` connections. A refused
connection (wrong key, handshake timeout, too many connections, a malformed or oversized message, a message stalled
past the read timeout) is closed, logged once per peer address and counted (:attr:`SocketServer.rejected`, and
the served ``PSServer``'s stats: ``fxdist_ps_rejected_connections_total``). Every authenticated peer is the job's
owner (the trainers need ``configure``, ``state_dict``, ``load_state_dict``; the owner ``stop``), but ``save``
writes only under the ``save_root`` the server was started with (none: refused), and so do the checkpoints by
shard (``save_shards``, ``save_status``, ``load_shards``: their folder must lie under it too).

:func:`serve` runs a server in this process until a client sends ``stop`` (``SocketTransport.stop``);
:func:`spawn_servers` starts server processes and returns their addresses, which each child publishes
through a pipe once it listens (no port is chosen before it is bound).

Source: Python ``socket`` (``bind`` to port 0, ``accept``); Li et al., "Scaling Distributed Machine
Learning with the Parameter Server", OSDI 2014, §3 (the ordering the endpoints apply).
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..endpoints import Endpoints, ServerEndpoints
from . import auth
from .shm_arena import ALIGN, MIN_MESSAGE_BYTES, Arena, FdChannel, block_bytes
from .socket_transport import WIRE_METHODS
from .socket_wire import (
    ANSWER,
    ERROR,
    REQUEST,
    FrameLimits,
    FrameRejected,
    Undecodable,
    dumps,
    recv_frame,
    send_message,
    tune,
)
from .tls import TLSCredentials, job_tls, wrap_server

__all__ = ["SocketServer", "SocketServers", "serve", "spawn_servers", "MAX_CONNECTIONS"]

MAX_CONNECTIONS = 256
"""Default cap on a server's open connections (authenticated or still in their handshake)."""
_WARNED_HOSTS = 4096
"""Peer addresses whose refusals are remembered as logged (beyond: counted, not logged)."""
_STALLED = (BlockingIOError, TimeoutError, InterruptedError)
"""What a read raises once the connection's read timeout (``SO_RCVTIMEO``) passed in the middle of a message."""

logger = logging.getLogger(__name__)


class _Peer:
    """One client connection: its socket and the lock its answers are written under."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.closed = False
        self.arena: Arena | None = None
        """The client's shared-memory arena, once it handed it over (``attach_shm``) and it could be mapped."""

    def close_arena(self) -> None:
        """Unmap the client's arena (its connection ended); answers still to come go inline."""
        arena, self.arena = self.arena, None
        if arena is not None:
            arena.close()

    def answer(self, method: int, rid: int, value: Any, error: BaseException | None,
               reply: tuple[int, int] | None = None) -> None:
        """Send ``value`` (or the server's ``error``) as the answer to request ``rid``; a closed connection
        drops it (its client is gone). ``reply``: the request's arena block ``(offset, capacity)``, where the
        answer's buffers go when they fill at least ``MIN_MESSAGE_BYTES`` and fit."""
        try:
            meta, buffers = dumps(error if error is not None else value)
            kind = ERROR if error is not None else ANSWER
        except Exception as e:  # noqa: BLE001  (an answer or exception that does not pickle)
            meta, buffers = dumps(TypeError(f"the server could not send its answer: {type(e).__name__}: {e}; "
                                            f"{'error' if error is not None else 'answer'}: {error or value!r:.200}"))
            kind = ERROR
        placed, arena = None, self.arena
        if reply is not None and arena is not None:
            lengths = [memoryview(b).nbytes for b in buffers]
            first, capacity = reply
            if (sum(lengths) >= MIN_MESSAGE_BYTES and block_bytes(lengths) <= capacity and first >= ALIGN
                    and first + capacity <= arena.size):
                try:
                    placed = arena.put(first, buffers)   # the client's block for this request alone
                except ValueError:   # unmapped meanwhile (the connection ended): inline
                    placed = None
        try:
            with self.lock:
                send_message(self.sock, kind, method, rid, meta, buffers, placed=placed)
        except OSError:  # half a message may have left: the stream is unusable, its reader ends
            self.closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class SocketServer:
    """Serve ``endpoints`` on ``host:port`` (port 0: a free one); :meth:`start` the accept thread.

    Args:
        endpoints: the request handlers (their ``server`` a :class:`~scheduling.ps.server.PSServer`).
        host: the address to listen on (``"127.0.0.1"``: this machine only; ``"0.0.0.0"``: every interface).
        port: the TCP port, 0 for one the OS picks.
        auth_key: the job key clients must prove they hold (None: :func:`scheduling.ps.transport.auth.job_key`,
            drawn when nothing provides one, ``create=True``).
        limits: what a request may declare and how long it may stall (None: ``FrameLimits.from_env()``).
        max_connections: open connections at most (:data:`MAX_CONNECTIONS`); more are refused.
        handshake_timeout_s: seconds a new connection has to authenticate (``auth.HANDSHAKE_TIMEOUT_S``).
        save_root: the directory ``save`` may write under (after ``os.path.realpath``); None: ``save`` refused.
        tls_credentials: TLS (mutual, the job's authority: :mod:`scheduling.ps.transport.tls`) around every
            connection; None: this process's (``tls.job_tls()``), plain TCP when it has none.

    Raises:
        OSError: the address cannot be bound.
        ValueError: a malformed job key; PermissionError: a key file readable by others.
    """

    def __init__(self, endpoints: Endpoints, host: str = "127.0.0.1", port: int = 0, *,
                 auth_key: bytes | None = None, limits: FrameLimits | None = None,
                 max_connections: int = MAX_CONNECTIONS, handshake_timeout_s: float = auth.HANDSHAKE_TIMEOUT_S,
                 save_root: str | None = None, tls_credentials: TLSCredentials | None = None) -> None:
        self.endpoints = endpoints
        self.key = auth.require_key(auth_key, create=True)
        self.tls = tls_credentials if tls_credentials is not None else job_tls()
        """TLS credentials every connection is wrapped with before the handshake (None: plain TCP)."""
        self.limits = limits if limits is not None else FrameLimits.from_env()
        self.max_connections, self.handshake_timeout_s = max_connections, handshake_timeout_s
        self.save_root = None if save_root is None else os.path.realpath(save_root)
        self.rejected: collections.Counter[str] = collections.Counter()
        """Connections refused, per reason (``bad_auth``, ``bad_tls``, ``handshake_timeout``, ``too_many_connections``,
        ``bad_frame``, ``over_limit``, ``frame_timeout``)."""
        self._warned: set[str] = set()
        self._reject_lock = threading.Lock()
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tune(self.listener)  # accepted connections inherit the buffers
            self.listener.bind((host, port))
            self.listener.listen(64)
        except BaseException:
            self.listener.close()
            raise
        self.address = f"{host}:{self.listener.getsockname()[1]}"
        """``"host:port"`` clients connect to (the port actually bound)."""
        self.stopped = threading.Event()
        """Set by a client's ``stop`` request (or :meth:`close`)."""
        self._peers: list[_Peer] = []
        self._fd_channel: FdChannel | None = None
        """Where same-host clients hand over their arenas' descriptors (opened on the first ``attach_shm``)."""
        self._fd_channel_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        """The accept thread and every reader thread (:meth:`close` joins them)."""

    def start(self) -> "SocketServer":
        """Accept connections on a daemon thread (each served by its own reader thread); returns self."""
        self._thread(self._accept, f"fxdist-socket-accept-{self.address}")
        return self

    def _thread(self, target: Callable[..., None], name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        # the readers of connections that ended are done: keep the list as long as the live ones
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                sock, where = self.listener.accept()
            except OSError:  # closed
                return
            # the connections that ended are done (a server actor outlives many worker groups): keep the live ones
            live = [p for p in self._peers if not p.closed]
            if len(live) >= self.max_connections:
                self._peers = live
                sock.close()
                self._reject(where[0], "too_many_connections", f"{len(live)} connections open already")
                continue
            tune(sock)
            peer = _Peer(sock)
            self._peers = live + [peer]
            self._thread(self._serve, "fxdist-socket-peer", peer, str(where[0]))

    def _handshake(self, peer: _Peer, host: str) -> bool:
        """Whether the peer proved it holds the key (else counted, logged once, and the caller closes it); then
        the connection's read and send timeouts (a message stalled past them drops the connection)."""
        try:
            if self.tls is not None:
                peer.sock = wrap_server(peer.sock, self.tls, self.handshake_timeout_s)
            auth.server_handshake(peer.sock, self.key, self.handshake_timeout_s)
        except ssl.SSLError as e:   # no certificate of the job's authority, or not TLS at all
            self._reject(host, "bad_tls", f"{type(e).__name__}: {e}")
            return False
        except TimeoutError:
            self._reject(host, "handshake_timeout", f"no handshake within {self.handshake_timeout_s} s")
            return False
        except OSError as e:   # a wrong proof (AuthenticationError), or a peer gone before proving anything
            self._reject(host, "bad_auth", str(e) or type(e).__name__)
            return False
        seconds = self.limits.read_timeout_s
        timeval = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
        peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        return True

    def _serve(self, peer: _Peer, host: str = "?") -> None:
        header = bytearray(16)
        try:
            if not self._handshake(peer, host):
                return
            while not peer.closed:
                kind, method, rid, args, reply, _, _ = recv_frame(peer.sock, header, peer.arena, limits=self.limits)
                if kind != REQUEST:
                    raise FrameRejected("bad_frame", f"a message of kind {kind} (a client sends requests only)")
                self._start(peer, method, rid, args, reply)
                if isinstance(args, Undecodable):   # answered with why; a peer sending those is read no further
                    raise FrameRejected("bad_frame", f"request #{method} undecodable: {args.why}")
        except FrameRejected as e:
            self._reject(host, e.reason, str(e))
        except _STALLED:
            if not peer.closed:
                self._reject(host, "frame_timeout", f"a message stalled over {self.limits.read_timeout_s} s")
        except OSError:  # the client left (EOF, reset) or close()
            pass
        except Exception as e:  # noqa: BLE001  (a broken message: the stream cannot be read on)
            self._reject(host, "bad_frame", f"{type(e).__name__}: {e}")
        finally:
            peer.closed = True
            peer.sock.close()
            peer.close_arena()

    def _start(self, peer: _Peer, method: int, rid: int, args: Any, reply: tuple[int, int] | None = None) -> None:
        """Start request ``rid``: ordered ones through the endpoints' ``submit`` (answered by their callback),
        the others here."""
        def done(value: Any, error: BaseException | None) -> None:
            peer.answer(method, rid, value, error, reply)

        name = WIRE_METHODS[method] if method < len(WIRE_METHODS) else f"#{method}"
        try:
            if isinstance(args, Undecodable):
                raise ValueError(f"server: request {name} could not be unpickled: {args.why}")
            if name in Endpoints.ORDERED:
                self.endpoints.submit(name, args, done)
            elif name == "batch":
                (calls,) = args
                try:
                    self.endpoints.submit_batch(calls, done)
                except Exception as e:  # noqa: BLE001  (no server here: every call answers that error)
                    done([(None, e)] * len(calls), None)
            elif name == "stop":
                done(True, None)
                self.stopped.set()
            elif name == "save":   # only under the save root
                done(self.endpoints.save(self._save_path(args)), None)
            elif name in _ROOTED:   # (namespace, folder, ...): the folder only under the save root
                rooted = (args[0], self._save_path(args[1:2]), *args[2:]) if isinstance(args, tuple) else args
                done(getattr(self.endpoints, name)(*rooted), None)
            elif name == "attach_shm":   # in this reader thread: installed before the client's next request is read
                done(self._attach_shm(peer, args), None)
            elif name in WIRE_METHODS:
                done(getattr(self.endpoints, name)(*args), None)
            else:
                raise ValueError(f"server: unknown request method number {method}")
        except Exception as e:  # noqa: BLE001  (answered as the request's error, as torch_rpc does)
            done(None, e)

    def _attach_shm(self, peer: _Peer, args: Any) -> Any:
        """A client's ``attach_shm`` request, one of two steps (:mod:`scheduling.ps.transport.shm_arena`).
        ``("channel", nbytes)``: the address of this server's :class:`~scheduling.ps.transport.shm_arena.FdChannel`
        and a one-time token for ``peer``'s arena of ``nbytes``, or None where the channel cannot be opened (the
        client stays inline). ``("install", token)``: the arena handed over on the channel with ``token`` becomes
        ``peer``'s (True), or there is none (False).

        Raises:
            ValueError: another step (a file named by the client is never opened).
        """
        step, value = args if isinstance(args, tuple) and len(args) == 2 else (None, None)
        if step == "channel" and isinstance(value, int):
            with self._fd_channel_lock:
                if self._fd_channel is None and not self.stopped.is_set():
                    try:
                        self._fd_channel = FdChannel()
                    except OSError as e:   # no abstract Unix sockets here: every client inline
                        logger.warning("socket server %s: no shared-memory hand-over socket: %s", self.address, e)
                channel = self._fd_channel
            return None if channel is None else (channel.name, channel.expect(peer, value))
        if step == "install" and isinstance(value, bytes):
            channel = self._fd_channel
            arena = channel.claim(peer, value) if channel is not None and peer.arena is None else None
            if arena is not None:
                peer.arena = arena
            return arena is not None
        raise ValueError(f"server: attach_shm takes ('channel', bytes) or ('install', token), not {args!r:.200}: a "
                         f"shared-memory arena is handed over as a descriptor, never by name")

    def _save_path(self, args: Any) -> str:   # also a checkpoint-by-shard request's folder (_ROOTED)
        """The directory of a ``save`` request, resolved (``os.path.realpath``) and under :attr:`save_root`.

        Raises:
            PermissionError: no save root, or the directory resolves outside it.
            ValueError: not one directory argument.
        """
        if not isinstance(args, tuple) or len(args) != 1 or not isinstance(args[0], str):
            raise ValueError(f"server {self.address}: save takes one directory, got {args!r:.200}")
        real = os.path.realpath(args[0])
        root = self.save_root
        if root is None:
            raise PermissionError(f"server {self.address}: save({args[0]!r}) refused: this server was started "
                                  "without a save root (SocketServer / serve save_root=)")
        if os.path.commonpath([real, root]) != root:
            raise PermissionError(f"server {self.address}: save({args[0]!r}) refused: {real} is outside the save "
                                  f"root {root} (the directory this server was started with)")
        return real

    def _reject(self, host: str, reason: str, detail: str) -> None:
        """Count a refused connection under ``reason`` (here and in the served ``PSServer``'s stats) and log the
        first one from ``host``."""
        with self._reject_lock:
            self.rejected[reason] += 1
            first = host not in self._warned and len(self._warned) < _WARNED_HOSTS
            if first:
                self._warned.add(host)
        stats = getattr(getattr(self.endpoints, "server", None), "stats", None)
        if stats is not None and hasattr(stats, "reject"):
            stats.reject(reason)
        if first:
            logger.warning("socket server %s: refused a connection from %s (%s: %s); later refusals of %s are "
                           "counted, not logged", self.address, host, reason, detail, host)

    def close(self, join_s: float = 5.0) -> None:
        """Stop accepting, close every connection (their clients' requests fail at once) and wait up to ``join_s``
        seconds for the accept and reader threads to end (a reader finishes the request it runs first).

        Joining matters at a server process's exit: a reader thread still running Python while the interpreter
        finalizes dies inside a tensor's C++ destructor when it asks for the GIL, and the process aborts
        ("terminate called without an active exception", exit -6)."""
        self.stopped.set()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)   # wakes the accept thread (a close alone may not)
        except OSError:
            pass
        self.listener.close()
        with self._fd_channel_lock:
            if self._fd_channel is not None:
                self._fd_channel.close()
        for peer in list(self._peers):
            peer.closed = True
            try:
                peer.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + join_s
        for thread in list(self._threads):
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))


_ROOTED = frozenset({"save_shards", "save_status", "load_shards"})
"""Requests whose second argument is a folder, which must lie under the save root (as ``save``'s)."""


def serve(name: str, host: str = "127.0.0.1", port: int = 0, *, checkpoint: str | None = None,
          fetch_delay_s: float = 0.0, push_delay_s: float = 0.0, num_threads: int = 1,
          on_ready: Callable[[str], None] | None = None, block: bool = True, auth_key: bytes | None = None,
          save_root: str | None = None) -> SocketServer:
    """Run parameter server ``name`` in this process on ``host:port`` (port 0: a free one).

    Args:
        name: the server's name (error messages, checkpoint file names).
        checkpoint: a file written by ``PSServer.save`` to load before serving (None: empty).
        fetch_delay_s, push_delay_s: added latency per lookup / push, seconds.
        num_threads: torch intra-op threads of this process.
        on_ready: called with the address (``"host:port"``) once the server listens.
        block: serve until a client sends ``stop``, then close and return; False: return at once (the
            server runs on daemon threads; :meth:`SocketServer.close` ends it).
        auth_key, save_root: :class:`SocketServer`'s (None: this process's job key, drawn if none; no ``save``).

    Returns:
        The :class:`SocketServer` (closed when ``block``).

    Raises:
        OSError: the address cannot be bound.
    """
    from ..server import PSServer, freeze_process_objects

    torch.set_num_threads(num_threads)
    ps = PSServer(name, fetch_delay_s=fetch_delay_s, push_delay_s=push_delay_s)
    if checkpoint is not None:
        from ..safe_load import safe_load

        ps.load_state_dict(safe_load(checkpoint))
    freeze_process_objects()
    server = SocketServer(ServerEndpoints(ps), host, port, auth_key=auth_key, save_root=save_root).start()
    if on_ready is not None:
        on_ready(server.address)
    if block:
        server.stopped.wait()
        time.sleep(0.2)  # let the answer to the stop request leave before the connections close
        server.close()
    return server


def _server_main(name: str, index: int, queue: Any, kwargs: dict[str, Any]) -> None:
    """A spawned server process: publish ``(index, address)`` on ``queue`` once listening, serve until stopped."""
    try:
        serve(name, on_ready=lambda address: queue.put((index, address)), **kwargs)
    except BaseException as e:
        queue.put((index, e))
        raise


def spawn_servers(names: Sequence[str], ctx: Any = None, timeout_s: float = 60.0,
                  **kwargs: Any) -> tuple[list[Any], list[str]]:
    """Start one server process per name (``kwargs`` to :func:`serve`; ``ctx``: a multiprocessing context,
    default spawn) and wait until each listens. Returns ``(processes, addresses)`` in name order. The servers
    take ``kwargs["auth_key"]``, else this process's job key (drawn now if none: ``auth.job_key(create=True)``),
    passed to each child explicitly; this process's clients use it.

    Raises:
        RuntimeError: a server did not report its address within ``timeout_s`` or failed to start (the
            processes started are killed).
    """
    import multiprocessing as mp

    ctx = ctx or mp.get_context("spawn")
    kwargs = {**kwargs, "auth_key": auth.require_key(kwargs.get("auth_key"), create=True)}
    queue = ctx.Queue()
    procs = [ctx.Process(target=_server_main, args=(n, i, queue, kwargs), daemon=True) for i, n in enumerate(names)]
    for p in procs:
        p.start()
    try:
        addresses = _addresses(queue, procs, names, timeout_s)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return procs, addresses


def _addresses(queue: Any, procs: Sequence[Any], names: Sequence[str], timeout_s: float) -> list[str]:
    """The address each server process publishes on ``queue`` (:func:`_server_main`), in name order.

    Raises:
        RuntimeError: a server failed, died, or did not listen within ``timeout_s``.
    """
    import queue as queue_module
    import time as clock

    found: dict[int, Any] = {}
    deadline = clock.monotonic() + timeout_s
    while len(found) < len(names):
        try:
            index, address = queue.get(timeout=0.5)
        except queue_module.Empty:
            dead = [n for n, p in zip(names, procs) if p.exitcode is not None]
            if dead:
                raise RuntimeError(f"socket server(s) {dead} exited before listening") from None
            if clock.monotonic() > deadline:
                raise RuntimeError(f"socket servers {list(names)}: not all listened within {timeout_s} s") from None
            continue
        if isinstance(address, BaseException):
            raise RuntimeError(f"socket server {names[index]!r} failed to start: {address!r}")
        found[index] = address
    return [found[i] for i in range(len(names))]


class SocketServers:
    """The lifecycle of a group of ``socket`` parameter servers (the ``transport`` object of
    :class:`~scheduling.ps.LocalCluster` with ``transport="socket"``): child processes
    (:class:`~scheduling.ps.hosts.ProcessHost`), each listening on a port it bound itself, registered under
    :attr:`names` for this process's clients (:func:`scheduling.ps.transport.socket_transport.register_servers`). No
    group: nothing to join or leave, a client connects on its first request. Same methods as
    :class:`scheduling.ps.lifecycle.TorchRPCServers` for one machine (a job's server actors:
    :class:`scheduling.ps.transport.ray_transport.RaySocketServers`).

    Args:
        names: the names clients use for the servers (``ps<i>``); ``timeout_s``: how long a server may take to
            listen, seconds.
    """

    name = "socket"

    def __init__(self, names: Sequence[str], timeout_s: float) -> None:
        from ..hosts import ProcessHost

        self.names, self.timeout_s = list(names), timeout_s
        self.host = ProcessHost()
        self.addresses: list[str] = []
        """``host:port`` of each server, in name order (after :meth:`start`)."""

    @property
    def processes(self) -> list[Any]:
        """The server processes."""
        return self.host.processes

    @property
    def actors(self) -> list[Any]:
        """None: the servers are processes."""
        return []

    def start(self, kwargs: Sequence[dict[str, Any]], *, port: int, trainer_name: str, ctx: Any) -> None:
        """One server process per name (``kwargs[i]``: its ``checkpoint`` and delays; the others are
        ``torch_rpc``'s and ignored), each binding a free port (``port`` is not used); waits until all listen
        and registers their addresses. Returns None.

        Raises:
            RuntimeError: a server did not listen within ``timeout_s`` (every server is killed).
        """
        from .socket_transport import register_servers

        ready = ctx.Queue()
        keep = ("checkpoint", "fetch_delay_s", "push_delay_s")
        key = auth.require_key(create=True)   # this process's (drawn if none): its clients use it too
        self.host.start(ctx, _server_main, [(n, i, ready, {"auth_key": key, **{k: kw[k] for k in keep if k in kw}})
                                            for i, (n, kw) in enumerate(zip(self.names, kwargs))], self.names)
        try:
            self.addresses = _addresses(ready, self.host.processes, self.names, self.timeout_s)
        except BaseException:
            self.host.kill_all()
            raise
        register_servers(dict(zip(self.names, self.addresses)))

    def kill(self, index: int) -> None:
        """Kill server ``index``'s process with SIGKILL (a crash); its clients' requests fail at once."""
        self.host.kill(index)

    def kill_all(self) -> None:
        """Kill every server process still alive."""
        self.host.kill_all()

    def stop(self, joined: bool) -> None:
        """Ask the live servers to stop (``SocketTransport.stop``), wait for their processes (10 s), kill what is
        left and forget the names."""
        from .socket_transport import SocketTransport, unregister_servers

        try:
            live = [a for a, alive in zip(self.addresses, self.host.alive()) if alive]
            if live:
                SocketTransport(live).stop(2.0)
            self.host.wait(10.0)
        finally:
            self.kill_all()
            unregister_servers(self.names)

    def reaches(self, client: Any) -> bool:
        """Whether ``client`` (a PSClient of this process) sends to one of these servers."""
        return bool(set(getattr(client.transport, "addresses", ())) & set(self.addresses))
