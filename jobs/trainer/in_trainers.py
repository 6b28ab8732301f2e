"""A job's parameter servers inside its trainers' processes (``[cluster] servers_in_trainers``, :mod:`jobs.hosting`).

:class:`InTrainerServers` is the lifecycle object of :class:`jobs.trainer.servers.ServerGroup` when the servers live in
the trainers: each worker group forms one ``torch.distributed.rpc`` group of its ``T`` trainers only (ranks
``0..T-1``, named ``trainer<r>``; rank 0 hosts the rendezvous, as with server actors), and trainer ``i < N`` first
starts server ``ps<i>`` in its own process (:func:`scheduling.ps.in_trainers.serve_in_trainer`), so the servers' RPC
names are ``trainer0 .. trainer<N-1>``. Its own requests skip RPC; another trainer's are served by its RPC threads.

A server dies with its trainer: when Ray Train restarts the worker group (a killed trainer, a dead node), every
trainer process of the new group starts an empty server and the trainers load the tables of the last checkpoint
into them, as after a killed server actor (:mod:`jobs.trainer.servers`). There is no server process to kill alone
(``[faults] kill_server_at_step`` is refused) and no server actor to call (the ``ray`` transport is refused).

With ``[cluster] transport = "socket"`` (:class:`InTrainerSocketServers`) there is no RPC group: trainer ``i < N``
serves ``ps<i>`` on a TCP socket of its node (:func:`scheduling.ps.in_trainers.serve_in_trainer_socket`, port 0),
the trainers share the addresses over their ``torch.distributed`` process group
(:func:`scheduling.ps.in_trainers.share_addresses`), and a trainer's requests to its own server skip the socket.

Source: :mod:`scheduling.ps.in_trainers`; torchrec ``DistributedModelParallel`` table-wise sharding
(torchrec/distributed/sharding/tw_sharding.py); torch.distributed.rpc (one static group, no re-admission).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from scheduling.ps import serve_in_trainer, stop_serving, trainer_servers
from scheduling.ps.lifecycle import TorchRPCServers

if TYPE_CHECKING:
    from jobs.records import ServerJoin

__all__ = ["InTrainerServers", "InTrainerSocketServers", "in_trainer_names"]


def in_trainer_names(servers: int) -> list[str]:
    """The RPC names of ``servers`` in-trainer servers: server ``i`` is trainer ``i`` (``trainer<i>``).

    Raises:
        ValueError: ``servers`` < 1.
    """
    return trainer_servers(servers)


class InTrainerServers(TorchRPCServers):
    """The ``torch_rpc`` lifecycle of servers hosted by the trainers (see the module docstring): :meth:`join` starts
    this trainer's server (``ps<rank>`` when ``rank < N``) before joining the trainers' RPC group; :meth:`leave`
    drops it after leaving. ``exporter`` (a :class:`jobs.trainer.metrics.Exporter`, or None) exports the server's
    metrics under ``rank = "ps<i>"``.

    Args:
        names: the servers' RPC names (:func:`in_trainer_names`); ``timeout_s``: RPC and group timeout, seconds;
        fetch_delay_s: added latency per lookup, seconds (``[cluster] server_fetch_delay_ms``).
    """

    name = "torch_rpc"

    def __init__(self, names: Sequence[str], timeout_s: float, *, fetch_delay_s: float = 0.0,
                 exporter: Any = None) -> None:
        super().__init__(names, timeout_s)
        self.fetch_delay_s, self.exporter = fetch_delay_s, exporter
        self.server: Any = None
        """The server this trainer hosts (a ``scheduling.ps.PSServer``), or None."""

    def join(self, actors: Sequence[Any], rank: int, world: int, rendezvous: tuple[str, int],
             before_join: Callable[[str], None] | None = None) -> list[ServerJoin]:
        """Trainer ``rank`` of ``world`` starts its server (``rank < N``), then joins the group at ``rendezvous``
        (``actors`` must be empty: no server actor takes part). Returns ``[]``.

        With a lookup delay a trainer's own requests run on one server thread (``own_requests="thread"``), so the
        delay does not stall the trainer, as it does not with a server process; without one they run inline.

        Raises:
            ValueError: server actors were given.
            scheduling.ps.PSUnavailableError: the group did not assemble within ``timeout_s``.
        """
        _no_actors(self, actors)
        host, port = rendezvous
        if before_join is not None:
            before_join(host)
        _host_server(self, rank, lambda **kw: serve_in_trainer(self.names[rank], name=f"ps{rank}", **kw))
        self.join_group(rank, world, host, port)
        return []

    def leave(self, actors: Sequence[Any], rank: int, graceful: bool) -> None:
        """Leave the group, then drop this trainer's server (the other trainers have left too when ``graceful``:
        the job's close waits for every trainer first)."""
        super().leave((), rank, graceful)
        stop_serving()
        self.server = None

    def kill(self, index: int) -> None:
        """Not possible: server ``index`` is trainer ``index``'s process (kill the trainer instead).

        Raises:
            RuntimeError: always.
        """
        _cannot_kill(index)


