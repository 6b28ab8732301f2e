"""How a :class:`~scheduling.ps.PSClient` reaches its servers: ``torch_rpc`` or ``ray``.

A transport sends one request (a :data:`~scheduling.ps.endpoints.METHODS` name and its arguments) to
server ``i`` of the client's list and returns a handle with ``wait()`` and ``done()``. Contract shared by
both, so the client needs no branch:

- ``call_async`` raises ``RuntimeError`` when the request cannot be sent;
- ``handle.wait()`` returns the server's answer, raises a plain ``RuntimeError`` when the transport failed
  (timeout, connection lost, server process died) and the server's own exception (``ValueError``...)
  otherwise.

``torch_rpc`` (:class:`TorchRPCTransport`): servers are ``torch.distributed.rpc`` worker names of one
static group (rendezvous, no re-admission after a crash). ``ray`` (:mod:`scheduling.ps.ray_transport`,
imported only when asked for): servers are Ray actors (``handle.lookup.remote(...)``, waited with
``ray.get``); no group, so a restarted server actor is reachable again through the same handle.

Source: torch.distributed.rpc (``rpc_async``); Ray actors (``ActorHandle.method.remote``, ``ray.get``).
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["TRANSPORTS", "DEFAULT_TRANSPORT", "TorchRPCTransport", "TorchRPCServers", "SERVER_GROUPS",
           "CLIENT_TRANSPORTS", "server_group", "make_transport", "transport_of"]

TRANSPORTS = ("torch_rpc", "ray")
"""The transports a client can use."""
DEFAULT_TRANSPORT = "torch_rpc"
"""Used when nothing says otherwise (see benchmarks/transport.py and the README for why)."""


class TorchRPCTransport:
    """Requests as ``torch.distributed.rpc.rpc_async`` calls of :mod:`scheduling.ps.server`'s ``_rpc_*``
    functions; ``servers`` are the RPC worker names (this process must be in their group)."""

    name = "torch_rpc"

    def __init__(self, servers: Sequence[Any]) -> None:
        bad = [s for s in servers if not isinstance(s, str)]
        if bad:
            raise ValueError(f"transport 'torch_rpc': servers are RPC worker names (str), got {bad[0]!r}; "
                             "use transport='ray' for Ray actor handles")
        self.names = list(servers)

    def call_async(self, server: int, method: str, args: tuple, timeout_s: float) -> Any:
        from torch.distributed import rpc

        from . import server as _srv

        return rpc.rpc_async(self.names[server], getattr(_srv, f"_rpc_{method}"), args, timeout=timeout_s)

    def stop(self, timeout_s: float, names: Sequence[str] | None = None) -> None:
        """Ask every server (or those of ``names``) to leave the group (their ``start_server(block=True)``
        returns); best effort: the one stop loop of the ``torch_rpc`` servers."""
        from torch.distributed import rpc

        from . import server as _srv

        futs = []
        for name in self.names if names is None else names:
            try:
                futs.append(rpc.rpc_async(name, _srv._rpc_stop, (), timeout=timeout_s))
            except RuntimeError:
                pass
        for fut in futs:
            try:
                fut.wait()
            except RuntimeError:
                pass


def transport_of(servers: Sequence[Any]) -> str:
    """The transport for ``servers`` when the caller names none: ``"ray"`` for Ray actor handles or for names
    registered by :func:`scheduling.ps.ray_transport.register_servers` (a ``LocalCluster(transport="ray")``
    or a job does that), else :data:`DEFAULT_TRANSPORT`."""
    ray_transport = sys.modules.get("scheduling.ps.ray_transport")  # only loaded once Ray servers exist
    if ray_transport is not None and servers and all(ray_transport.is_ray_server(s) for s in servers):
        return "ray"
    return DEFAULT_TRANSPORT


def make_transport(name: str | None, servers: Sequence[Any]) -> Any:
    """A transport to ``servers``: ``name`` one of :data:`TRANSPORTS`, None for :func:`transport_of`.

    Raises:
        ValueError: an unknown transport, or servers of the wrong kind for it.
    """
    name = transport_of(servers) if name is None else name
    return _load(CLIENT_TRANSPORTS, name)(servers)


CLIENT_TRANSPORTS = {"torch_rpc": "scheduling.ps.transport:TorchRPCTransport",
                     "ray": "scheduling.ps.ray_transport:RayTransport"}
"""Transport name -> the class a client sends its requests with; the ``ray`` one is imported only when asked
for."""


def _load(registry: dict[str, str], name: str) -> Any:
    if name not in registry:
        raise ValueError(f"unknown parameter-server transport {name!r}; known transports: "
                         f"{', '.join(sorted(registry))}")
    module, _, cls = registry[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def _server_main(name: str, rank: int, world_size: int, port: int, kwargs: dict[str, Any]) -> None:
    from .server import start_server

    start_server(name, rank, world_size, master_port=port, **kwargs)


class TorchRPCServers:
    """The lifecycle of a group of ``torch_rpc`` parameter servers (the ``transport`` object of
    :class:`~scheduling.ps.LocalCluster` and of a job's worker group, ``jobs.ps.ServerGroup``).

    One static ``torch.distributed.rpc`` group holds the trainers and the servers. Locally (:meth:`start`) the
    servers are child processes; in a job they are the launcher's server actors, which :meth:`join` has join a
    new group (``torch.distributed.rpc`` cannot re-admit a member into a live one).

    Args:
        names: RPC worker names of the servers (``ps<i>``); ``timeout_s``: RPC and start-up timeout, seconds.
    """

    name = "torch_rpc"

    def __init__(self, names: Sequence[str], timeout_s: float) -> None:
        self.names, self.timeout_s = list(names), timeout_s
        self.processes: list[Any] = []
        self.actors: list[Any] = []

    # ---- on one machine (LocalCluster) ----
    def start(self, kwargs: Sequence[dict[str, Any]], *, port: int, trainer_name: str, ctx: Any) -> None:
        """Start one server process per name (``kwargs[i]`` to its ``start_server``; rank ``i + 1``) and join
        their group as rank 0, ``trainer_name``, hosting the rendezvous on loopback ``port``.

        Raises:
            scheduling.ps.PSUnavailableError: the group did not assemble within ``timeout_s``.
        """
        from .client import init_trainer

        world = len(self.names) + 1
        for i, name in enumerate(self.names):
            proc = ctx.Process(target=_server_main, args=(name, i + 1, world, port, kwargs[i]), daemon=True,
                               name=f"fxdist-{name}")
            proc.start()
            self.processes.append(proc)
        try:
            init_trainer(trainer_name, 0, world, master_port=port, timeout_s=self.timeout_s)
        except BaseException:
            self.kill_all()
            raise

    def kill(self, index: int) -> None:
        """Kill server ``index``'s process with SIGKILL (a crash: no goodbye to the group)."""
        proc = self.processes[index]
        proc.kill()
        proc.join(timeout=10)

    def kill_all(self) -> None:
        """Kill every server process still alive."""
        for proc in self.processes:
            if proc.is_alive():
                proc.kill()
        for proc in self.processes:
            proc.join(timeout=10)

    def stop(self, joined: bool) -> None:
        """Ask the live servers to stop (:meth:`TorchRPCTransport.stop`), leave the group (if ``joined``) and
        make sure the server processes are gone."""
        from torch.distributed import rpc

        try:
            if joined:
                live = [n for n, p in zip(self.names, self.processes) if p.is_alive()]
                TorchRPCTransport(self.names).stop(2.0, live)
                rpc.shutdown(graceful=False)
            deadline = time.monotonic() + 10
            for proc in self.processes:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            self.kill_all()

    def reaches(self, client: Any) -> bool:
        """Whether ``client`` (a PSClient of this process) uses one of these servers (one RPC group per
        process: a client using one of the names)."""
        return client.transport.name == self.name and bool(set(client.servers) & set(self.names))

    # ---- in a job: the launcher's server actors (jobs.ps) ----
    def rendezvous(self, host: str, actors: Sequence[Any]) -> tuple[str, int]:
        """Rank 0 of a new trainer group: where the new RPC group meets, ``(host, a free port of host)``."""
        from .launch import free_port

        return (host, free_port(host))

    def join(self, actors: Sequence[Any], rank: int, world: int, rendezvous: tuple[str, int],
             before_join: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
        """Trainer ``rank`` of ``world`` joins the group at ``rendezvous``; on rank 0 the server ``actors`` join
        it too (ranks ``world .. world + N - 1``), leaving
        their previous group. ``before_join(host)`` runs first (e.g. choose the network interface). Returns the
        servers' answers (rank 0; ``[]`` elsewhere).

        Raises:
            scheduling.ps.PSUnavailableError: the group did not assemble within ``timeout_s``.
        """
        from .client import init_trainer
        from .ray_transport import wait_all

        host, port = rendezvous
        total = world + len(self.names)
        if before_join is not None:
            before_join(host)
        joins = [a.join.remote(world + i, total, host, port) for i, a in enumerate(actors)] if rank == 0 else []
        init_trainer(f"trainer{rank}", rank, total, master_addr=host, master_port=port, timeout_s=self.timeout_s)
        return wait_all(joins, None) if joins else []

    def leave(self, actors: Sequence[Any], rank: int, graceful: bool) -> None:
        """Trainer ``rank`` leaves the group; with ``graceful`` on rank 0, the server ``actors`` leave it too
        (after a failure the next group's :meth:`join` makes them leave the broken one)."""
        from torch.distributed import rpc

        rpc.shutdown(graceful=False)
        if graceful and rank == 0 and actors:
            from .ray_transport import wait_all

            wait_all([a.leave.remote() for a in actors], self.timeout_s)


SERVER_GROUPS = {"torch_rpc": "scheduling.ps.transport:TorchRPCServers",
                 "ray": "scheduling.ps.ray_transport:RayServers"}
"""Transport name -> the class running its servers' lifecycle (start, reset/join, kill, stop); the ``ray`` one
is imported only when asked for."""


def server_group(name: str) -> type:
    """The lifecycle class of transport ``name`` (see :data:`SERVER_GROUPS`).

    Raises:
        ValueError: an unknown transport; the message lists the known ones.
    """
    return _load(SERVER_GROUPS, name)
