"""Start a small parameter-server group on this machine: N server processes plus this process as trainer.

With ``transport="ray"`` the servers are Ray actors (:mod:`scheduling.ps.ray_transport`) of this process's
Ray session (a local one is started if none runs) and there is no RPC group.

Used by the tests, the benchmark and the Criteo example; :func:`group_servers` finds the servers of the group
this process is in (what :func:`scheduling.parameter_servers` places tables on). On a cluster, start each server with
:func:`scheduling.ps.start_server` wherever it runs (e.g. in a Ray actor) and each trainer with
:func:`scheduling.ps.init_trainer`; this module only automates the loopback case.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from collections.abc import Sequence
from typing import Any

from .endpoints import DEFAULT_WORKER_THREADS

__all__ = ["LocalCluster", "free_port", "group_servers", "NoGroupError"]

_ACTIVE: list["LocalCluster"] = []  # started and not closed, in this process

_HOW_TO_START = (
    "Start one first: on one machine `with scheduling.ps.LocalCluster(num_servers=2): ...` (servers in child "
    "processes, this process joins as the trainer); in a job, start each server with "
    "scheduling.ps.start_server(...) and join as a trainer with scheduling.ps.init_trainer(...) (jobs/ps.py "
    "does both)"
)


class NoGroupError(RuntimeError):
    """No parameter-server group (``torch.distributed.rpc``) is running in this process, or it has no server."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _server_main(name: str, rank: int, world_size: int, port: int, kwargs: dict[str, Any]) -> None:
    from .server import start_server

    start_server(name, rank, world_size, master_port=port, **kwargs)


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
        ValueError: ``num_servers`` or ``num_worker_threads`` < 1, or an unknown ``transport``.
    """

    def __init__(self, num_servers: int = 2, *, fetch_delay_s: float = 0.0, push_delay_s: float = 0.0,
                 timeout_s: float = 20.0, checkpoints: Sequence[str | None] | None = None,
                 start_method: str = "spawn", trainer_name: str = "trainer", transport: str = "torch_rpc",
                 num_worker_threads: int = DEFAULT_WORKER_THREADS) -> None:
        if num_servers < 1:
            raise ValueError(f"LocalCluster: need at least one server, got {num_servers}")
        if num_worker_threads < 1:
            raise ValueError(f"LocalCluster: num_worker_threads must be >= 1, got {num_worker_threads}")
        if transport not in ("torch_rpc", "ray"):
            raise ValueError(f"LocalCluster: unknown transport {transport!r} (use 'torch_rpc' or 'ray')")
        self.transport = transport
        self.actors: list[Any] = []
        self._started_ray = False
        self.num_servers = num_servers
        self.server_names = [f"ps{i}" for i in range(num_servers)]
        self.trainer_name = trainer_name
        self.timeout_s = timeout_s
        self.port = free_port()
        self._ctx = mp.get_context(start_method)
        self.num_worker_threads = num_worker_threads
        self._kwargs = [dict(fetch_delay_s=fetch_delay_s, push_delay_s=push_delay_s, timeout_s=timeout_s,
                             checkpoint=(checkpoints[i] if checkpoints else None),
                             num_worker_threads=num_worker_threads) for i in range(num_servers)]
        self.processes: list[Any] = []
        self._rpc_up = False

    def start(self) -> "LocalCluster":
        """Start the servers and join the group as the trainer.

        Raises:
            scheduling.ps.PSUnavailableError: the group did not assemble within ``timeout_s``.
        """
        from .client import init_trainer

        if self.transport == "ray":
            from .ray_transport import start_local

            kw = self._kwargs[0]
            self.actors, self._started_ray = start_local(
                self.server_names, checkpoints=[k["checkpoint"] for k in self._kwargs],
                fetch_delay_s=kw["fetch_delay_s"], push_delay_s=kw["push_delay_s"],
                num_worker_threads=self.num_worker_threads)
            self._rpc_up = True
            _ACTIVE.append(self)
            return self
        world = self.num_servers + 1
        for i, name in enumerate(self.server_names):
            proc = self._ctx.Process(target=_server_main, args=(name, i + 1, world, self.port, self._kwargs[i]),
                                     daemon=True, name=f"fxdist-{name}")
            proc.start()
            self.processes.append(proc)
        try:
            init_trainer(self.trainer_name, 0, world, master_port=self.port, timeout_s=self.timeout_s)
        except BaseException:
            self.kill_all()
            raise
        self._rpc_up = True
        _ACTIVE.append(self)
        return self

    def kill(self, index: int) -> None:
        """Kill server ``index`` with SIGKILL (a crash: no goodbye to the group; with Ray: ``ray.kill``)."""
        if self.transport == "ray":
            from .ray_transport import kill_actors

            kill_actors([self.actors[index]], ())
            return
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

    def close(self) -> None:
        """Stop the live servers, leave the group and make sure the server processes are gone."""
        from torch.distributed import rpc

        from .server import _rpc_stop

        if self in _ACTIVE:
            _ACTIVE.remove(self)
        self._close_clients()
        if self.transport == "ray":
            from .ray_transport import kill_actors

            kill_actors(self.actors, self.server_names, shutdown=self._started_ray)
            self._rpc_up, self.actors = False, []
            return
        try:
            if self._rpc_up:
                futs = []
                for name, proc in zip(self.server_names, self.processes):
                    if proc.is_alive():
                        futs.append(rpc.rpc_async(name, _rpc_stop, (), timeout=2.0))
                for fut in futs:
                    try:
                        fut.wait()
                    except RuntimeError:
                        pass
                rpc.shutdown(graceful=False)
                self._rpc_up = False
            deadline = time.monotonic() + 10
            for proc in self.processes:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            self.kill_all()

    def _close_clients(self) -> None:
        """Close the clients of this process that reach this cluster's servers (their pushes are not
        waited: the servers go away). ``torch_rpc``: every client using a server name of this cluster (one
        RPC group per process); ``ray``: every client holding one of its actors."""
        from .client import live_clients

        mine = {a._actor_id for a in self.actors}

        def uses(client: Any) -> bool:
            if self.transport == "ray":
                return any(getattr(h, "_actor_id", None) in mine for h in getattr(client.transport, "handles", ()))
            return client.transport.name == "torch_rpc" and bool(set(client.servers) & set(self.server_names))

        for client in live_clients():
            if uses(client):
                client.close(flush=False)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


def group_servers(what: str = "parameter servers") -> list[str]:
    """RPC worker names of the parameter servers of the group this process belongs to, in rank order.

    The servers of a running :class:`LocalCluster` of this process; otherwise every other member of the
    ``torch.distributed.rpc`` group that answers as a server (one small RPC to each member).

    Args:
        what: who asks (first words of the error message).

    Raises:
        NoGroupError: no RPC group runs in this process, or it has no parameter server; the message says how
            to start one.
    """
    if _ACTIVE and _ACTIVE[-1]._rpc_up:
        return list(_ACTIVE[-1].server_names)
    from torch.distributed import rpc

    if not rpc.is_available() or not rpc.api._is_current_rpc_agent_set():
        raise NoGroupError(f"{what}: no parameter-server group is running in this process. {_HOW_TO_START}.")
    from .server import _rpc_stats

    me = rpc.get_worker_info().name
    others = sorted((w for w in rpc.api._get_current_rpc_agent().get_worker_infos() if w.name != me),
                    key=lambda w: w.id)
    futs = [(w.name, rpc.rpc_async(w.name, _rpc_stats, (), timeout=10.0)) for w in others]
    servers = []
    for name, fut in futs:
        try:
            fut.wait()
        except RuntimeError:  # a trainer (no server in that process), or unreachable
            continue
        servers.append(name)
    if not servers:
        raise NoGroupError(f"{what}: the RPC group of worker {me!r} has no parameter server "
                           f"(members: {[w.name for w in others]}). {_HOW_TO_START}.")
    return servers
