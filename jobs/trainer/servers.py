"""Embedding tables on parameter servers: Ray actors running ``scheduling.ps`` servers, and the trainer side.

The servers are Ray actors (``scheduling.ps.transport.ray_transport.PSActor`` with a :class:`ServerHooks`, no CPU
reserved) that the launcher creates before the trainers start and kills when the job ends (:func:`start_servers`,
:func:`stop_servers`); they do not share the fate of the trainers' worker group. With ``[cluster] transport =
"torch_rpc"`` each worker group forms one static ``torch.distributed.rpc`` group of the ``T`` trainers (ranks
``0..T-1``, named ``trainer<r>``; rank 0 hosts the rendezvous store) and the ``N`` servers (ranks ``T..T+N-1``,
named ``ps<i>``): rank 0 picks
the rendezvous port and asks every server actor to ``PSActor.join()`` it. ``torch.distributed.rpc``
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
directly (``scheduling.ps.transport.ray_transport``), and each worker group's rank 0 has them ``PSActor.reset()``
to an empty server instead of joining; the trainers then load the checkpoint's tables as above. A restarted
server actor needs no re-admission: the same handles reach it.

With ``[cluster] transport = "socket"`` each worker group's rank 0 has the server actors
``PSActor.reset_socket()``: an empty server, served on a TCP socket of the actor's node (port 0), whose
``host:port`` it broadcasts with the group key; every trainer registers those addresses under ``ps<i>``
(``scheduling.ps.transport.ray_transport.RaySocketServers``) and sends its requests there
(``scheduling.ps.transport.socket_transport``), not through Ray. A restarted server actor listens on a new port, which the
next worker group's rank 0 takes again; the trainers then load the checkpoint's tables as above.

With ``[cluster] servers_in_trainers`` (:mod:`jobs.hosting`) there are no server actors: trainer ``i``'s process
serves server ``i`` and the RPC group holds the trainers only (:mod:`jobs.trainer.in_trainers`); a restarted worker
group starts empty servers in its new processes and loads the last checkpoint's tables, as above.

Trainer side: :class:`ServerTables` is the tables backend of a job with servers (:mod:`jobs.trainer.workload`): each
phase's module, the built-in torchrec DLRM or yours, first gets the ``scheduling.parameter_servers`` pass
(:meth:`_PhaseTables.placement_pass`), which moves its embedding tables to this group's servers (stored as
``[model] server_storage`` says, trained there with row-wise Adagrad) and turns each lookup into blocking
``ps_lookup`` nodes that the ``async_rpc`` passes then schedule; gradients are pushed from autograd hooks during
backward. With ``[model] table_sizes = "dynamic"`` the pass makes the built-in DLRM's 26 tables dynamic
(``dynamic=``, :func:`jobs.table_sizes.dynamic`); each phase reports their counters (:func:`dynamic_stats`).
Checkpoints write the tables by shard, each server its own rows (:meth:`_PhaseTables.start_checkpoint`,
:mod:`scheduling.placement.sharded`), and any number of servers load them back (:meth:`_PhaseTables.load_sharded`).

Source: torch.fx paper §6.2.3 (parameter-server fetches); Ray actors; torch.distributed.rpc.
"""

from __future__ import annotations

import collections
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scheduling.ps import DEFAULT_WORKER_THREADS

if TYPE_CHECKING:
    from jobs.records import MetricsTLS, ProcessStats, ServerJoin, Where

__all__ = ["ServerHooks", "server_actor", "ServerGroup", "ServerTables", "start_servers", "stop_servers", "wait_for_servers",
           "dynamic_stats"]

CLIENT = "fxdist-job"
"""Registry name of the job's PSClient in each trainer process."""
DYNAMIC_KEYS = ("rows", "capacity", "inserts", "evictions", "admitted", "rejected", "expired")
"""The statistics of each dynamic table in results.json (``phases.<phase>.dynamic_tables``)."""


