"""Start a small parameter-server group on this machine: N server processes plus this process as trainer.

With ``transport="ray"`` the servers are Ray actors (:mod:`scheduling.ps.transport.ray_transport`) of this process's
Ray session (a local one is started if none runs) and there is no RPC group.

Used by the tests, the benchmark and the Criteo example; :func:`group_servers` finds the servers of the group
this process is in (what :func:`scheduling.parameter_servers` places tables on). On a cluster, start each server with
:func:`scheduling.ps.start_server` wherever it runs (e.g. in a Ray actor) and each trainer with
:func:`scheduling.ps.init_trainer`; this module only automates the loopback case.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Sequence
from typing import Any

from .endpoints import DEFAULT_WORKER_THREADS
from .lifecycle import server_group
from .transport.ports import free_port

__all__ = ["LocalCluster", "group_servers", "NoGroupError"]

_ACTIVE: list["LocalCluster"] = []  # started and not closed, in this process

_HOW_TO_START = (
    "Start one first: on one machine `with scheduling.ps.LocalCluster(num_servers=2): ...` (servers in child "
    "processes, this process joins as the trainer); in a job, start each server with "
    "scheduling.ps.start_server(...) and join as a trainer with scheduling.ps.init_trainer(...) (jobs/trainer/servers.py "
    "does both)"
)


class NoGroupError(RuntimeError):
    """No parameter-server group (``torch.distributed.rpc``) is running in this process, or it has no server.

    See docs/troubleshooting.md#nogrouperror.
    """


class LocalCluster:
    """``num_servers`` parameter servers in child processes, on loopback; this process joins as the trainer.

    Ranks: the trainer is rank 0 (it hosts the rendezvous store), server ``i`` is rank ``i + 1`` named
    ``"ps<i>"``. Use as a context manager; leaving it shuts the group down and kills any server left.

    Args:
        num_servers: how many servers.
        fetch_delay_s, push_delay_s: added latency per lookup / push on every server, in seconds.
        timeout_s: RPC timeout and start-up timeout, in seconds.
        checkpoints: per server, a checkpoint file to restart from (or None).
        start_method: multiprocessing start method of the servers.
        transport: ``"torch_rpc"`` (server processes in one RPC group with this process) or ``"ray"`` (Ray
            actors, registered under ``"ps<i>"`` so clients in this process can name them).
        num_worker_threads: threads serving each server's requests (TensorPipe's worker threads; the Ray
            actor's threads running lookups and pushes). A request waiting for its turn holds none of them
            (:mod:`scheduling.ps.ordering`), so this bounds only how much work runs at once.

    Closing the cluster also closes (without waiting their pushes) the clients of this process that use its
    servers: their servers are gone, and a later cluster reuses the names ``"ps<i>"`` (with its own optimizer
    and learning rate).

    Raises:
        ValueError: ``num_servers`` or ``num_worker_threads`` < 1, or an unknown ``transport`` (the message
            lists the known ones).
    """

    def __init__(self, num_servers: int = 2, *, fetch_delay_s: float = 0.0, push_delay_s: float = 0.0,
                 timeout_s: float = 20.0, checkpoints: Sequence[str | None] | None = None,
                 start_method: str = "spawn", trainer_name: str = "trainer", transport: str = "torch_rpc",
                 num_worker_threads: int = DEFAULT_WORKER_THREADS) -> None:
        if num_servers < 1:
            raise ValueError(f"LocalCluster: need at least one server, got {num_servers}")
        if num_worker_threads < 1:
            raise ValueError(f"LocalCluster: num_worker_threads must be >= 1, got {num_worker_threads}")

        self.transport = transport
        self.server_names = [f"ps{i}" for i in range(num_servers)]
        self.servers = server_group(transport)(self.server_names, timeout_s)
        """The transport's lifecycle object (:data:`scheduling.ps.lifecycle.SERVER_GROUPS`)."""
        self.num_servers = num_servers
        self.trainer_name = trainer_name
        self.timeout_s = timeout_s
        self.port = free_port()
        self._ctx = mp.get_context(start_method)
        self.num_worker_threads = num_worker_threads
        self._kwargs = [dict(fetch_delay_s=fetch_delay_s, push_delay_s=push_delay_s, timeout_s=timeout_s,
                             checkpoint=(checkpoints[i] if checkpoints else None),
                             num_worker_threads=num_worker_threads) for i in range(num_servers)]
        self._rpc_up = False

    @property
    def processes(self) -> list[Any]:
        """The server processes (``torch_rpc``; none with ``ray``)."""
        return self.servers.processes

    @property
    def actors(self) -> list[Any]:
        """The server actors (``ray``; none with ``torch_rpc``)."""
        return self.servers.actors

    def start(self) -> "LocalCluster":
        """Start the servers and join the group as the trainer.

        Raises:
            scheduling.ps.PSUnavailableError: the group did not assemble within ``timeout_s`` seconds.
        """
        port = self.servers.start(self._kwargs, port=self.port, trainer_name=self.trainer_name, ctx=self._ctx)
        self.port = port if port is not None else self.port  # a new one when the first was taken (a race for the port)
        self._rpc_up = True
        _ACTIVE.append(self)
        return self

    def kill(self, index: int) -> None:
        """Kill server ``index`` with SIGKILL (a crash: no goodbye to the group; with Ray: ``ray.kill``)."""
        self.servers.kill(index)

    def kill_all(self) -> None:
        """Kill every server process still alive."""
        self.servers.kill_all()

    def close(self) -> None:
        """Stop the live servers, leave the group and make sure the server processes are gone."""
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        self._close_clients()
        joined, self._rpc_up = self._rpc_up, False
        self.servers.stop(joined)

    def _close_clients(self) -> None:
        """Close the clients of this process that reach this cluster's servers (their pushes are not
        waited: the servers go away). ``torch_rpc``: every client using a server name of this cluster (one
        RPC group per process); ``ray``: every client holding one of its actors."""
        from .client import live_clients

        for client in live_clients():
            if self.servers.reaches(client):
                client.close(flush=False)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


