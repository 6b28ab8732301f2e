"""Parameter servers inside the trainers' processes: trainer ``r``'s process also holds and serves server ``r``.

With separate server processes a group of ``T`` trainers and ``N`` servers is ``T + N`` processes; on a machine
with few cores the servers then compete with the trainers for them. Here each trainer process also runs one
:class:`~scheduling.ps.server.PSServer` (the way torchrec's ``DistributedModelParallel`` keeps a table-wise
shard in the trainer that owns it): the ``torch.distributed.rpc`` group has ``T`` members, the servers are
the trainers' RPC worker names (:func:`trainer_servers`: ``["trainer0", ..., "trainer<T-1>"]``), and server
``i``'s requests go to worker ``trainer<i>``, whose RPC threads serve them with the same handlers as a server
process (:mod:`scheduling.ps.server`'s ``_rpc_*`` functions over the process-wide
:class:`~scheduling.ps.endpoints.ServerEndpoints`), concurrently with that trainer's own compute.

A trainer's requests to its own server skip RPC (:func:`call_local`, used by
:class:`~scheduling.ps.transport.TorchRPCTransport`): no serialisation, no copy, no network thread. They
still go through :meth:`ServerEndpoints.submit <scheduling.ps.endpoints.Endpoints.submit>`, so the request
order of :mod:`scheduling.ps.ordering` holds exactly as over RPC (issue order per client, step order across
the group: a lookup after a push sees it). A request whose turn has come runs on the calling thread
(``own_requests="inline"``) or on one server thread of the process (``"thread"``, started in issue order); one
that waits (for another trainer's push) runs later on the thread that releases it, e.g. the RPC thread
serving that trainer's push. Tensors are handed over as they are: the server only reads a request's tensors and
answers new ones, so sharing them changes nothing.

Use (in every trainer process, before it joins the group; rank 0 hosts the rendezvous)::

    serve_in_trainer(f"trainer{rank}", name=f"ps{rank}")
    init_trainer(f"trainer{rank}", rank, world_size=T, master_port=port)
    client = PSClient(tables, trainer_servers(T), ...)     # or parameter_servers(servers=trainer_servers(T))
    ...
    stop_serving()                                        # after leaving the group

Over the ``socket`` transport instead of RPC (:func:`serve_in_trainer_socket`): the same server also listens on a
TCP port of its own (:class:`~scheduling.ps.transport.socket_server.SocketServer` over the same endpoints, reader threads
in this process), the trainers learn each other's addresses through their process group
(:func:`share_addresses`), and the clients name the servers ``ps<i>``; this process's requests to its own
server still skip the transport (its address is routed to :func:`call_local`,
:func:`scheduling.ps.transport.socket_transport.route_locally`)::

    dist.init_process_group("gloo", ...)                  # the trainers' group
    serve_in_trainer_socket(f"ps{rank}")                  # listens on a free port
    share_addresses([f"ps{i}" for i in range(T)])         # every trainer: "ps<i>" -> trainer i's address
    client = PSClient(tables, [f"ps{i}" for i in range(T)], ...)   # picks transport="socket"
    ...
    stop_serving()                                        # closes the socket too

Source: torchrec ``DistributedModelParallel`` table-wise sharding (torchrec/distributed/sharding/tw_sharding.py:
each table lives in one trainer); ``torch.distributed.rpc`` (each worker serves incoming requests on its own
thread pool, ``TensorPipeRpcBackendOptions.num_worker_threads``).
"""

from __future__ import annotations

from typing import Any

import torch

from .endpoints import Endpoints

__all__ = ["serve_in_trainer", "serve_in_trainer_socket", "share_addresses", "stop_serving", "trainer_servers",
           "hosted_worker", "local_endpoints", "call_local"]

_HOSTED: dict[str, tuple[Endpoints, bool]] = {}
"""This process's RPC worker name -> (the endpoints of the server it hosts, whether its own requests skip RPC)."""
_OWN_THREAD: list[Any] = []
"""The one-thread executor running this process's own requests (``own_requests="thread"``), or empty."""
_SOCKET: list[Any] = []
"""The :class:`~scheduling.ps.transport.socket_server.SocketServer` of :func:`serve_in_trainer_socket`, or empty."""
OWN_REQUESTS = ("inline", "thread")
"""Where a trainer's direct requests to its own server run: on the calling thread, or on one server thread."""


def trainer_servers(world_size: int, prefix: str = "trainer") -> list[str]:
    """The servers of a group whose ``world_size`` trainers each host one: their RPC worker names
    ``<prefix>0 .. <prefix><world_size - 1>`` (server ``i`` is trainer ``i``).

    Raises:
        ValueError: ``world_size`` < 1.
    """
    if world_size < 1:
        raise ValueError(f"trainer_servers: world_size must be >= 1, got {world_size}")
    return [f"{prefix}{i}" for i in range(world_size)]


