"""The ``ray`` transport: parameter servers as Ray actors, called directly.

A server is a Ray actor of class :class:`PSActor` (the transport-independent
:class:`~scheduling.ps.endpoints.ServerEndpoints` around a :class:`~scheduling.ps.server.PSServer`): a
client's request is ``handle.lookup.remote(namespace, batch, compress, order)``, an ``ObjectRef``, waited
with ``ray.get``. There is no ``torch.distributed.rpc`` group: no rendezvous, no group to restart. When Ray
restarts a server actor after its process died (``max_restarts``), the same handle reaches the new process,
which answers every request with a transport error (``PSUnavailableError`` on the client) until it is
``reset()``, with the last checkpoint or empty for the trainers to load one: a client never silently reads a
server that lost its tables.

The actor is an asyncio actor (:class:`~scheduling.ps.endpoints.AsyncEndpoints`): a lookup or push that
the request order (:mod:`scheduling.ps.ordering`) holds until earlier ones arrive is a coroutine awaiting
its answer, holding no thread, so any number of clients and trainers can wait on one server; the work runs
on ``num_worker_threads`` threads of the actor's process. ``max_concurrency`` (:data:`ACTOR_OPTIONS`) only
bounds how many requests one server actor holds at once, waiting ones included.

The same :class:`PSActor` serves a job's ``torch_rpc`` group too: :meth:`PSActor.join` has it join each new
RPC group of the trainers; a job adds its metrics through the actor's ``hooks`` (``jobs.trainer.servers.ServerHooks``).
:class:`RayServers` is this transport's server lifecycle (:func:`scheduling.ps.lifecycle.server_group`).

Clients name servers by a string: a name registered here (:func:`register_servers`, done by
``LocalCluster(transport="ray")`` and by a job's trainers) or a named Ray actor (``ray.get_actor``), or
pass the actor handles themselves.

Only this module (and :mod:`scheduling.ray_calls`) of ``scheduling`` imports Ray; nothing imports it unless
the ``ray`` transport is asked for.

Source: Ray actors (``ray.remote``, ``ActorHandle.method.remote``, ``ray.get``, ``max_restarts``,
AsyncIO actors, ``max_concurrency``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ray
import ray.exceptions as rex
import torch
from ray.actor import ActorHandle

from ..endpoints import DEFAULT_WORKER_THREADS, AsyncEndpoints
from ..server import PSServer

if TYPE_CHECKING:
    from ..hosts import ServerAnswer

__all__ = ["PSActor", "ActorHost", "RayTransport", "RayFuture", "ACTOR_OPTIONS", "MAX_REQUESTS", "server_actor_class", "start_actors", "register_servers",
           "unregister_servers", "is_ray_server", "restarted_actor", "start_local", "kill_actors", "RayServers", "RaySocketServers",
           "wait_all"]

MAX_REQUESTS = 100_000
"""Requests one server actor holds at once (Ray's ``max_concurrency`` of an asyncio actor), waiting ones
included; each waiting request is a parked coroutine, not a thread."""
ACTOR_OPTIONS = {"num_cpus": 0, "max_concurrency": MAX_REQUESTS, "max_restarts": 0}
"""``ray.remote`` options of a server actor (the one place they are set; :func:`server_actor_class`): no CPU
reserved, up to :data:`MAX_REQUESTS` requests in flight, not restarted by Ray unless ``max_restarts`` says."""


def server_actor_class(max_restarts: int = 0) -> Any:
    """:class:`PSActor` as a Ray actor class with :data:`ACTOR_OPTIONS`, restarted by Ray up to ``max_restarts``
    times after its process dies (0: never; a negative number counts as 0). Add per-actor options (a name,
    a node) with its ``.options(...)``."""
    options: dict[str, Any] = {**ACTOR_OPTIONS, "max_restarts": max(0, max_restarts)}
    return ray.remote(**options)(PSActor)

_HANDLES: dict[str, ActorHandle] = {}

# transport failures: the client turns them into PSUnavailableError (a RayTaskError is the server's own error)
_TRANSPORT_ERRORS = (rex.GetTimeoutError, rex.RayActorError, rex.ActorUnavailableError, rex.ObjectLostError,
                     rex.OwnerDiedError, rex.WorkerCrashedError, rex.RaySystemError, rex.TaskCancelledError)


class PSActor(AsyncEndpoints):
    """A parameter server as a Ray actor class: ``ray.remote(**ACTOR_OPTIONS)(PSActor).remote("ps0")``; the one
    server actor of both transports (a ``LocalCluster``'s and a job's, ``jobs.trainer.servers.start_servers``).

    ``ray`` transport: the actor itself serves the requests (its
    :class:`~scheduling.ps.endpoints.AsyncEndpoints` methods, ``handle.lookup.remote(...)``), from
    :meth:`reset` on. ``torch_rpc``: :meth:`join` has it leave its RPC group, if any, and join a new one with
    an empty server (``scheduling.ps.start_server``): ``torch.distributed.rpc`` cannot re-admit a member into a
    live group, so a server outlives its trainers' groups by joining each new one.

    Args:
        name: server name (RPC worker name, error messages, checkpoint file names).
        fetch_delay_s, push_delay_s: added latency per lookup / push, seconds.
        checkpoint: a file written by ``PSServer.save`` to load before serving (None: empty).
        num_threads: torch intra-op threads of the actor's process (None: leave torch's default).
        num_worker_threads: threads running the lookups and pushes (a request waiting for its turn holds
            none: :class:`~scheduling.ps.endpoints.AsyncEndpoints`; TensorPipe's threads after :meth:`join`).
        timeout_s: RPC and rendezvous timeout of :meth:`join`, seconds.
        serve_at_start: False: no server until :meth:`join` / :meth:`reset` (requests fail until then, also
            after Ray restarted the actor); True: serve ``checkpoint``'s tables (or none) at once, unless Ray
            restarted the actor (it lost its tables: refused until :meth:`reset`).
        hooks: an object adding what the actor's owner needs (a job: its metrics exporter), called as
            ``hooks.start()`` here, ``hooks.before_join(addr)``, ``hooks.serving(server)`` for each new server,
            ``hooks.where()`` (:meth:`where`), ``hooks.stats()`` (merged into :meth:`stats`) and
            ``hooks.close()``; None: nothing added.
        auth_key: the job key the ``socket`` transport's clients must prove they hold
            (:mod:`scheduling.ps.transport.auth`; the launcher passes the job's through Ray); None: this process's.
        save_root: the directory a ``save`` request over the socket may write under (the run's); None: refused.
        tls_credentials: TLS around the ``socket`` listener's connections (:mod:`scheduling.ps.transport.tls`, the
            job's authority, through Ray); None: plain TCP.
    """

    def __init__(self, name: str, fetch_delay_s: float = 0.0, push_delay_s: float = 0.0,
                 checkpoint: str | None = None, num_threads: int | None = 1,
                 num_worker_threads: int = DEFAULT_WORKER_THREADS, *, timeout_s: float = 20.0,
                 serve_at_start: bool = True, hooks: Any = None, auth_key: bytes | None = None,
                 save_root: str | None = None, tls_credentials: Any = None) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.name, self.delays, self.timeout_s = name, (fetch_delay_s, push_delay_s), timeout_s
        super().__init__(num_worker_threads=num_worker_threads)
        self.joined, self.groups, self.hooks = False, 0, hooks
        self.held = {"rows": 0, "bytes": 0}  # PSServer.memory() when it last left a group (what close() reports)
        self.socket: Any = None  # the socket transport's listener (reset_socket), kept across resets
        self.auth_key, self.save_root, self.tls_credentials = auth_key, save_root, tls_credentials
        if hooks is not None:
            hooks.start()
        if not serve_at_start:
            self.why_none = f"server {name} has not been reset since its actor (re)started"
        elif restarted_actor():  # the tables died with the old process: refuse requests until reset()
            self.why_none = (f"server {name} is a restarted Ray actor that lost its tables; reset() it (with the "
                             "last checkpoint) before use")
        else:
            self.reset(checkpoint)

    def reset(self, checkpoint: str | None = None) -> ServerAnswer:
        """``ray`` transport: drop every table and serve an empty server (or ``checkpoint``'s tables) from now
        on: ``{"pid", "group": resets and joins so far}``."""
        server = PSServer(self.name, *self.delays)
        if checkpoint is not None:
            from ..safe_load import safe_load

            server.load_state_dict(safe_load(checkpoint))
        return self._serve(server)

    def reset_socket(self, host: str | None = None) -> ServerAnswer:
        """``socket`` transport: :meth:`reset`, and serve this actor's endpoints on a TCP socket
        (:class:`scheduling.ps.transport.socket_server.SocketServer`) bound on ``host`` (None: this node's Ray address), port
        0 (a free one). The socket stays across resets; a restarted actor binds a new one. Returns :meth:`reset`'s
        answer and ``"address"``: the ``"host:port"`` clients connect to.

        Raises:
            OSError: ``host`` cannot be bound.
        """
        answer = self.reset()
        if self.socket is None:
            from .socket_server import SocketServer

            self.socket = SocketServer(self, host or ray.util.get_node_ip_address(), 0, auth_key=self.auth_key,
                                       save_root=self.save_root, tls_credentials=self.tls_credentials).start()
        return {**answer, "address": self.socket.address}

    def join(self, rank: int, world: int, addr: str, port: int) -> ServerAnswer:
        """``torch_rpc`` transport: leave the current RPC group if any, then join the one at ``addr:port`` as
        ``rank`` of ``world`` with an empty server; returns once every member joined, as :meth:`reset`.

        Raises:
            RuntimeError: the group did not assemble within ``timeout_s`` (from ``torch.distributed.rpc``).
        """
        from ..server import start_server

        self.leave()
        if self.hooks is not None:
            self.hooks.before_join(addr)
        server = start_server(self.name, rank, world, master_addr=addr, master_port=port,
                              fetch_delay_s=self.delays[0], push_delay_s=self.delays[1], timeout_s=self.timeout_s,
                              block=False, num_worker_threads=self.num_worker_threads)
        self.joined = True
        return self._serve(server)

    def _serve(self, server: PSServer) -> ServerAnswer:
        self.server = server
        self.groups += 1
        if self.hooks is not None:
            self.hooks.serving(server)
        return {"pid": os.getpid(), "group": self.groups}

    def leave(self) -> None:
        """Leave the RPC group, if in one (at once: ``scheduling.ps.stop_server`` never waits for the others)."""
        from ..server import stop_server

        if self.joined:
            self.joined = False
            self.held = self.server.memory()
            stop_server()

    def where(self) -> dict[str, Any]:
        """Where this server runs: ``hooks.where()``, else ``{"pid", "node_id"}``."""
        if self.hooks is not None:
            return self.hooks.where()
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def stats(self) -> dict[str, int]:
        """Without ``hooks``: lookups and pushes served, process id, rows and bytes held
        (:meth:`ServerEndpoints.stats`). With one: ``{"pid", "rows", "bytes"}`` its server holds now
        (``PSServer.memory()``; ``torch_rpc``: what it held when it left its last group) and ``hooks.stats()``."""
        if self.hooks is None:
            return super().stats()
        # a server that left its RPC group keeps its tables (no request reaches it): measured as it was then
        held = self.server.memory() if self.server is not None else self.held
        return {"pid": os.getpid(), **self.hooks.stats(), **held}

    def close(self) -> None:
        """Leave the group, drop the server and close the ``hooks`` (the owner then kills the actor)."""
        self.leave()
        if self.socket is not None:
            self.socket.close()
            self.socket = None
        self.server = None
        if self.hooks is not None:
            self.hooks.close()


def _actor_key(handle: ActorHandle) -> str:
    """An actor's id as hex text, from the handle's public text form ``Actor(<class>, <hex id>)``."""
    return str(handle).rpartition(",")[2].strip(" )")


class ActorHost:
    """Servers as Ray actors (``scheduling.ps.transport.ray_transport.PSActor``); Ray restarts a killed one while its
    ``max_restarts`` (:data:`ACTOR_OPTIONS`) allow. The host axis's Ray half (:mod:`scheduling.ps.hosts`).

    Attributes: ``actors``, the actor handles, in server order (set by whoever created or was given them).
    """

    kind = "actor"

    def __init__(self, actors: Sequence[Any] = ()) -> None:
        self.actors: list[Any] = list(actors)

    def kill(self, index: int) -> None:
        """Kill server ``index``'s actor process (a crash); Ray restarts it if it has restarts left."""
        ray.kill(self.actors[index], no_restart=False)

    def kill_all(self) -> None:
        """Kill every actor for good (no restart); never raises (an actor already gone is skipped)."""
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001  already gone
                pass


def restarted_actor() -> bool:
    """Whether this process is a Ray actor that Ray restarted after its previous process died."""
    return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def start_actors(names: Sequence[str], checkpoints: Sequence[str | None] | None = None,
                 **kwargs: Any) -> list[ActorHandle]:
    """One :class:`PSActor` per name (``kwargs`` to each, and its checkpoint file or None), registered under
    its name; waits until they run.

    Raises:
        ray.exceptions.RayActorError: an actor failed to start.
    """
    cls = server_actor_class()
    checkpoints = list(checkpoints or [None] * len(names))
    handles = [cls.remote(name, checkpoint=ckpt, **kwargs) for name, ckpt in zip(names, checkpoints)]
    ray.get([h.stats.remote() for h in handles])
    register_servers(dict(zip(names, handles)))
    return handles


def register_servers(handles: Mapping[str, ActorHandle]) -> None:
    """Let clients of this process name these server actors by string (later registrations win)."""
    _HANDLES.update(handles)


def unregister_servers(names: Iterable[str]) -> None:
    for name in names:
        _HANDLES.pop(name, None)


def is_ray_server(server: Any) -> bool:
    """Whether ``server`` is a Ray actor handle or a name registered with :func:`register_servers`."""
    return isinstance(server, ActorHandle) or (isinstance(server, str) and server in _HANDLES)


class RayFuture:
    """An ``ObjectRef`` waited like a ``torch.futures.Future`` (the value is fetched once, then kept)."""

    def __init__(self, ref: Any, timeout_s: float) -> None:
        self.ref, self.timeout_s = ref, timeout_s
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None

    def wait(self) -> Any:
        """``ray.get`` the answer. Raises: RuntimeError for a transport failure, else the server's error."""
        if not self._done:
            try:
                self._value = ray.get(self.ref, timeout=self.timeout_s)
            except rex.RayTaskError as e:  # the server raised: its own exception, as torch_rpc gives it
                cause = e.cause if isinstance(e.cause, BaseException) else RuntimeError(str(e))
                self._error = RuntimeError(str(cause)) if type(cause) is RuntimeError else cause
            except _TRANSPORT_ERRORS as e:
                self._error = RuntimeError(f"{type(e).__name__}: {str(e).strip() or 'no answer'}")
            self._done = True
        if self._error is not None:
            raise self._error
        return self._value

    def done(self) -> bool:
        if not self._done:
            ready, _ = ray.wait([self.ref], timeout=0)
            return bool(ready)
        return True


class RayTransport:
    """Requests as calls of the servers' actor methods (:class:`PSActor`, or any actor with the same
    methods). ``servers``: actor handles, registered names or named Ray actors.

    Raises:
        ValueError: a name that is neither registered nor a named actor.
    """

    name = "ray"

    def __init__(self, servers: Sequence[Any]) -> None:
        self.handles: list[ActorHandle] = []
        self.names: list[str] = []
        for s in servers:
            if isinstance(s, ActorHandle):
                self.handles.append(s)
                self.names.append(f"actor {_actor_key(s)[:12]}")
                continue
            handle = _HANDLES.get(s)
            if handle is None:
                try:
                    handle = ray.get_actor(s)
                except ValueError:
                    raise ValueError(f"transport 'ray': no server actor named {s!r} (registered: {sorted(_HANDLES)}"
                                     "); start them with LocalCluster(transport='ray') or register_servers()"
                                     ) from None
            self.handles.append(handle)
            self.names.append(s)

    def call_async(self, server: int, method: str, args: tuple, timeout_s: float) -> RayFuture:
        return RayFuture(getattr(self.handles[server], method).remote(*args), timeout_s)

    def stop(self, timeout_s: float) -> None:
        """Nothing to leave: the actors' owner (``LocalCluster``, the job launcher) ends them."""


def start_local(names: Sequence[str], checkpoints: Sequence[str | None] | None = None,
                **kwargs: Any) -> tuple[list[ActorHandle], bool]:
    """:func:`start_actors` on this process's Ray session, starting a local one if none runs (Ray's
    workers inherit this process's environment, ``PYTHONPATH`` included). Returns (handles, whether Ray
    was started here)."""
    started = not ray.is_initialized()
    if started:
        from recsys.quiet import RAY_TOKEN_AUTH_ENABLED, RAY_TOKEN_AUTH_LOGGER, drop_log_records

        drop_log_records(RAY_TOKEN_AUTH_LOGGER, RAY_TOKEN_AUTH_ENABLED)  # the local cluster started here
        ray.init(include_dashboard=False, log_to_driver=False)
    return start_actors(names, checkpoints, **kwargs), started


def kill_actors(handles: Sequence[ActorHandle], names: Sequence[str], shutdown: bool = False) -> None:
    """Kill the actors for good (:meth:`scheduling.ps.hosts.ActorHost.kill_all`), forget their names, and with
    ``shutdown`` stop Ray; never raises."""
    unregister_servers(names)
    ActorHost(handles).kill_all()
    if shutdown:
        ray.shutdown()


def wait_all(refs: Sequence[Any], timeout_s: float | None) -> list[Any]:
    """``ray.get`` of every ref (``timeout_s`` None: no limit); for callers outside this module."""
    return ray.get(list(refs), timeout=timeout_s)


class RayServers:
    """The lifecycle of a group of ``ray`` parameter servers (the ``transport`` object of
    :class:`~scheduling.ps.LocalCluster` and of a job's worker group, ``jobs.trainer.servers.ServerGroup``): Ray actors
    called directly, no RPC group. Same methods as :class:`scheduling.ps.lifecycle.TorchRPCServers`.

    Args:
        names: the names clients use for the servers (``ps<i>``); ``timeout_s``: how long to wait for them.
    """

    name = "ray"

    def __init__(self, names: Sequence[str], timeout_s: float) -> None:
        self.names, self.timeout_s = list(names), timeout_s
        self.host = ActorHost()
        """Where the servers run: Ray actors (:class:`scheduling.ps.hosts.ActorHost`)."""
        self.processes: list[Any] = []  # none: the servers are actors
        self._started_ray = False
        self._answers: list[ServerAnswer] = []

    @property
    def actors(self) -> list[ActorHandle]:
        """The server actors (started here, or the job's from :meth:`rendezvous` / :meth:`join` on)."""
        return self.host.actors

    # ---- on one machine (LocalCluster) ----
    def start(self, kwargs: Sequence[dict[str, Any]], *, port: int, trainer_name: str, ctx: Any) -> None:
        """One :class:`PSActor` per name on this process's Ray session (a local one is started if none runs),
        registered under its name; ``kwargs[i]``: its ``checkpoint``, delays and worker threads. Returns None
        (no port: nothing binds one).

        Raises:
            ray.exceptions.RayActorError: an actor failed to start.
        """
        kw = kwargs[0]
        actors, self._started_ray = start_local(
            self.names, checkpoints=[k["checkpoint"] for k in kwargs], fetch_delay_s=kw["fetch_delay_s"],
            push_delay_s=kw["push_delay_s"], num_worker_threads=kw["num_worker_threads"])
        self.host = ActorHost(actors)

    def kill(self, index: int) -> None:
        """Kill server ``index``'s actor (a crash); Ray restarts it while it has restarts left (a
        ``LocalCluster``'s have none: :data:`ACTOR_OPTIONS`)."""
        self.host.kill(index)

    def kill_all(self) -> None:
        """Kill every server actor for good (no restart)."""
        self.host.kill_all()

    def stop(self, joined: bool) -> None:
        """Kill the actors, forget their names, and stop Ray if :meth:`start` started it."""
        self.host.kill_all()
        unregister_servers(self.names)
        self.host = ActorHost()
        if self._started_ray:
            ray.shutdown()

    def reaches(self, client: Any) -> bool:
        """Whether ``client`` (a PSClient of this process) holds one of these actors."""
        mine = {_actor_key(a) for a in self.actors}
        return any(_actor_key(h) in mine for h in getattr(client.transport, "handles", ()))

    # ---- in a job: the launcher's server actors (jobs.trainer.servers) ----
    def rendezvous(self, host: str, actors: Sequence[Any]) -> None:
        """Rank 0 of a new trainer group: empty every server actor (``reset()``) before the other trainers hear
        of the group; there is nothing to meet at (None)."""
        self.host = ActorHost(actors)
        self._answers = ray.get([a.reset.remote() for a in actors], timeout=self.timeout_s)

    def join(self, actors: Sequence[Any], rank: int, world: int, rendezvous: None,
             before_join: Any = None) -> list[ServerAnswer]:
        """Register the server ``actors`` under :attr:`names` for this process's clients; returns the servers'
        answers to :meth:`rendezvous` (rank 0; ``[]`` elsewhere)."""
        self.host = ActorHost(actors)
        register_servers(dict(zip(self.names, actors)))
        return self._answers if rank == 0 else []

    def leave(self, actors: Sequence[Any], rank: int, graceful: bool) -> None:
        """Forget the servers' names: no group to leave, the launcher owns the actors."""
        unregister_servers(self.names)


class RaySocketServers(RayServers):
    """The lifecycle of a job's ``socket`` parameter servers (``jobs.trainer.servers.ServerGroup`` with
    ``[cluster] transport = "socket"``): the launcher's :class:`PSActor` actors, each serving its endpoints on a
    TCP socket of its node (:meth:`PSActor.reset_socket`); the clients send to those addresses
    (:mod:`scheduling.ps.transport.socket_transport`), not through Ray. Rank 0 of each worker group resets the actors and
    takes their addresses again (a restarted actor listens on a new port); the other trainers hear them with the
    group key. Same methods as :class:`RayServers`.
    """

    name = "socket"

    def rendezvous(self, host: str, actors: Sequence[Any]) -> list[str]:  # type: ignore[override]
        """Rank 0 of a new trainer group: empty every server actor and have it listen (:meth:`PSActor.reset_socket`):
        on ``host`` when it is a loopback address (a job on one host: nothing listens beyond it), else on each actor's
        own node's address (a cluster); returns their ``"host:port"`` addresses, in order."""
        self.host = ActorHost(actors)
        bind = host if host == "localhost" or host.startswith("127.") or host == "::1" else None
        self._answers = ray.get([a.reset_socket.remote(bind) for a in actors], timeout=self.timeout_s)
        return [answer["address"] for answer in self._answers]

    def join(self, actors: Sequence[Any], rank: int, world: int, rendezvous: Any,
             before_join: Any = None) -> list[ServerAnswer]:
        """Register the servers' addresses (``rendezvous``, rank 0's :meth:`rendezvous`) under :attr:`names` for
        this process's clients (:func:`scheduling.ps.transport.socket_transport.register_servers`); returns the servers'
        answers to :meth:`rendezvous` (rank 0; ``[]`` elsewhere)."""
        from .socket_transport import register_servers

        self.host = ActorHost(actors)
        register_servers(dict(zip(self.names, rendezvous)))
        return self._answers if rank == 0 else []

    def leave(self, actors: Sequence[Any], rank: int, graceful: bool) -> None:
        """Forget the servers' names: no group to leave, the launcher owns the actors (and their sockets)."""
        from .socket_transport import unregister_servers

        unregister_servers(self.names)
