"""Embedding tables on parameter servers: Ray actors running ``scheduling.ps`` servers, and the trainer side.

The servers are Ray actors (:class:`ServerActor`, no CPU reserved) that the launcher creates before
the trainers start and kills when the job ends (:func:`start_servers`, :func:`stop_servers`); they do
not share the fate of the trainers' worker group. Each worker group forms one static
``torch.distributed.rpc`` group of the ``T`` trainers (ranks ``0..T-1``, named ``trainer<r>``; rank 0
hosts the rendezvous store) and the ``N`` servers (ranks ``T..T+N-1``, named ``ps<i>``): rank 0 picks
the rendezvous port and asks every server actor to :meth:`ServerActor.join` it. ``torch.distributed.rpc``
cannot re-admit a member into a live group, so when Ray Train restarts the worker group after a failure,
the new rank 0 makes the servers leave the broken group and join a new one (an empty server each), and
the trainers load the tables of the last checkpoint into them:

- a killed trainer: Ray Train restarts the group; the servers (same processes) rejoin;
- a killed server: Ray restarts its actor (``max_restarts``), the trainers' RPCs to it fail with
  ``PSUnavailableError``, Ray Train restarts the group, and the restarted server joins it;
- a dead node: its trainers and servers die with it; Ray Train restarts the group on the remaining
  nodes, Ray restarts each lost server actor elsewhere (``[cluster] placement = "spread"`` lets it, see
  :mod:`jobs.cluster`), and the new rank 0 waits for them (:func:`wait_for_servers`) before they join.

With ``[cluster] transport = "ray"`` there is no RPC group: the trainers call the server actors' methods
directly (``scheduling.ps.ray_transport``), and each worker group's rank 0 has them :meth:`ServerActor.reset`
to an empty server instead of joining; the trainers then load the checkpoint's tables as above. A restarted
server actor needs no re-admission: the same handles reach it.

Trainer side: :class:`ServerTables` is the tables backend of a job with servers (:mod:`jobs.workload`): each
phase's module, the built-in torchrec DLRM or yours, first gets the ``scheduling.parameter_servers`` pass
(:meth:`_PhaseTables.placement_pass`), which moves its embedding tables to this group's servers (stored as
``[model] server_storage`` says, trained there with row-wise Adagrad) and turns each lookup into blocking
``ps_fetch`` nodes that the ``async_rpc`` passes then schedule; gradients are pushed from autograd hooks during
backward.

Source: torch.fx paper §6.2.3 (parameter-server fetches); Ray actors; torch.distributed.rpc.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from scheduling.ps.endpoints import DEFAULT_WORKER_THREADS, AsyncEndpoints

__all__ = ["ServerActor", "ServerGroup", "ServerTables", "start_servers", "stop_servers", "wait_for_servers"]

CLIENT = "fxdist-job"
"""Registry name of the job's PSClient in each trainer process."""