def dynamic_stats(clients: dict[str, dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """Per dynamic table name, :data:`DYNAMIC_KEYS` of it, from ``{client name: PSClient.dynamic_stats()}`` (per table
    ``DynamicTable.stats()``, the servers' stats-only answer: no copy of the tables), in natural name order."""
    out = {table: {k: int(stats.get(k, 0)) for k in DYNAMIC_KEYS}
           for tables in clients.values() for table, stats in tables.items()}
    return dict(sorted(out.items(), key=lambda kv: _natural(kv[0])))


def _natural(name: str) -> tuple[str, int]:
    """``t_C10`` after ``t_C9``: the name's text, then its trailing number."""
    head = name.rstrip("0123456789")
    return head, int(name[len(head):] or 0)


class ServerHooks:
    """What a job's server actor (``scheduling.ps.transport.ray_transport.PSActor``, its ``hooks``) adds: its metrics
    exporter (the server's own metrics, read at each scrape), where it runs, its peak RSS, and this node's network
    interface before joining a non-loopback RPC group.

    Args:
        job: The ``job`` label of its metrics; ``name``: the server's (``ps<i>``); ``metrics``: (host, port) of
            its exporter, or None; ``tls``: its HTTPS options (:func:`jobs.trainer.metrics.tls_options`), or None.
            The exporter starts in the actor (:meth:`start`), again when Ray restarted it.
    """

    def __init__(self, job: str, name: str, metrics: tuple[str, int] | None, tls: MetricsTLS | None = None) -> None:
        self.job, self.name, self.address, self.tls = job, name, metrics, tls
        self.exporter: Any = None
        self.metrics: tuple[str, int] | None = None

    def start(self) -> None:
        """Serve the exporter on ``metrics`` (another free port of this node when that one is taken)."""
        if self.address is not None:
            from jobs.cluster import serve_exporter
            from jobs.trainer.metrics import Exporter

            self.exporter = Exporter(self.job, self.name)
            self.metrics = serve_exporter(self.exporter, self.address[0], self.address[1], self.tls)

    def before_join(self, addr: str) -> None:
        """When ``addr`` is not loopback, TensorPipe first gets this node's interface
        (:func:`jobs.cluster.set_socket_ifnames`)."""
        from jobs.cluster import is_loopback, set_socket_ifnames

        if not is_loopback(addr):
            set_socket_ifnames()

    def where(self) -> Where:
        """Where this server runs and its exporter's bound (address, port): :func:`jobs.cluster.where`."""
        from jobs.cluster import where

        return where(self.metrics)

    def stats(self) -> ProcessStats:
        """``{"peak_rss_bytes"}``: this process's peak RSS (:func:`jobs.stats.peak_rss_bytes`)."""
        from jobs.stats import peak_rss_bytes

        return {"peak_rss_bytes": peak_rss_bytes()}

    def serving(self, server: Any) -> None:
        """Export ``server``'s own metrics (serve times, rows and bytes per table, dynamic-table counters, pending
        requests; :mod:`jobs.trainer.server_metrics`), read at each scrape, on the exporter, if any."""
        if self.exporter is not None:
            self.exporter.watch_server(server)

    def close(self) -> None:
        """Stop the exporter."""
        if self.exporter is not None:
            self.exporter.close()


def server_actor(cls: Any, name: str, *, job: str, metrics: tuple[str, int] | None, fetch_delay_s: float,
                 timeout_s: float, num_worker_threads: int = DEFAULT_WORKER_THREADS, auth_key: bytes | None = None,
                 save_root: str | None = None, tls: MetricsTLS | None = None, transport_tls: Any = None) -> Any:
    """Start one server actor of ``cls`` (:func:`scheduling.ps.server_actor_class`, with its ``.options``) for a job: no
    server until a worker group's rank 0 has it :meth:`~scheduling.ps.transport.ray_transport.PSActor.join` (``torch_rpc``)
    or :meth:`~scheduling.ps.transport.ray_transport.PSActor.reset` (``ray``); metrics as :class:`ServerHooks` says;
    ``auth_key`` (the job's key, through Ray), ``save_root`` (the run folder) and ``transport_tls`` (the job's TLS
    credentials, or None) for its ``socket`` listener."""
    return cls.remote(name, fetch_delay_s=fetch_delay_s, num_threads=None, num_worker_threads=num_worker_threads,
                      timeout_s=timeout_s, serve_at_start=False, hooks=ServerHooks(job, name, metrics, tls),
                      auth_key=auth_key, save_root=save_root, tls_credentials=transport_tls)


def start_servers(config: Any, metrics_port: int | None, tag: str, *, auth_key: bytes | None = None,
                  save_root: str | None = None, transport_tls: Any = None) -> list[Any]:
    """Create the job's ``[cluster] parameter_servers`` server actors (``PSActor``) (the launcher's job).

    Actor ``i`` is named ``<job>-ps<i>-<tag>``, reserves no CPU and is restarted by Ray up to
    ``[job] max_failures`` times after its process dies; it exports metrics on
    ``metrics_port + trainers + i`` of its node (None: no exporter; another free port of its node when that
    one is taken there). ``[cluster] placement`` picks its node (:func:`jobs.cluster.server_options`).
    ``auth_key``: the job's key (``scheduling.ps.transport.auth``) its ``socket`` clients must hold, handed over
    through Ray; ``save_root``: where a ``save`` request may write (the run folder); ``transport_tls``: the job's TLS
    credentials (``[cluster] tls``), None: plain TCP. Returns the handles (for the trainers' :class:`jobs.trainer.spec.TrainerSpec`).
    """
    from jobs.cluster import server_options
    from jobs.trainer.metrics import tls_options
    from scheduling.ps import server_actor_class

    c = config.cluster
    cls = server_actor_class(config.job.max_failures)
    actors = []
    for i, options in enumerate(server_options(config)):
        metrics = (config.metrics.host, metrics_port + c.trainers + i) if metrics_port is not None else None
        actors.append(server_actor(cls.options(name=f"{config.job.name}-ps{i}-{tag}", **options), f"ps{i}",
                                   job=config.job.name, metrics=metrics, fetch_delay_s=c.server_fetch_delay_ms / 1e3,
                                   timeout_s=c.rpc_timeout_s, num_worker_threads=c.server_threads,
                                   auth_key=auth_key, save_root=save_root, tls=tls_options(config.metrics),
                                   transport_tls=transport_tls))
    return actors


def stop_servers(actors: list[Any], timeout_s: float = 5.0) -> None:
    """Ask the server actors to close, then kill them (no restart); never raises."""
    import ray

    from scheduling.ps import ActorHost

    try:
        ray.wait([a.close.remote() for a in actors], num_returns=len(actors), timeout=timeout_s)
    except Exception:  # a dead or restarting actor: killing it below is all that is left to do
        pass
    ActorHost(actors).kill_all()


def wait_for_servers(actors: list[Any], timeout_s: float, poll_s: float = 0.5) -> list[Where]:
    """Each server actor's ``PSActor.where()``, waiting up to ``timeout_s`` seconds for those Ray is
    restarting (after their process or their node died, ``ray.exceptions.ActorUnavailableError``).

    Raises:
        ray.exceptions.ActorUnavailableError / GetTimeoutError: an actor still restarting after ``timeout_s``.
        ray.exceptions.ActorDiedError: an actor that will not come back (no restarts left).
    """
    import ray
    from ray.exceptions import ActorUnavailableError

    deadline = time.monotonic() + timeout_s
    places: list[Where] = []
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


def _rpc_host(spec: Any) -> str:
    """Where the RPC group's rendezvous binds: ``spec.rpc_host``, else this node's Ray address."""
    if spec.rpc_host:
        return spec.rpc_host
    import ray.util

    return ray.util.get_node_ip_address()


class ServerGroup:
    """This worker group's ``torch.distributed.rpc`` group: the ``world`` trainers and the launcher's
    server actors (``PSActor``) (``spec.servers`` of the trainers' :class:`jobs.trainer.spec.TrainerSpec` ``spec``),
    which rank 0 asks to join (see the module docstring).

    Attributes: ``rank``, ``world``, ``config``, ``num_servers``, ``servers`` (RPC names ``ps<i>``), ``group``
    (a key rank 0 drew and broadcast: the trainers share tables in step order under it), ``joined``.

    Raises:
        RuntimeError: the launcher passed another number of server actors than ``[cluster] parameter_servers``.
    """

    def __init__(self, config: Any, rank: int, world: int, spec: Any, exporter: Any = None) -> None:
        c = config.cluster
        self.rank, self.world, self.config = rank, world, config
        if getattr(spec, "auth_key", None) is not None:   # the job's key, through Ray: for this process's socket
            from scheduling.ps.transport.auth import set_job_key  # clients and the servers it hosts

            set_job_key(spec.auth_key)
        if getattr(spec, "transport_tls", None) is not None:   # [cluster] tls: this process's connections too
            from scheduling.ps.transport.tls import set_job_tls

            set_job_tls(spec.transport_tls)
        self.transport = c.transport
        self.num_servers = c.parameter_servers
        self.in_trainers = bool(getattr(spec, "servers_in_trainers", False))
        """The servers live in the trainers' processes (:mod:`jobs.trainer.in_trainers`), not in actors."""
        self.actors: list[Any] = list(spec.servers)
        if self.in_trainers:
            from jobs.trainer.in_trainers import InTrainerServers, InTrainerSocketServers, in_trainer_names

            if self.actors or self.num_servers > world:
                raise RuntimeError(f"trainer {rank}: servers in the trainers with {len(self.actors)} server actors "
                                   f"and [cluster] parameter_servers = {self.num_servers} for {world} trainers")
            socket = c.transport == "socket"  # no RPC group: server i listens on trainer i's socket, named ps<i>
            self.servers = [f"ps{i}" for i in range(self.num_servers)] if socket else in_trainer_names(self.num_servers)
            run_dir = getattr(getattr(spec, "plan", None), "run_dir", None)
            self.lifecycle: Any = InTrainerSocketServers(self.servers, c.rpc_timeout_s, exporter=exporter,
                                                         fetch_delay_s=c.server_fetch_delay_ms / 1e3,
                                                         save_root=run_dir) if socket else InTrainerServers(
                self.servers, c.rpc_timeout_s, exporter=exporter, fetch_delay_s=c.server_fetch_delay_ms / 1e3)
        else:
            from scheduling.ps import server_group

            self.servers = [f"ps{i}" for i in range(self.num_servers)]
            lifecycle: Any = server_group(c.transport)
            if c.transport == "socket":  # the server actors listen on sockets (not LocalCluster's processes)
                from scheduling.ps.transport.ray_transport import RaySocketServers

                lifecycle = RaySocketServers
            self.lifecycle = lifecycle(self.servers, c.rpc_timeout_s)
        """The transport's lifecycle object: how this group's servers are readied, joined and left."""
        self.state: Any = spec.state
        """The launcher's JobState actor (None in tests without one): rank 0 reports each phase's table layout."""
        self.run_dir: Any = getattr(getattr(spec, "plan", None), "run_dir", None)
        """The run folder, where the tables are checkpointed by shard (None: whole, in ``state.pt``)."""
        if len(self.actors) != self.num_servers and not self.in_trainers:
            raise RuntimeError(f"trainer {rank}: the launcher passed {len(self.actors)} server actors, "
                               f"[cluster] parameter_servers = {self.num_servers}")
        # where each server runs now: a restarted one may have moved (its node died) and may still be
        # restarting, so rank 0 waits for it (the other ranks wait for rank 0 in the group set-up below)
        places = wait_for_servers(self.actors, c.rpc_timeout_s) if rank == 0 else []
        self.joined = self._start_group(spec)
        if self.joined and spec.state is not None:
            spec.state.servers_joined.remote(self.joined)
            for i, info in enumerate(places):
                spec.state.placed.remote(f"ps{i}", info)
        if self.in_trainers and rank < self.num_servers and spec.state is not None:  # server `rank` runs here
            from jobs.cluster import where

            spec.state.placed.remote(f"ps{rank}", {**where(), "in": f"trainer{rank}"})

    def _start_group(self, spec: Any) -> list[ServerJoin]:
        """Rank 0 readies the server actors for this worker group (``torch_rpc``: picks the rendezvous of a new
        RPC group; ``ray``: empties every server) before the other trainers hear the group key; then every
        trainer joins (``torch_rpc``: rank 0 has the servers join too; ``ray``: registers the actors under
        ``ps<i>`` for its clients). Returns the servers' answers on rank 0
        (:class:`scheduling.ps.lifecycle.TorchRPCServers`, :class:`scheduling.ps.transport.ray_transport.RayServers`)."""
        from jobs.cluster import is_loopback, set_socket_ifnames

        def before_join(host: str) -> None:  # TensorPipe listens on and advertises this node's interface
            if not is_loopback(host):
                set_socket_ifnames()

        rendezvous_and_key: list[Any] = [None]  # rank 0's (rendezvous, group key), broadcast to the others
        if self.rank == 0:
            rendezvous_and_key = [(self.lifecycle.rendezvous(_rpc_host(spec), self.actors), uuid.uuid4().hex)]
        if dist.is_initialized():
            dist.broadcast_object_list(rendezvous_and_key, src=0)
        rendezvous, self.group = rendezvous_and_key[0]
        return self.lifecycle.join(self.actors, self.rank, self.world, rendezvous, before_join)

    def barrier(self) -> None:
        """Wait for every trainer of the worker group (a ``torch.distributed`` barrier; nothing alone)."""
        if dist.is_initialized() and self.world > 1:
            dist.barrier()

    def kill(self, index: int) -> None:
        """Kill server ``index``'s process (fault injection) through the lifecycle's host
        (:meth:`scheduling.ps.ActorHost.kill`); Ray restarts the actor (``[job] max_failures``)."""
        self.lifecycle.kill(index)

    def leave(self, graceful: bool = True) -> None:
        """Leave the RPC group; the server actors stay (the launcher owns them). ``graceful`` on rank 0: the
        servers leave it too; after a failure, leave at once (the next worker group's ``PSActor.join()`` makes
        the servers leave the broken group)."""
        self.lifecycle.leave(self.actors, self.rank, graceful)


class ServerTables:
    """Tables backend (:class:`jobs.trainer.protocols.TableBackend`) of a trainer with parameter servers: it *has* this
    worker group's :class:`ServerGroup` (:attr:`servers`). Each phase's module (the built-in DLRM or yours) gets
    the ``scheduling.parameter_servers`` pass first (:meth:`_PhaseTables.placement_pass`), which moves its
    embedding tables to the group's servers under the clients ``fxdist-job-<phase>:<module path>``, shared by
    the trainers in step order (``rank`` / ``world_size`` / ``group`` of the pass).

    Each phase has its own tables on the servers (:meth:`view`), set from the same initial weights, so the phases
    can train side by side; with step order (:mod:`scheduling.ps.ordering`) every trainer's step-``k`` lookup
    sees exactly the pushes of steps ``0 .. k-1`` of all trainers, whatever the schedule, so the baseline and the
    optimized phase train identically.

    Raises:
        RuntimeError: ``spec`` has another number of server actors than ``[cluster] parameter_servers``.
    """

    def __init__(self, config: Any, rank: int, world: int, spec: Any, exporter: Any,
                 phases: Sequence[str] = ("baseline", "optimized")) -> None:
        self.servers = ServerGroup(config, rank, world, spec, exporter)
        """This worker group's servers and RPC group."""
        self.views = {phase: _PhaseTables(self.servers, phase) for phase in phases}
        if exporter is not None:  # fxdist_ps_staleness_steps, read at each scrape
            exporter.watch_staleness(lambda: {p: v.staleness() for p, v in self.views.items()})
        self.servers.barrier()

    def view(self, phase: str) -> Any:
        """The tables of ``phase`` (its own clients and tables on the servers, a
        :class:`jobs.trainer.protocols.Tables`)."""
        return self.views[phase]

    def close(self, graceful: bool = True) -> None:
        """Close every phase's clients and leave the RPC group; the server actors stay (the launcher owns them).

        ``graceful``: first wait for this trainer's pushes and for every trainer to get here (a
        ``torch.distributed`` barrier), so no update is lost, then rank 0 asks the servers to leave
        too; after a failure, leave at once (the next worker group's ``PSActor.join()`` makes
        the servers leave the broken group).
        """
        if graceful:
            for v in self.views.values():
                v.sync()
            self.servers.barrier()
        for v in self.views.values():
            v.close()
        self.servers.leave(graceful)


class _LookupTimer:
    """Seconds blocked in ``finish_lookup`` of some PSClients since the last :meth:`lookup_seconds`."""

    def __init__(self) -> None:
        self._fetch, self._fetched = 0.0, False

    def wrap(self, client: Any) -> None:
        finish = client.finish_lookup

        def timed_finish(fut: Any, server: int) -> torch.Tensor:
            t0 = time.perf_counter()
            try:
                return finish(fut, server)
            finally:
                self._fetch += time.perf_counter() - t0
                self._fetched = True

        client.finish_lookup = timed_finish

    def lookup_seconds(self) -> float | None:
        value, fetched = self._fetch, self._fetched
        self._fetch, self._fetched = 0.0, False
        return value if fetched else None


class _PhaseTables(_LookupTimer):
    """One phase's tables (a :class:`jobs.trainer.protocols.Tables`): set up by the ``parameter_servers`` pass, then
    read through the module it produced."""

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
        from jobs import table_sizes
        from jobs.criteo import FEATURES
        from jobs.optimizers import table_optimizer_args

        dynamic = None if c.user_model else table_sizes.dynamic(c, [f"t_{f}" for f in FEATURES])
        return functools.partial(parameter_servers, **table_optimizer_args(c),
                                 servers=tuple(self.owner.servers), client=f"{CLIENT}-{self.phase}",
                                 timeout_s=c.cluster.rpc_timeout_s, verbose=self.rank == 0, rank=self.rank,
                                 world_size=self.owner.world, group=self.owner.group,
                                 storage=c.model.server_storage, seed=c.job.seed, dynamic=dynamic)

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
        if self.rank == 0 and self.moved and self.owner.state is not None:
            from scheduling.placement.restore import table_layout

            self.owner.state.tables_placed.remote(self.phase, table_layout(gm))
        self.owner.barrier()

    def _clients(self) -> list[Any]:
        from scheduling.placement import client_names
        from scheduling.ps import get_client

        return [get_client(n) for n in client_names(self.gm)] if self.gm is not None else []

    def after_backward(self) -> None:
        """Nothing to do: the gradient hooks started the pushes during backward."""

    def sync(self) -> None:
        for client in self._clients():
            client.flush()

    def staleness(self) -> collections.Counter[int]:
        """This phase's clients' ``PSClient.staleness`` summed (pushes in flight -> lookups sent), for the exporter;
        a client closed meanwhile is skipped."""
        from scheduling.placement import client_names
        from scheduling.ps import get_client

        total: collections.Counter[int] = collections.Counter()
        for name in client_names(self.gm) if self.gm is not None else ():
            try:
                total.update(dict(get_client(name).staleness))  # a copy: the trainer counts on
            except KeyError:
                continue
        return total

    def prefetch_hits(self) -> int:
        return sum(client.prefetch_hits for client in self._clients())

    def state_dict(self) -> dict[str, Any]:
        """The tables under the model's state-dict names, whole, gathered from the servers (rank 0; ``{}``
        elsewhere): ``"<path>.weight"``, the row-wise Adagrad state ``"<path>.momentum"`` and a dynamic table's
        ``"<path>.dynamic"`` (:func:`scheduling.placement.restore.table_checkpoint`). Any number of servers can
        load it (:meth:`load_state_dict`): a resumed run may have other servers (resharding)."""
        from scheduling.placement.restore import table_checkpoint

        return table_checkpoint(self.gm) if self.rank == 0 and self.gm is not None and self.moved else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Rank 0 writes :meth:`state_dict`'s tables to this group's servers, in the layout this phase's pass chose
        for them (:func:`scheduling.placement.restore.load_table_checkpoint`); every rank waits."""
        from scheduling.placement.restore import load_table_checkpoint

        self.owner.barrier()
        if self.rank == 0 and state:
            load_table_checkpoint(self.gm, state)
        self.owner.barrier()

    def track_changes(self) -> None:
        """The servers start (again) recording the rows they change in this phase's tables (rank 0 asks;
        :func:`scheduling.placement.restore.track_table_changes`): the start of its deltas (:mod:`jobs.trainer.deltas`)."""
        from scheduling.placement.restore import track_table_changes

        if self.rank == 0 and self.gm is not None and self.moved:
            track_table_changes(self.gm)

    def take_changes(self) -> dict[str, dict[str, Any]]:
        """Rank 0: the rows the servers changed in this phase's tables since the previous call, under the model's
        state-dict names (:func:`scheduling.placement.restore.table_changes`), their records cleared; ``{}``
        elsewhere."""
        from scheduling.placement.restore import table_changes

        return table_changes(self.gm) if self.rank == 0 and self.gm is not None and self.moved else {}

    @property
    def run_dir(self) -> Any:
        """The run folder (:mod:`jobs.trainer.checkpoints` writes the tables by shard under it), or None."""
        return self.owner.run_dir

    def start_checkpoint(self, folder: Any) -> dict[str, float]:
        """Rank 0: the servers copy this phase's tables and write them by shard into ``folder`` in the background
        (:func:`scheduling.placement.sharded.start_checkpoint`): ``{"copy_s", "rows"}``."""
        from scheduling.placement.sharded import start_checkpoint

        return start_checkpoint(self.gm, folder)

    def finish_checkpoint(self, folder: Any, wait: bool) -> str | None:
        """Rank 0: once the servers' writes into ``folder`` finished, merge their metadata and return the tables'
        digest; None while a write runs and ``wait`` is False (:func:`scheduling.placement.sharded.finish_checkpoint`)."""
        from scheduling.placement.sharded import finish_checkpoint

        return finish_checkpoint(self.gm, folder, wait)

    def load_sharded(self, folder: Any) -> str | None:
        """The servers (any number) load this phase's tables from the checkpoint folder ``folder``, each its own rows
        (:func:`scheduling.placement.sharded.load_checkpoint`); rank 0 asks and gets the digest (None elsewhere);
        every rank waits."""
        from scheduling.placement.sharded import load_checkpoint

        self.owner.barrier()
        digest = load_checkpoint(self.gm, folder) if self.rank == 0 else None
        self.owner.barrier()
        return digest

    @property
    def dynamic(self) -> bool:
        """The tables are dynamic (``[model] table_sizes = "dynamic"``, :mod:`scheduling.ps.dynamic`)."""
        return self.owner.config.model.table_sizes == "dynamic"

    def dynamic_stats(self) -> dict[str, dict[str, int]] | None:
        """Rank 0, dynamic tables: per table (``t_C1`` ...), ``rows`` held, ``capacity`` and the counters
        ``inserts``, ``evictions``, ``admitted``, ``rejected``, ``expired`` (:meth:`scheduling.ps.dynamic.DynamicTable.stats`),
        asked of the servers (``PSClient.dynamic_stats``: counters only, not the tables); None for fixed tables or on
        other ranks."""
        from scheduling.placement import client_names
        from scheduling.ps import get_client

        if self.rank != 0 or self.gm is None or not self.dynamic:
            return None
        return dynamic_stats({n: get_client(n).dynamic_stats() for n in client_names(self.gm)})

    def close(self) -> None:
        for client in self._clients():
            client.close(flush=False)
