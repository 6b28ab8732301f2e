"""Embedding tables on parameter servers: Ray actors running ``scheduling.ps`` servers, and the trainer side.

One static ``torch.distributed.rpc`` group holds the ``T`` trainers (ranks ``0..T-1``, named
``trainer<r>``; rank 0 hosts the rendezvous store) and the ``N`` servers (ranks ``T..T+N-1``, named
``ps<i>``). Trainer rank 0 picks the rendezvous port, starts the servers as Ray actors
(:class:`ServerActor`, no CPU reserved) and owns them, so they share the fate of the worker group: when
Ray Train restarts the group after a failure (a killed trainer, or a killed server whose RPCs then fail
with ``PSUnavailableError``), the new rank 0 starts fresh servers and loads the tables of the last
checkpoint into them (``torch.distributed.rpc`` cannot re-admit a member into a live group).

Model side: :class:`PSSparseArch` turns ids into a torchrec ``KeyedJaggedTensor`` lookup on the servers
through ``scheduling.ps.PSEmbeddingBagCollection`` (blocking ``ps_fetch`` nodes, which the
``async_rpc`` pass splits into start/wait), and pushes each fetched part's gradient back from an autograd
hook during backward (:func:`attach_push`, deferred until the next fetch from that server). Servers
apply the updates with row-wise Adagrad.

Source: torch.fx paper §6.2.3 (parameter-server fetches); Ray actors; torch.distributed.rpc.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fxdist
from fxdist.node import has_side_effect

__all__ = ["PSSparseArch", "ServerActor", "ServerTables", "attach_push", "to_kjt", "tables_to_local"]

CLIENT = "fxdist-job"
"""Registry name of the job's PSClient in each trainer process."""


def _keys(num_tables: int) -> list[str]:
    return [f"C{j + 1}" for j in range(num_tables)]