class InTrainerSocketServers:
    """The ``socket`` lifecycle of servers hosted by the trainers (see the module docstring): :meth:`join` starts
    this trainer's server ``ps<rank>`` (``rank < N``) on a socket, then every trainer learns every server's address;
    :meth:`leave` drops it. Same methods as :class:`InTrainerServers`.

    Args:
        names: the servers' names ``ps<i>`` (what the clients list); ``timeout_s``: not used (no group to form);
        fetch_delay_s: added latency per lookup, seconds; ``exporter``: as :class:`InTrainerServers`'s;
        save_root: the folder the servers' checkpoints by shard may be written and read under (the run folder).
    """

    name = "socket"

    def __init__(self, names: Sequence[str], timeout_s: float, *, fetch_delay_s: float = 0.0,
                 exporter: Any = None, save_root: Any = None) -> None:
        self.names, self.timeout_s = list(names), timeout_s
        self.save_root = None if save_root is None else str(save_root)
        """Where the servers may write and read checkpoints by shard over the socket (the run folder), or None."""
        self.fetch_delay_s, self.exporter = fetch_delay_s, exporter
        self.server: Any = None
        """The server this trainer hosts (a ``scheduling.ps.PSServer``), or None."""
        self.world = 1

    def rendezvous(self, host: str, actors: Sequence[Any]) -> str:
        """Rank 0 of a new trainer group: the address the group binds to (``host``); a loopback one makes every
        trainer listen on it, else each listens on its own node's Ray address."""
        return host

    def join(self, actors: Sequence[Any], rank: int, world: int, rendezvous: str,
             before_join: Callable[[str], None] | None = None) -> list[ServerJoin]:
        """Trainer ``rank`` of ``world`` serves ``ps<rank>`` on a free port (``rank < N``), then takes every server's
        address from the other trainers (a collective of the ``torch.distributed`` group; alone without one).
        Returns ``[]``.

        Raises:
            ValueError: server actors were given.
            RuntimeError: no ``torch.distributed`` group with ``world > 1``.
            OSError: the address cannot be bound.
        """
        import torch.distributed as dist

        from jobs.cluster import is_loopback, node_address
        from scheduling.ps.in_trainers import serve_in_trainer_socket, share_addresses

        _no_actors(self, actors)
        if world > 1 and not dist.is_initialized():
            raise RuntimeError(f"InTrainerSocketServers.join: {world} trainers without a torch.distributed group "
                               "to share the servers' addresses over")
        self.world = world

        def serve(**kw: Any) -> Any:
            host = rendezvous if is_loopback(rendezvous) else node_address()
            return serve_in_trainer_socket(self.names[rank], host=host, save_root=self.save_root, **kw).endpoints.server

        _host_server(self, rank, serve)
        share_addresses(self.names)
        return []

    def leave(self, actors: Sequence[Any], rank: int, graceful: bool) -> None:
        """Drop this trainer's server and forget the names; ``graceful``: first wait for every trainer (no one
        still sends to it)."""
        import torch.distributed as dist

        from scheduling.ps.transport.socket_transport import unregister_servers

        if graceful and self.world > 1 and dist.is_initialized():
            dist.barrier()
        stop_serving()
        unregister_servers(self.names)
        self.server = None

    def kill(self, index: int) -> None:
        """Not possible: server ``index`` is trainer ``index``'s process (kill the trainer instead).

        Raises:
            RuntimeError: always.
        """
        _cannot_kill(index)


def _no_actors(lifecycle: Any, actors: Sequence[Any]) -> None:
    """Servers in the trainers have no server actors.

    Raises:
        ValueError: ``actors`` is not empty.
    """
    if actors:
        raise ValueError(f"{type(lifecycle).__name__}.join: {len(actors)} server actors given; servers in the "
                         "trainers have none")


def _host_server(lifecycle: Any, rank: int, serve: Callable[..., Any]) -> None:
    """Drop this process's old server (a reused process: it went with its old group), then, on trainer ``rank <
    N``, start its server with ``serve(fetch_delay_s=..., own_requests=...)`` (returning the ``PSServer``) into
    ``lifecycle.server`` and let the exporter watch it as ``ps<rank>`` (own requests on a server thread with a
    lookup delay, see :meth:`InTrainerServers.join`)."""
    stop_serving()
    if rank < len(lifecycle.names):
        lifecycle.server = serve(fetch_delay_s=lifecycle.fetch_delay_s,
                                 own_requests="thread" if lifecycle.fetch_delay_s > 0 else "inline")
        if lifecycle.exporter is not None:
            lifecycle.exporter.watch_server(lifecycle.server, rank=f"ps{rank}")


def _cannot_kill(index: int) -> None:
    """Server ``index`` of servers in the trainers is trainer ``index``'s process.

    Raises:
        RuntimeError: always.
    """
    raise RuntimeError(f"server ps{index} runs inside trainer {index}'s process: kill the trainer instead "
                       "([faults] kill_trainer_at_step)")
