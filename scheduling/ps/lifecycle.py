"""Running a group of parameter servers: start, kill, stop, and a job's rendezvous, join and leave.

A server group is cut along two axes. The *transport* axis is this module: one lifecycle class per transport,
named in :data:`SERVER_GROUPS` (:class:`TorchRPCServers` here, :class:`scheduling.ps.transport.ray_transport.RayServers`),
for how the group meets, joins and leaves; how a client sends its requests is :mod:`scheduling.ps.transport`'s
part. The *host* axis is where the servers run, the lifecycle's ``host``: child processes
(:class:`scheduling.ps.hosts.ProcessHost`) or Ray actors (:class:`scheduling.ps.transport.ray_transport.ActorHost`);
every kill goes through it (``kill(index)``, restarted where the host restarts; ``kill_all()``, for good).
:class:`scheduling.ps.LocalCluster` and a job's worker group (``jobs.trainer.servers.ServerGroup``) hold one lifecycle
object and call the same methods, so neither branches on the transport.

Raises (from the methods): ``scheduling.ps.PSUnavailableError`` when a group does not assemble in time.

Source: torch.distributed.rpc (``init_rpc``, ``shutdown``: one static group, no re-admission); Ray actors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .client import init_trainer
from .hosts import ProcessHost, ServerAnswer
from .transport.ports import BIND_ATTEMPTS, free_port, is_bind_failure, reserve_port
from .transport.registry import load_class
from .transport.torch_rpc import TorchRPCTransport

__all__ = ["TorchRPCServers", "SERVER_GROUPS", "server_group"]


def _server_main(name: str, rank: int, world_size: int, port: int, kwargs: dict[str, Any]) -> None:
    from recsys.quiet import filtered_stderr

    from .server import start_server

    with filtered_stderr():  # TensorPipe's lines as members leave (recsys.quiet.TENSORPIPE_SHUTDOWN)
        start_server(name, rank, world_size, master_port=port, **kwargs)


class TorchRPCServers:
    """The lifecycle of a group of ``torch_rpc`` parameter servers (the ``transport`` object of
    :class:`~scheduling.ps.LocalCluster` and of a job's worker group, ``jobs.trainer.servers.ServerGroup``).

    One static ``torch.distributed.rpc`` group holds the trainers and the servers. Locally (:meth:`start`) the
    servers are child processes; in a job they are the launcher's server actors, which :meth:`join` has join a
    new group (``torch.distributed.rpc`` cannot re-admit a member into a live one).

    Args:
        names: RPC worker names of the servers (``ps<i>``); ``timeout_s``: RPC and start-up timeout, seconds.
    """

    name = "torch_rpc"

    def __init__(self, names: Sequence[str], timeout_s: float) -> None:
        self.names, self.timeout_s = list(names), timeout_s
        self._reservation: Any = None  # the socket holding the rendezvous port until rank 0 binds it
        self.host: Any = ProcessHost()
        """Where the servers run (:mod:`scheduling.ps.hosts`): child processes (:meth:`start`), or the job's
        actors (from :meth:`join` on)."""

    @property
    def processes(self) -> list[Any]:
        """The server processes (:meth:`start`; none in a job)."""
        return self.host.processes if isinstance(self.host, ProcessHost) else []

    @property
    def actors(self) -> list[Any]:
        """The server actors (a job's, from :meth:`join` on; none on one machine)."""
        return [] if isinstance(self.host, ProcessHost) else self.host.actors

    # ---- on one machine (LocalCluster) ----
    def start(self, kwargs: Sequence[dict[str, Any]], *, port: int, trainer_name: str, ctx: Any) -> int:
        """Start one server process per name (``kwargs[i]`` to its ``start_server``; rank ``i + 1``) and join
        their group as rank 0, ``trainer_name``, hosting the rendezvous on loopback ``port``. When that port was
        taken before the rendezvous bound it (:func:`scheduling.ps.transport.ports.is_bind_failure`), the servers are
        killed and the group starts again on a new free port, up to ``BIND_ATTEMPTS`` ports in all. Returns the
        port the group met on.

        Raises:
            scheduling.ps.PSUnavailableError: the group did not assemble within ``timeout_s`` seconds, or no
                port could be bound in ``BIND_ATTEMPTS`` tries.
        """
        for attempt in range(BIND_ATTEMPTS):
            try:
                self._start(kwargs, port, trainer_name, ctx)
                return port
            except BaseException as e:
                self.kill_all()
                self.host = ProcessHost()
                if attempt + 1 == BIND_ATTEMPTS or not is_bind_failure(e):
                    raise
                port = free_port()
        raise AssertionError("unreachable")

    def _start(self, kwargs: Sequence[dict[str, Any]], port: int, trainer_name: str, ctx: Any) -> None:
        world = len(self.names) + 1
        self.host.start(ctx, _server_main, [(name, i + 1, world, port, kwargs[i]) for i, name in enumerate(self.names)],
                        self.names)
        init_trainer(trainer_name, 0, world, master_port=port, timeout_s=self.timeout_s)

    def kill(self, index: int) -> None:
        """Kill server ``index`` (a crash: no goodbye to the group): its process with SIGKILL, or in a job its
        actor, which Ray restarts while it has restarts left (:meth:`scheduling.ps.transport.ray_transport.ActorHost.kill`)."""
        self.host.kill(index)

    def kill_all(self) -> None:
        """Kill every server for good (:meth:`ProcessHost.kill_all`, ``ray_transport.ActorHost.kill_all``)."""
        self.host.kill_all()

    def stop(self, joined: bool) -> None:
        """Ask the live servers to stop (:meth:`TorchRPCTransport.stop`), leave the group (if ``joined``) and
        make sure the server processes are gone."""
        from recsys.quiet import filtered_stderr

        with filtered_stderr():  # TensorPipe's lines as the servers leave (recsys.quiet.TENSORPIPE_SHUTDOWN)
            self._stop(joined)

    def _stop(self, joined: bool) -> None:
        from torch.distributed import rpc

        try:
            if joined:
                live = [n for n, p in zip(self.names, self.processes) if p.is_alive()]
                TorchRPCTransport(self.names).stop(2.0, live)
                rpc.shutdown(graceful=False)
            if isinstance(self.host, ProcessHost):
                self.host.wait(10.0)
        finally:
            self.kill_all()

    def reaches(self, client: Any) -> bool:
        """Whether ``client`` (a PSClient of this process) uses one of these servers (one RPC group per
        process: a client using one of the names)."""
        return client.transport.name == self.name and bool(set(client.servers) & set(self.names))

    # ---- in a job: the launcher's server actors (jobs.trainer.servers) ----
    def rendezvous(self, host: str, actors: Sequence[Any]) -> tuple[str, int]:
        """Rank 0 of a new trainer group: where the new RPC group meets, ``(host, a free port of host)``. The
        port stays reserved (:func:`scheduling.ps.transport.ports.reserve_port`) until rank 0's :meth:`join` has bound it,
        so no other process is handed it in between (it could bind the port first).

        Raises:
            OSError: ``host`` is not an address of this machine.
        """
        port, self._reservation = reserve_port(host)
        return (host, port)

    def join(self, actors: Sequence[Any], rank: int, world: int, rendezvous: tuple[str, int],
             before_join: Callable[[str], None] | None = None) -> list[ServerAnswer]:
        """Trainer ``rank`` of ``world`` joins the group at ``rendezvous``; on rank 0 the server ``actors`` join
        it too (ranks ``world .. world + N - 1``), leaving
        their previous group. ``before_join(host)`` runs first (e.g. choose the network interface). Returns the
        servers' answers (rank 0; ``[]`` elsewhere).

        Raises:
            scheduling.ps.PSUnavailableError: the group did not assemble within ``timeout_s``.
        """
        from .transport.ray_transport import ActorHost, wait_all

        self.host = ActorHost(actors)
        host, port = rendezvous
        total = world + len(self.names)
        if before_join is not None:
            before_join(host)
        joins = [a.join.remote(world + i, total, host, port) for i, a in enumerate(actors)] if rank == 0 else []
        self.join_group(rank, total, host, port)
        return wait_all(joins, None) if joins else []

    def join_group(self, rank: int, world: int, host: str, port: int) -> None:
        """This process joins the RPC group of ``world`` members at ``host:port`` as ``trainer<rank>``, then releases
        the port reservation of :meth:`rendezvous` (rank 0's store has bound the port, or failed).

        Raises:
            scheduling.ps.PSUnavailableError: the group did not assemble within ``timeout_s``.
        """
        try:
            init_trainer(f"trainer{rank}", rank, world, master_addr=host, master_port=port, timeout_s=self.timeout_s)
        finally:
            if self._reservation is not None:
                self._reservation.close()
                self._reservation = None

    def leave(self, actors: Sequence[Any], rank: int, graceful: bool) -> None:
        """Trainer ``rank`` leaves the group; with ``graceful`` on rank 0, the server ``actors`` leave it too
        (after a failure the next group's :meth:`join` makes them leave the broken one)."""
        from torch.distributed import rpc

        from recsys.quiet import filtered_stderr

        with filtered_stderr():  # TensorPipe's lines as members leave (recsys.quiet.TENSORPIPE_SHUTDOWN)
            rpc.shutdown(graceful=False)
        if graceful and rank == 0 and actors:
            from .transport.ray_transport import wait_all

            wait_all([a.leave.remote() for a in actors], self.timeout_s)


SERVER_GROUPS = {"torch_rpc": "scheduling.ps.lifecycle:TorchRPCServers",
                 "ray": "scheduling.ps.transport.ray_transport:RayServers",
                 "socket": "scheduling.ps.transport.socket_server:SocketServers"}
"""Transport name -> the class running its servers' lifecycle (start, reset/join, kill, stop); the ``ray`` and
``socket`` ones are imported only when asked for (``socket``: on one machine only, ``LocalCluster``)."""


def server_group(name: str) -> type:
    """The lifecycle class of transport ``name`` (see :data:`SERVER_GROUPS`).

    Raises:
        ValueError: an unknown transport; the message lists the known ones.
    """
    return load_class(SERVER_GROUPS, name)