class ServerActor(AsyncEndpoints):
    """A Ray actor hosting one parameter server and its metrics exporter.

    ``[cluster] transport = "torch_rpc"``: the server joins each worker group's RPC group
    (``scheduling.ps.start_server``), as below. ``"ray"``: the actor itself serves the requests (its
    :class:`~scheduling.ps.endpoints.AsyncEndpoints` methods, called as ``handle.lookup.remote(...)``: an asyncio
    actor, whose waiting requests hold no thread);
    each worker group's rank 0 calls :meth:`reset` instead of :meth:`join` (an empty server, no group).

    The launcher creates it (named, restartable by Ray) before the trainers start, and it outlives every
    trainer worker group: each group's rank 0 calls :meth:`join`, which leaves the previous group's RPC
    group and joins the new one with an empty server (the trainers then load the checkpoint's tables).
    If Ray restarts the actor after its process died, ``__init__`` runs again (a fresh process, the
    same metrics port) and the next :meth:`join` proceeds as on the first start.

    Args:
        name: RPC worker name (``ps<i>``).
        job: The ``job`` label of its metrics; ``metrics``: (host, port) of its exporter, or None.
        fetch_delay_s: Added latency per lookup, seconds; ``timeout_s``: RPC and rendezvous timeout.
        num_worker_threads: threads serving requests (``torch_rpc``: TensorPipe's; ``ray``: those running
            the lookups and pushes of this asyncio actor). A request waiting for its turn holds none.
    """

    def __init__(self, name: str, *, job: str, metrics: tuple[str, int] | None, fetch_delay_s: float,
                 timeout_s: float, num_worker_threads: int = DEFAULT_WORKER_THREADS) -> None:
        # no server until join() / reset(): a restarted actor refuses requests till then
        super().__init__(num_worker_threads=num_worker_threads)
        self.why_none = f"server {name} has not been reset since its actor (re)started"
        self.name, self.fetch_delay_s, self.timeout_s = name, fetch_delay_s, timeout_s
        self.joined = False
        self.groups = 0
        self.exporter = None
        self.metrics: tuple[str, int] | None = None
        self.server: Any = None
        self.held = {"rows": 0, "bytes": 0}  # PSServer.memory() when it last left a group
        if metrics is not None:
            from jobs.cluster import serve_exporter
            from jobs.metrics import Exporter

            self.exporter = Exporter(job, name)
            self.metrics = serve_exporter(self.exporter, metrics[0], metrics[1])

    def where(self) -> dict[str, Any]:
        """Where this server runs and its exporter's bound (address, port): :func:`jobs.cluster.where`."""
        from jobs.cluster import where

        return where(self.metrics)

    def join(self, rank: int, world: int, addr: str, port: int) -> dict[str, Any]:
        """Leave the current RPC group if any, then join the one at ``addr:port`` as ``rank`` of ``world``.

        When ``addr`` is not loopback, TensorPipe first gets this node's interface
        (:func:`jobs.cluster.set_socket_ifnames`).

        Returns once every member has joined: ``{"pid": this process, "group": groups joined so far}``.

        Raises:
            RuntimeError: the group did not assemble within ``timeout_s`` (from ``torch.distributed.rpc``).
        """
        from scheduling.ps import start_server

        from jobs.cluster import is_loopback, set_socket_ifnames

        self.leave()
        if not is_loopback(addr):
            set_socket_ifnames()
        server = start_server(self.name, rank, world, master_addr=addr, master_port=port,
                              fetch_delay_s=self.fetch_delay_s, timeout_s=self.timeout_s, block=False,
                              num_worker_threads=self.num_worker_threads)
        self.server = server
        self.joined = True
        self.groups += 1
        self._instrument(server)
        return {"pid": os.getpid(), "group": self.groups}

    def reset(self) -> dict[str, Any]:
        """``ray`` transport: serve an empty server from now on (the trainers configure the tables or load
        the checkpoint's); returns as :meth:`join` (``group``: resets so far)."""
        from scheduling.ps.server import PSServer

        self.server = PSServer(self.name, fetch_delay_s=self.fetch_delay_s)
        self.groups += 1
        self._instrument(self.server)
        return {"pid": os.getpid(), "group": self.groups}

    def _instrument(self, server: Any) -> None:
        """Time ``server``'s lookups (and its memory, at most once a second) on the exporter, if any."""
        if self.exporter is None:
            return
        lookup, exporter = server.lookup, self.exporter
        last = [0.0]  # when the memory gauges were last set

        def timed_lookup(namespace: str, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return lookup(namespace, *args, **kwargs)
            finally:  # the phase label is the client's suffix: fxdist-job-<phase>[:<module path>]
                exporter.observe_fetch(namespace.partition(":")[0].rpartition("-")[2], time.perf_counter() - t0)
                if t0 - last[0] > 1.0:  # rows and bytes held, at most once a second
                    last[0] = t0
                    exporter.observe_memory(**server.memory())

        server.lookup = timed_lookup

    def leave(self) -> None:
        """Leave the RPC group, if in one (at once: ``scheduling.ps.stop_server`` never waits for the others)."""
        from scheduling.ps import stop_server

        if self.joined:
            self.joined = False
            self.held = self.server.memory()
            stop_server()

    def stats(self) -> dict[str, Any]:
        """``{"pid", "peak_rss_bytes", "rows", "bytes"}``: this process's peak RSS (:func:`jobs.stats.peak_rss_bytes`)
        and the rows and bytes (stored rows + optimizer state, ``PSServer.memory()``) its server held in
        the group it was in last (or is in now)."""
        from jobs.stats import peak_rss_bytes

        held = self.server.memory() if self.joined else self.held
        return {"pid": os.getpid(), "peak_rss_bytes": peak_rss_bytes(), **held}

    def close(self) -> None:
        """Leave the group and stop the exporter (the launcher then kills the actor)."""
        self.leave()
        self.server = None
        if self.exporter is not None:
            self.exporter.close()


def start_servers(config: Any, metrics_port: int | None, tag: str) -> list[Any]:
    """Create the job's ``[cluster] parameter_servers`` :class:`ServerActor` s (the launcher's job).

    Actor ``i`` is named ``<job>-ps<i>-<tag>``, reserves no CPU and is restarted by Ray up to
    ``[job] max_failures`` times after its process dies; it exports metrics on
    ``metrics_port + trainers + i`` of its node (None: no exporter; another free port of its node when that
    one is taken there). ``[cluster] placement`` picks its node (:func:`jobs.cluster.server_options`).
    Returns the handles (for ``loop_config``).
    """
    import ray

    from jobs.cluster import server_options

    c = config.cluster
    from scheduling.ps.ray_transport import MAX_REQUESTS

    # an asyncio actor: with the ray transport it serves requests itself, a waiting one as a parked coroutine
    cls = ray.remote(num_cpus=0, max_restarts=max(0, config.job.max_failures), max_concurrency=MAX_REQUESTS
                     )(ServerActor)
    actors = []
    for i, options in enumerate(server_options(config)):
        metrics = (config.metrics.host, metrics_port + c.trainers + i) if metrics_port is not None else None
        actors.append(cls.options(name=f"{config.job.name}-ps{i}-{tag}", **options).remote(
            f"ps{i}", job=config.job.name, metrics=metrics, fetch_delay_s=c.server_fetch_delay_ms / 1e3,
            timeout_s=c.rpc_timeout_s, num_worker_threads=c.server_threads))
    return actors


def stop_servers(actors: list[Any], timeout_s: float = 5.0) -> None:
    """Ask the server actors to close, then kill them (no restart); never raises."""
    import ray
    from scheduling.ps.ray_transport import kill_actors

    try:
        ray.wait([a.close.remote() for a in actors], num_returns=len(actors), timeout=timeout_s)
    except Exception:  # a dead or restarting actor: killing it below is all that is left to do
        pass
    kill_actors(actors, ())


def wait_for_servers(actors: list[Any], timeout_s: float, poll_s: float = 0.5) -> list[dict[str, Any]]:
    """Each server actor's :meth:`ServerActor.where`, waiting up to ``timeout_s`` seconds for those Ray is
    restarting (after their process or their node died, ``ray.exceptions.ActorUnavailableError``).

    Raises:
        ray.exceptions.ActorUnavailableError / GetTimeoutError: an actor still restarting after ``timeout_s``.
        ray.exceptions.ActorDiedError: an actor that will not come back (no restarts left).
    """
    import ray
    from ray.exceptions import ActorUnavailableError

    deadline = time.monotonic() + timeout_s
    places: list[dict[str, Any]] = []
    for actor in actors:
        while True:
            try:
                places.append(ray.get(actor.where.remote(), timeout=max(1.0, deadline - time.monotonic())))
                break
            except ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(poll_s)
    return places


def _rpc_host(loop_config: dict[str, Any]) -> str:
    if loop_config.get("rpc_host"):
        return loop_config["rpc_host"]
    import ray.util

    return ray.util.get_node_ip_address()


class ServerGroup:
    """This worker group's ``torch.distributed.rpc`` group: the ``world`` trainers and the launcher's
    :class:`ServerActor` s (``loop_config["servers"]``), which rank 0 asks to join (see the module docstring).

    Attributes: ``rank``, ``world``, ``config``, ``num_servers``, ``servers`` (RPC names ``ps<i>``), ``group``
    (a key rank 0 drew and broadcast: the trainers share tables in step order under it), ``joined``.
    """

    def __init__(self, config: Any, rank: int, world: int, loop_config: dict[str, Any]) -> None:
        c = config.cluster
        self.rank, self.world, self.config = rank, world, config
        self.transport = c.transport
        self.num_servers = c.parameter_servers
        self.servers = [f"ps{i}" for i in range(self.num_servers)]
        self.actors: list[Any] = list(loop_config.get("servers") or [])
        if len(self.actors) != self.num_servers:
            raise RuntimeError(f"trainer {rank}: the launcher passed {len(self.actors)} server actors, "
                               f"[cluster] parameter_servers = {self.num_servers}")
        # where each server runs now: a restarted one may have moved (its node died) and may still be
        # restarting, so rank 0 waits for it (the other ranks wait for rank 0 in the group set-up below)
        places = wait_for_servers(self.actors, c.rpc_timeout_s) if rank == 0 else []
        if self.transport == "ray":
            self.joined = self._reset_servers()
        else:
            self.joined = self._join_rpc_group(loop_config)
        if self.joined and loop_config.get("state") is not None:
            loop_config["state"].servers_joined.remote(self.joined)
            for i, info in enumerate(places):
                loop_config["state"].placed.remote(f"ps{i}", info)

    def _reset_servers(self) -> list[dict[str, Any]]:
        """``ray`` transport: rank 0 empties every server actor (:meth:`ServerActor.reset`) before the others
        hear the group key; every trainer registers the actors under ``ps<i>`` for its clients."""
        import ray
        from scheduling.ps.ray_transport import register_servers

        register_servers(dict(zip(self.servers, self.actors)))
        timeout = self.config.cluster.rpc_timeout_s
        joined = ray.get([a.reset.remote() for a in self.actors], timeout=timeout) if self.rank == 0 else []
        box = [uuid.uuid4().hex if self.rank == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        self.group = box[0]
        return joined

    def _join_rpc_group(self, loop_config: dict[str, Any]) -> list[dict[str, Any]]:
        """``torch_rpc`` transport: rank 0 picks the rendezvous and has every server actor join; all trainers
        join the group (returns the servers' answers on rank 0)."""
        import ray
        from scheduling.ps import init_trainer

        from jobs.cluster import is_loopback, set_socket_ifnames
        from scheduling.ps.launch import free_port

        c, rank, world = self.config.cluster, self.rank, self.world
        box = [None]
        if rank == 0:
            host = _rpc_host(loop_config)
            box = [(host, free_port(host), uuid.uuid4().hex)]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        host, port, self.group = box[0]
        total = world + self.num_servers
        if not is_loopback(host):  # TensorPipe listens on and advertises this node's interface
            set_socket_ifnames()
        joins = [a.join.remote(world + i, total, host, port) for i, a in enumerate(self.actors)] if rank == 0 else []
        init_trainer(f"trainer{rank}", rank, total, master_addr=host, master_port=port, timeout_s=c.rpc_timeout_s)
        return ray.get(joins) if joins else []

    def _barrier(self) -> None:
        if dist.is_initialized() and self.world > 1:
            dist.barrier()

    def view(self, phase: str) -> Any:
        """The tables of ``phase`` (its own clients and tables on the servers)."""
        return self.views[phase]

    def kill_server(self, index: int) -> None:
        """Kill server ``index``'s process (fault injection); Ray restarts the actor."""
        import ray

        ray.kill(self.actors[index], no_restart=False)

    def close(self, graceful: bool = True) -> None:
        """Leave the RPC group; the server actors stay (the launcher owns them).

        ``graceful``: first wait for this trainer's pushes and for every trainer to get here (a
        ``torch.distributed`` barrier), so no update is lost, then rank 0 asks the servers to leave
        too; after a failure, leave at once (the next worker group's :meth:`ServerActor.join` makes
        the servers leave the broken group).
        """
        import ray
        from torch.distributed import rpc

        if graceful:
            for v in self.views.values():
                v.sync()
            self._barrier()
        for v in self.views.values():
            v.close()
        if self.transport == "ray":  # no group to leave; the launcher owns the actors
            from scheduling.ps.ray_transport import unregister_servers

            unregister_servers(self.servers)
            return
        rpc.shutdown(graceful=False)
        if graceful and self.rank == 0 and self.actors:
            ray.get([a.leave.remote() for a in self.actors], timeout=self.config.cluster.rpc_timeout_s)


class ServerTables(ServerGroup):
    """Tables backend of a trainer with parameter servers: each phase's module (the built-in DLRM or yours) gets
    the ``scheduling.parameter_servers`` pass first (:meth:`_PhaseTables.placement_pass`), which moves its
    embedding tables to this group's servers under the clients ``fxdist-job-<phase>:<module path>``, shared by
    the trainers in step order (``rank`` / ``world_size`` / ``group`` of the pass).

    Each phase has its own tables on the servers (:meth:`view`), set from the same initial weights, so the phases
    can train side by side; with step order (:mod:`scheduling.ps.ordering`) every trainer's step-``k`` lookup
    sees exactly the pushes of steps ``0 .. k-1`` of all trainers, whatever the schedule, so the baseline and the
    optimized phase train identically."""

    def __init__(self, config: Any, rank: int, world: int, loop_config: dict[str, Any], exporter: Any,
                 phases: Sequence[str] = ("baseline", "optimized")) -> None:
        super().__init__(config, rank, world, loop_config)
        self.views = {phase: _PhaseTables(self, phase) for phase in phases}
        self._barrier()


class _FetchTimer:
    """Seconds blocked in ``finish_fetch`` of some PSClients since the last :meth:`fetch_seconds`."""

    def __init__(self) -> None:
        self._fetch, self._fetched = 0.0, False

    def wrap(self, client: Any) -> None:
        finish = client.finish_fetch

        def timed_finish(fut: Any, server: int) -> torch.Tensor:
            t0 = time.perf_counter()
            try:
                return finish(fut, server)
            finally:
                self._fetch += time.perf_counter() - t0
                self._fetched = True

        client.finish_fetch = timed_finish

    def fetch_seconds(self) -> float | None:
        value, fetched = self._fetch, self._fetched
        self._fetch, self._fetched = 0.0, False
        return value if fetched else None


class _PhaseTables(_FetchTimer):
    """One phase's tables: set up by the ``parameter_servers`` pass, then read through the module it produced."""

    local = False

    def __init__(self, owner: ServerGroup, phase: str) -> None:
        super().__init__()
        self.owner, self.phase, self.rank = owner, phase, owner.rank
        self.gm: Any = None
        self.moved: frozenset[str] = frozenset()
        """The model's state-dict keys (``"<path>.weight"``) of the tables the pass moved to the servers."""

    def placement_pass(self) -> Any:
        """The ``parameter_servers`` pass for this phase (the first pass of its module)."""
        import functools

        from scheduling.placement import parameter_servers

        c = self.owner.config
        from jobs.optimizers import table_optimizer_args

        return functools.partial(parameter_servers, **table_optimizer_args(c),
                                 servers=tuple(self.owner.servers), client=f"{CLIENT}-{self.phase}",
                                 timeout_s=c.cluster.rpc_timeout_s, verbose=self.rank == 0, rank=self.rank,
                                 world_size=self.owner.world, group=self.owner.group,
                                 storage=c.model.server_storage, seed=c.job.seed)

    def attach(self, gm: Any) -> None:
        """``gm`` went through :meth:`placement_pass`: time its clients' fetches; wait until every rank has
        (rank 0 configured the tables)."""
        from scheduling.placement import client_names
        from scheduling.ps import get_client

        self.gm = gm
        tables = gm.meta.get("fxdist", {}).get("placement", {}).get("tables", [])
        self.moved = frozenset(f"{t['path']}.weight" for t in tables)
        for name in client_names(gm):
            self.wrap(get_client(name))
        self.owner._barrier()

    def _clients(self) -> list[Any]:
        from scheduling.placement import client_names
        from scheduling.ps import get_client

        return [get_client(n) for n in client_names(self.gm)] if self.gm is not None else []

    def after_backward(self) -> None:
        """Nothing to do: the gradient hooks started the pushes during backward."""

    def sync(self) -> None:
        for client in self._clients():
            client.flush()

    def prefetch_hits(self) -> int:
        return sum(client.prefetch_hits for client in self._clients())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The tables under the model's state-dict names (``"<path>.weight"``) with the row-wise Adagrad state
        (``"<path>.momentum"``), gathered from the servers (rank 0; ``{}`` elsewhere)."""
        from scheduling.placement import table_state_dict

        return table_state_dict(self.gm, optimizer_state=True) if self.rank == 0 and self.gm is not None else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        from scheduling.placement import load_table_state_dict

        self.owner._barrier()
        if self.rank == 0 and state:
            load_table_state_dict(self.gm, state)
        self.owner._barrier()

    def kill_server(self, index: int) -> None:
        self.owner.kill_server(index)

    def close(self) -> None:
        for client in self._clients():
            client.close(flush=False)