def to_kjt(ids: torch.Tensor) -> Any:
    """``(B, T)`` ids -> ``KeyedJaggedTensor`` with keys C1..CT, one id per bag (key-major values)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    batch, tables = ids.shape
    return KeyedJaggedTensor(keys=_keys(tables), values=ids.t().reshape(-1),
                             lengths=torch.ones(batch * tables, dtype=torch.int32))


class _PushGrad:
    def __init__(self, client: str, server: int, kjt: Any) -> None:
        self.client, self.server, self.kjt = client, server, kjt

    def __call__(self, grad: torch.Tensor) -> None:
        from scheduling.ps import get_client

        ps = get_client(self.client)
        # in flight while backward and the optimizer step finish; the next fetch from this server (or
        # ``flush``) waits for it first, so every fetch still sees this trainer's previous updates
        ps.defer_push(self.server, ps.push_grad_async(self.server, self.kjt, grad))


@has_side_effect
def attach_push(client: str, server: int, kjt: Any, part: torch.Tensor) -> torch.Tensor:
    """Register a hook that starts pushing ``part``'s gradient to ``server`` during backward; returns ``part``.

    The push is deferred (``PSClient.defer_push``): the trainer's next fetch from that server waits for
    it, in both phases, so training is exactly as with blocking pushes.
    """
    if isinstance(part, torch.Tensor) and part.requires_grad:
        part.register_hook(_PushGrad(client, server, kjt))
    return part


attach_push.__module__ = __name__
fxdist.wrap("attach_push")


class PSSparseArch(nn.Module):
    """Sparse arch of :class:`jobs.model.DLRM` backed by the parameter servers.

    Shapes: ``fetch(kjt)`` -> one ``(B, D_s)`` part per server; ``combine(kjt, parts)`` -> ``(B, T, D)``.
    """

    def __init__(self, client: str, num_tables: int, dim: int) -> None:
        super().__init__()
        from scheduling.ps import PSEmbeddingBagCollection

        self.ebc = PSEmbeddingBagCollection(client)
        self.client = client
        self.num_tables = num_tables
        self.dim = dim

    def fetch(self, kjt: Any) -> list[torch.Tensor]:
        return self.ebc.fetch(kjt)

    def combine(self, kjt: Any, parts: list[torch.Tensor]) -> torch.Tensor:
        parts = [attach_push(self.client, s, kjt, p) for s, p in zip(self.ebc.server_ids, parts)]
        return self.ebc.pool(kjt, parts).values().view(-1, self.num_tables, self.dim)

    def forward(self, kjt: Any) -> torch.Tensor:
        return self.combine(kjt, self.fetch(kjt))


class ServerActor:
    """A Ray actor hosting one parameter server (``scheduling.ps.start_server``) and its metrics exporter."""

    def __init__(self, name: str, rank: int, world: int, addr: str, port: int, *, timeout_s: float,
                 fetch_delay_s: float, job: str, metrics: tuple[str, int] | None) -> None:
        self.name, self.rank, self.world, self.addr, self.port = name, rank, world, addr, port
        self.timeout_s, self.fetch_delay_s = timeout_s, fetch_delay_s
        self.phase = "baseline"
        self.exporter = None
        if metrics is not None:
            from jobs.metrics import Exporter

            self.exporter = Exporter(job, name)
            self.exporter.serve(metrics[1], metrics[0])

    def start(self) -> int:
        """Join the RPC group (returns once every member has joined); returns this process's pid."""
        from scheduling.ps import start_server

        server = start_server(self.name, self.rank, self.world, master_addr=self.addr, master_port=self.port,
                              fetch_delay_s=self.fetch_delay_s, timeout_s=self.timeout_s, block=False)
        if self.exporter is not None:
            lookup, exporter = server.lookup, self.exporter

            def timed_lookup(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return lookup(*args, **kwargs)
                finally:
                    exporter.observe_fetch(self.phase, time.perf_counter() - t0)

            server.lookup = timed_lookup
        return os.getpid()

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def stop(self) -> None:
        """Leave the RPC group (at once: ``scheduling.ps.stop_server`` never waits for the others)."""
        from scheduling.ps import stop_server

        stop_server()
        if self.exporter is not None:
            self.exporter.close()


def _rpc_host(loop_config: dict[str, Any]) -> str:
    if loop_config.get("rpc_host"):
        return loop_config["rpc_host"]
    import ray.util

    return ray.util.get_node_ip_address()


class ServerTables:
    """Tables backend of a trainer whose embedding tables live on ``[cluster] parameter_servers`` servers."""

    def __init__(self, config: Any, rank: int, world: int, loop_config: dict[str, Any], exporter: Any) -> None:
        import ray
        from scheduling.ps import PSClient, TableSpec, init_trainer

        from jobs.metrics import free_port

        c, m = config.cluster, config.model
        self.rank, self.world, self.config = rank, world, config
        self.num_servers = c.parameter_servers
        self.actors: list[Any] = []
        box = [None]
        if rank == 0:
            host = _rpc_host(loop_config)
            box = [(host, free_port(host))]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        host, port = box[0]
        total = world + self.num_servers
        starts = []
        if rank == 0:
            base = loop_config.get("metrics_port")
            cls = ray.remote(num_cpus=0, max_restarts=0)(ServerActor)
            for i in range(self.num_servers):
                metrics = (config.metrics.host, base + world + i) if base is not None else None
                actor = cls.remote(f"ps{i}", world + i, total, host, port, timeout_s=c.rpc_timeout_s,
                                   fetch_delay_s=c.server_fetch_delay_ms / 1e3, job=config.job.name,
                                   metrics=metrics)
                self.actors.append(actor)
                starts.append(actor.start.remote())
        init_trainer(f"trainer{rank}", rank, total, master_addr=host, master_port=port, timeout_s=c.rpc_timeout_s)
        self.server_pids = ray.get(starts) if starts else []
        specs = [TableSpec(f"t{j + 1}", m.table_size, m.embedding_dim, (key,))
                 for j, key in enumerate(_keys(26))]
        self.client = PSClient(specs, [f"ps{i}" for i in range(self.num_servers)], sharding="table_wise",
                               optimizer="rowwise_adagrad", optimizer_kwargs={"lr": config.job.lr}, name=CLIENT,
                               timeout_s=c.rpc_timeout_s, seed=config.job.seed, configure=(rank == 0))
        self._barrier()
        self.initial = self.client.state_dict() if rank == 0 else None
        self._fetch = 0.0
        self._fetched = False
        finish = self.client.finish_fetch

        def timed_finish(fut: Any, server: int) -> torch.Tensor:
            t0 = time.perf_counter()
            try:
                return finish(fut, server)
            finally:
                self._fetch += time.perf_counter() - t0
                self._fetched = True

        self.client.finish_fetch = timed_finish

    def _barrier(self) -> None:
        if dist.is_initialized() and self.world > 1:
            dist.barrier()

    def prepare(self, ids: torch.Tensor) -> Any:
        return to_kjt(ids)

    def sparse_arch(self, phase: str) -> nn.Module:
        for actor in self.actors:
            actor.set_phase.remote(phase)
        return PSSparseArch(CLIENT, 26, self.config.model.embedding_dim)

    def reset(self, seed: int) -> None:
        """Put the initial tables back on the servers (every phase starts from the same weights)."""
        self.client.flush()
        self._barrier()
        if self.rank == 0:
            self.client.load_state_dict(self.initial)
        self._barrier()

    def after_backward(self) -> None:
        """Nothing to do: the gradient hooks started the pushes during backward."""

    def sync(self) -> None:
        """Wait for this trainer's deferred pushes (before checkpoints and evaluation)."""
        self.client.flush()

    def fetch_seconds(self) -> float | None:
        value, fetched = self._fetch, self._fetched
        self._fetch, self._fetched = 0.0, False
        return value if fetched else None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full tables and row-wise Adagrad state, gathered from the servers (rank 0)."""
        return self.client.state_dict() if self.rank == 0 else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._barrier()
        if self.rank == 0 and state:
            self.client.load_state_dict(state)
        self._barrier()

    def kill_server(self, index: int) -> None:
        """Kill server ``index``'s process (fault injection)."""
        import ray

        ray.kill(self.actors[index], no_restart=True)

    def close(self, graceful: bool = True) -> None:
        """Leave the RPC group and end the server actors.

        ``graceful``: first wait for this trainer's pushes and for every trainer to get here (a
        ``torch.distributed`` barrier), so no update is lost; after a failure, leave at once.
        """
        import ray

        try:
            if graceful:
                self.client.flush()
                self._barrier()
            self.client.close(shutdown_rpc=True, flush=False)
            if graceful and self.actors:
                ray.get([a.stop.remote() for a in self.actors], timeout=self.config.cluster.rpc_timeout_s)
        finally:
            for actor in self.actors:
                ray.kill(actor, no_restart=True)


def tables_to_local(state: dict[str, torch.Tensor], local: nn.Module) -> None:
    """Copy server tables ``t1.weight .. t26.weight`` ``(N, D)`` into a :class:`jobs.model.LocalEmbeddings`."""
    weight = local.embedding.weight
    rows = weight.shape[0] // 26
    with torch.no_grad():
        for j in range(26):
            table = state[f"t{j + 1}.weight"]
            if table.shape != (rows, weight.shape[1]):
                raise ValueError(f"table t{j + 1}: shape {tuple(table.shape)} != ({rows}, {weight.shape[1]})")
            weight[j * rows:(j + 1) * rows] = table
