"""The server side of the ``socket`` transport (:mod:`scheduling.ps.transport.socket_transport`).

:class:`SocketServer` listens on a TCP port (port 0: the OS picks a free one, bound at once, so it cannot be
taken between choosing and binding; :attr:`SocketServer.address` is the real one) and serves one
:class:`~scheduling.ps.endpoints.ServerEndpoints`: an accept thread, and one reader thread per connection
that reads a request and starts it. The ordered requests (``lookup``, ``peek``, ``push``, ``push_lookup``,
``batch``) go through :meth:`~scheduling.ps.endpoints.Endpoints.submit` as on ``torch_rpc``
(:mod:`scheduling.ps.ordering`): one whose turn has not come is parked and the reader thread reads on; its
``done(value, error)`` callback, on whichever thread runs it, writes the answer under the connection's send
lock. The other requests (``configure``, ``state_dict``...) run on the reader thread.

:func:`serve` runs a server in this process until a client sends ``stop`` (``SocketTransport.stop``);
:func:`spawn_servers` starts server processes and returns their addresses, which each child publishes
through a pipe once it listens (no port is chosen before it is bound).

Source: Python ``socket`` (``bind`` to port 0, ``accept``); Li et al., "Scaling Distributed Machine
Learning with the Parameter Server", OSDI 2014, §3 (the ordering the endpoints apply).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..endpoints import Endpoints, ServerEndpoints
from .shm_arena import ALIGN, MIN_MESSAGE_BYTES, Arena, FdChannel, block_bytes
from .socket_transport import WIRE_METHODS
from .socket_wire import ANSWER, ERROR, REQUEST, Undecodable, dumps, recv_frame, send_message, tune

__all__ = ["SocketServer", "SocketServers", "serve", "spawn_servers"]

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

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, endpoints: Endpoints, host: str = "127.0.0.1", port: int = 0) -> None:
        self.endpoints = endpoints
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
                sock, _ = self.listener.accept()
            except OSError:  # closed
                return
            tune(sock)
            peer = _Peer(sock)
            # the connections that ended are done (a server actor outlives many worker groups): keep the live ones
            self._peers = [p for p in self._peers if not p.closed] + [peer]
            self._thread(self._serve, "fxdist-socket-peer", peer)

    def _serve(self, peer: _Peer) -> None:
        header = bytearray(16)
        try:
            while not peer.closed:
                kind, method, rid, args, reply, _, _ = recv_frame(peer.sock, header, peer.arena)
                if kind == REQUEST:
                    self._start(peer, method, rid, args, reply)
        except OSError:  # the client left (EOF, reset) or close()
            pass
        except Exception:  # a broken message: the stream cannot be read on
            logger.exception("socket server %s: dropping a connection", self.address)
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


def serve(name: str, host: str = "127.0.0.1", port: int = 0, *, checkpoint: str | None = None,
          fetch_delay_s: float = 0.0, push_delay_s: float = 0.0, num_threads: int = 1,
          on_ready: Callable[[str], None] | None = None, block: bool = True) -> SocketServer:
    """Run parameter server ``name`` in this process on ``host:port`` (port 0: a free one).

    Args:
        name: the server's name (error messages, checkpoint file names).
        checkpoint: a file written by ``PSServer.save`` to load before serving (None: empty).
        fetch_delay_s, push_delay_s: added latency per lookup / push, seconds.
        num_threads: torch intra-op threads of this process.
        on_ready: called with the address (``"host:port"``) once the server listens.
        block: serve until a client sends ``stop``, then close and return; False: return at once (the
            server runs on daemon threads; :meth:`SocketServer.close` ends it).

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
    server = SocketServer(ServerEndpoints(ps), host, port).start()
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
    default spawn) and wait until each listens. Returns ``(processes, addresses)`` in name order.

    Raises:
        RuntimeError: a server did not report its address within ``timeout_s`` or failed to start (the
            processes started are killed).
    """
    import multiprocessing as mp

    ctx = ctx or mp.get_context("spawn")
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
        self.host.start(ctx, _server_main, [(n, i, ready, {k: kw[k] for k in keep if k in kw})
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