def serve_in_trainer(worker: str, name: str | None = None, *, fetch_delay_s: float = 0.0, push_delay_s: float = 0.0,
                     checkpoint: str | None = None, direct: bool = True, own_requests: str = "inline") -> Any:
    """Make this trainer process also a parameter server: requests that reach its RPC worker ``worker`` (other
    trainers' lookups and pushes) are served from a new :class:`~scheduling.ps.server.PSServer`, and with
    ``direct`` this process's own requests to ``worker`` skip RPC (:func:`call_local`). Call it before
    ``init_trainer`` so that no request arrives before the server exists.

    Args:
        worker: this process's RPC worker name (what ``init_trainer`` is given), e.g. ``"trainer0"``.
        name: the server's name in errors and checkpoint files (``<name>.pt``); default ``worker``.
        fetch_delay_s, push_delay_s: added latency per lookup / push, in seconds.
        checkpoint: a file written by ``PSServer.save`` to restore the shards from.
        direct: False sends this process's own requests through RPC too (a loopback connection), as a
            separate server process would receive them.
        own_requests: with ``direct``, where this process's own requests run: ``"inline"`` (on the thread
            that sends them, e.g. inside backward) or ``"thread"`` (handed to one server thread of this
            process, in issue order, so the sender goes on at once, as with RPC but without serialising).

    Returns:
        The :class:`~scheduling.ps.server.PSServer`.

    Raises:
        RuntimeError: a parameter server already runs in this process (``start_server`` or an earlier
            ``serve_in_trainer`` not ended by :func:`stop_serving`).
        ValueError: ``own_requests`` is not one of :data:`OWN_REQUESTS`.
    """
    from . import server as _srv

    if own_requests not in OWN_REQUESTS:
        raise ValueError(f"serve_in_trainer: own_requests={own_requests!r}; use one of {OWN_REQUESTS}")

    if _srv._ENDPOINTS.server is not None:
        raise RuntimeError(f"serve_in_trainer({worker!r}): parameter server {_srv._ENDPOINTS.server.name!r} already "
                           "runs in this process; call stop_serving() first")
    server = _srv.PSServer(name or worker, fetch_delay_s=fetch_delay_s, push_delay_s=push_delay_s)
    if checkpoint is not None:
        from .safe_load import safe_load

        server.load_state_dict(safe_load(checkpoint))
    _srv._ENDPOINTS.server = server
    _HOSTED.clear()
    _HOSTED[worker] = (_srv._ENDPOINTS, direct)
    if own_requests == "thread":
        from concurrent.futures import ThreadPoolExecutor

        _OWN_THREAD[:] = [ThreadPoolExecutor(1, thread_name_prefix=f"ps-{server.name}-own")]
    return server


def stop_serving() -> None:
    """Drop the server :func:`serve_in_trainer` started in this process (requests that still arrive are
    answered with an error); nothing when none runs."""
    from . import server as _srv

    if _SOCKET:
        from .transport.socket_transport import route_locally

        route_locally(_SOCKET[0].address, None)
        _SOCKET[0].close()
        _SOCKET.clear()
    if _HOSTED:
        _HOSTED.clear()
        _srv._ENDPOINTS.server = None
    for pool in _OWN_THREAD:
        pool.shutdown(wait=False)
    _OWN_THREAD.clear()


def serve_in_trainer_socket(name: str, host: str = "127.0.0.1", port: int = 0, *, auth_key: bytes | None = None,
                            save_root: str | None = None, **kwargs: Any) -> Any:
    """:func:`serve_in_trainer` ``(name, **kwargs)`` for clients of the ``socket`` transport: the server also
    listens on ``host:port`` (port 0: a free one, bound at once) for the other trainers' requests, served on
    reader threads of this process (:class:`~scheduling.ps.transport.socket_server.SocketServer` over the same endpoints);
    with ``direct`` (the default) this process's own requests to ``name`` or to its address skip the socket.

    Args:
        name: the server's name (what the clients list, e.g. ``"ps0"``, registered by :func:`share_addresses`).
        host: the address to listen on, which is also the one published (``"127.0.0.1"``: trainers of this
            machine only; on a cluster, this node's address the other nodes reach).
        port: the TCP port, 0 for one the OS picks.
        auth_key: the job key the other trainers prove they hold (the handshake of
            :mod:`scheduling.ps.transport.auth`); None: this process's (``auth.job_key``, drawn when none: then only
            this process and those it starts afterwards hold it).
        save_root: the directory a ``save`` request may write under (None: ``save`` refused over the socket).
        kwargs: :func:`serve_in_trainer`'s (``fetch_delay_s``, ``push_delay_s``, ``checkpoint``, ``direct``,
            ``own_requests``).

    Returns:
        The :class:`~scheduling.ps.transport.socket_server.SocketServer` (its ``address``: ``"host:port"`` as bound).

    Raises:
        RuntimeError: a parameter server already runs in this process.
        ValueError: a bad ``own_requests``.
        OSError: ``host:port`` cannot be bound (the server is dropped again).
        ValueError: a malformed job key; PermissionError: a key file readable by others.
    """
    import functools

    from . import server as _srv
    from .transport.socket_server import SocketServer
    from .transport.socket_transport import route_locally

    serve_in_trainer(name, **kwargs)
    try:
        listener = SocketServer(_srv._ENDPOINTS, host, port, auth_key=auth_key, save_root=save_root)
    except BaseException:
        stop_serving()
        raise
    _SOCKET[:] = [listener]
    if _HOSTED[name][1]:
        route_locally(listener.address, functools.partial(call_local, _srv._ENDPOINTS))
    return listener.start()