def group_servers(what: str = "parameter servers") -> list[str]:
    """RPC worker names of the parameter servers of the group this process belongs to, in rank order.

    The servers of a running :class:`LocalCluster` of this process; otherwise every member of the
    ``torch.distributed.rpc`` group that answers as a server (one small RPC to each other member; this process
    when it hosts a server itself, :func:`scheduling.ps.in_trainers.serve_in_trainer`).

    Args:
        what: who asks (first words of the error message).

    Raises:
        NoGroupError: no RPC group runs in this process, or it has no parameter server; the message says how
            to start one.
    """
    if _ACTIVE and _ACTIVE[-1]._rpc_up:
        return list(_ACTIVE[-1].server_names)
    from torch.distributed import rpc

    from .in_trainers import hosted_worker
    from .server import _rpc_stats, group_world_size

    try:
        me_info = rpc.get_worker_info() if rpc.is_available() else None
    except RuntimeError:  # RPC not initialized in this process
        me_info = None
    if me_info is None or group_world_size() == 0:
        raise NoGroupError(f"{what}: no parameter-server group is running in this process. {_HOW_TO_START}.")
    me = me_info.name
    others = [rpc.get_worker_info(r) for r in range(group_world_size()) if r != me_info.id]
    futs = {w.id: (w.name, rpc.rpc_async(w.name, _rpc_stats, (), timeout=10.0)) for w in others}
    servers = []
    for rank in range(group_world_size()):
        if rank == me_info.id:  # this process is one when it serves a shard itself (scheduling.ps.in_trainers)
            if hosted_worker() == me:
                servers.append(me)
            continue
        name, fut = futs[rank]
        try:
            fut.wait()
        except RuntimeError:  # a trainer (no server in that process), or unreachable
            continue
        servers.append(name)
    if not servers:
        raise NoGroupError(f"{what}: the RPC group of worker {me!r} has no parameter server "
                           f"(members: {[w.name for w in others]}). {_HOW_TO_START}.")
    return servers