def share_addresses(names: list[str], group: Any = None) -> dict[str, str]:
    """Tell every trainer of the process group ``group`` (default: the default group; none initialised: this
    process alone) where each server listens: rank ``i`` hosts ``names[i]`` (:func:`serve_in_trainer_socket`,
    called before), ranks from ``len(names)`` on host none. A collective: every rank calls it. Registers the
    names for this process's socket clients (:func:`scheduling.ps.transport.socket_transport.register_servers`) and
    returns ``{name: "host:port"}``.

    Raises:
        RuntimeError: more names than ranks, or a rank that should host one serves no socket server (raised on
            every rank).
    """
    import torch.distributed as dist

    from .transport.socket_transport import register_servers

    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if len(names) > world:
        raise RuntimeError(f"share_addresses: {len(names)} names {names} for a group of {world} trainers")
    mine = _SOCKET[0].address if _SOCKET else None
    found: list[Any] = [mine]
    if dist.is_initialized():
        found = [None] * world
        dist.all_gather_object(found, mine, group=group)
    missing = [f"rank {i} ({n})" for i, (n, a) in enumerate(zip(names, found)) if a is None]
    if missing:
        raise RuntimeError(f"share_addresses: {', '.join(missing)} serves no socket server; call "
                           "serve_in_trainer_socket there first")
    addresses = dict(zip(names, found))
    register_servers(addresses)
    return addresses


def hosted_worker() -> str | None:
    """The RPC worker name whose server this process hosts (:func:`serve_in_trainer`), or None."""
    return next(iter(_HOSTED), None)


def local_endpoints(worker: str) -> Endpoints | None:
    """The endpoints to call directly for requests to ``worker``: this process's server when it hosts
    ``worker``'s with ``direct`` (``worker``: an RPC worker name, or a :func:`serve_in_trainer_socket` server's
    name); else None (send them by the transport)."""
    hosted = _HOSTED.get(worker)
    return hosted[0] if hosted is not None and hosted[1] else None


def call_local(endpoints: Endpoints, method: str, args: tuple) -> torch.futures.Future:
    """Request ``method(*args)`` (:data:`~scheduling.ps.endpoints.METHODS`) of this process's server, without
    RPC: a ``torch.futures.Future`` of the answer, completed as the transport's would be (the server's own
    exception, e.g. ``ValueError``, raised by ``wait()``; a ``batch`` answers ``[(answer, error), ...]``).
    Ordered requests (``lookup``, ``peek``, ``push``, ``push_lookup``, ``batch``) follow :mod:`scheduling.ps.ordering`:
    they run on this thread when their turn has come (on the server's own thread with
    ``own_requests="thread"``, in issue order), else later on the thread that releases them."""
    future: torch.futures.Future = torch.futures.Future()
    if _OWN_THREAD:  # every request, so they start in issue order
        _OWN_THREAD[0].submit(_call, endpoints, method, args, future)
    else:
        _call(endpoints, method, args, future)
    return future


def _call(endpoints: Endpoints, method: str, args: tuple, future: torch.futures.Future) -> None:
    def done(value: Any, error: BaseException | None) -> None:
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    try:
        if method in Endpoints.ORDERED:
            endpoints.submit(method, args, done)
        elif method == "batch":
            (calls,) = args
            endpoints.submit_batch(calls, done)
        else:
            done(getattr(endpoints, method)(*args), None)
    except Exception as e:  # noqa: BLE001  (no server here, bad arguments: raised by wait(), as over RPC)
        if method == "batch":
            done([(None, e)] * len(args[0]), None)
        else:
            done(None, e)
