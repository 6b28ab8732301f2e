"""Process bodies of ``benchmarks/peer.py``: one trainer of each compared system, and a parameter server.

Every function here runs in a spawned process (it must be importable, so it lives outside the driver).
A trainer joins a gloo process group of :data:`WORLD` trainers (fxdist's trainers also join the
``torch.distributed.rpc`` group of trainers and servers), builds its system, trains ``warmup + steps`` steps
on its own seeded batches and puts ``(rank, {"seconds", "first_loss", "last_loss", "ready_at"})`` on the queue
(``{"error": ...}`` on failure; ``ready_at``: ``time.time()`` when its first warm-up step started). ``seconds`` covers the ``steps`` timed steps, from a barrier after the warm-up
to a barrier after the last step (fxdist: after its last pushes are applied).

Same start for every system: the dense and over arches from ``criteo_dlrm(seed=MODEL_SEED)``; table ``i`` from
:func:`initial_table` (the rows fxdist's servers create from :data:`TABLE_SEED` under :func:`plan`, copied
into DMP's shards and into the local tables); the same batches (seeded by rank) and learning rate (SGD on
the tables and on the dense part; table gradients averaged over the trainers in every system).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

WORLD = 2          # trainers
SERVERS = 2        # fxdist parameter servers by default (peer.py --servers)
BATCH = 128        # samples per trainer and step
TABLES = 26
LR = 0.05          # SGD, tables and dense part
MODEL_SEED = 0     # the dense and over arches (criteo_dlrm(seed=...))
TABLE_SEED = 0     # the servers' seed of the tables' initial rows


def default_servers(cores: int) -> int:
    """``--servers``'s default on a host of ``cores`` cores: :data:`SERVERS` (2) where each trainer and
    server has a core of its own, else 1. On 2 cores one server process took 1.5-1.8 ms less CPU per step than two
    (fewer requests, each with all 26 tables, and one process fewer) and made socket prefetch
    (``fx_prefetch_0ms``) 2-12 % faster (README "Side by side with torchrec"); ``benchmarks/server_request.py``
    takes the same default."""
    return SERVERS if cores >= WORLD + SERVERS else 1


def plan(servers: int) -> dict[str, int]:
    """fxdist's placement on ``servers`` servers, pinned: table ``i`` (0-based) on server ``i % servers`` (what its
    balancing picks for 26 equal tables)."""
    return {f"t_C{i + 1}": i % servers for i in range(TABLES)}


CHECK_BYTES = 128 << 20
"""Sizes whose 26 tables hold at most this many bytes also get the table check (:func:`_table_change`): fxdist's
trainer gathers every table from the servers for it."""
SYSTEMS = ("dense_only", "dmp_tw", "dmp_tw_pipeline", "dmp_rw", "ddp_local",
           "fx_blocking_0ms", "fx_prefetch_0ms", "fx_stale1_0ms", "fx_blocking_1ms", "fx_prefetch_1ms",
           "fx_inproc_prefetch_0ms", "fx_inproc_stale1_0ms", "fx_dynamic_prefetch_0ms",
           "fx_rpc_prefetch_0ms", "fx_rpc_stale1_0ms", "fx_rpc_inproc_prefetch_0ms", "fx_rpc_inproc_stale1_0ms",
           "fx_nice19_prefetch_0ms", "fx_nice19_stale1_0ms", "fx_nice4_prefetch_0ms",
           "fx_send1_prefetch_0ms", "fx_send0_prefetch_0ms", "fx_shm0_prefetch_0ms", "fx_shm0_stale1_0ms",
           "fx_noauth_prefetch_0ms")
"""``dense_only``: the ceiling (no tables: each table's pooled output a constant); ``fx_*``: fxdist over the
``socket`` transport, the job's default (``scheduling.ps.transport.socket_transport``; no RPC group); ``fx_stale1_0ms``:
prefetch with ``max_staleness=1`` (pushes stay in flight one step); ``fx_inproc_*``: the same with server ``i``
inside trainer ``i``'s process (``in_trainers.serve_in_trainer_socket``: 2 processes instead of 4; the other
trainer's requests over its socket, its own called directly); ``fx_dynamic_*``: prefetch with the 26 tables
dynamic (``scheduling.ps.dynamic``, capacity = the size's rows, raw ids); ``fx_rpc_*``: the same over
``torch.distributed.rpc`` (``[cluster] transport = "torch_rpc"``; ``fx_rpc_inproc_*``: ``scheduling.ps.in_trainers``
over RPC); ``fx_nice<N>_*``: the separate servers at nice ``N`` (a lower CPU priority than the trainers',
:func:`server_nice`), the others at the trainers' own; ``fx_send1_*`` / ``fx_send0_*``: the trainers' pushes sent
by each connection's sender thread / by the thread that makes them (``FXDIST_SOCKET_SEND_THREAD``, see
``scheduling.ps.transport.socket_transport.send_thread``), the others as that setting's ``auto`` picks (on from 8 CPUs);
``fx_shm0_*``: every message over the socket (``FXDIST_SOCKET_SHM_BYTES=0``), where the others pass large buffers
through a shared-memory arena per connection (``scheduling.ps.transport.shm_arena``; trainers and servers share a host);
``fx_noauth_*``: the socket transport's security layer switched off in this benchmark's own processes only
(:func:`without_security`: no handshake, plain ``pickle.loads``, ``torch.empty`` receive buffers), the peer that
prices it."""
NICE_TAG = re.compile(r"nice(\d+)")
"""The word of an fxdist system's name that sets its servers' nice value (``fx_nice19_prefetch_0ms``: 19)."""
SEND_TAG = re.compile(r"send([01])")
"""The word of an fxdist system's name that sets its trainers' ``FXDIST_SOCKET_SEND_THREAD`` (``fx_send1_*``: 1)."""
SHM_TAG = re.compile(r"shm(0)")
"""The word of an fxdist system's name that turns its trainers' shared-memory arenas off (``fx_shm0_*``)."""
_VALUED_TAGS = (NICE_TAG, SEND_TAG, SHM_TAG)
"""The tags of an fxdist system's name that carry a value (:func:`_tag_value`)."""
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if "noauth" not in s.split("_")
                        and not any(t.fullmatch(p) for t in _VALUED_TAGS for p in s.split("_")))
"""peer.py's systems unless ``--systems`` names others: all but the ``fx_nice<N>_*``, ``fx_send<0|1>_*``,
``fx_shm0_*`` and ``fx_noauth_*`` comparisons."""
PROFILE_REGIONS = ("step", "forward", "backward", "optimizer", "lookup", "push")
"""The ``record_function`` regions of a profiled step (``peer.<region>``): lookup (fxdist's lookups, starts,
waits and prefetches, inside forward) and push (fxdist's pushes and their waits, mostly inside backward)."""


@dataclass(frozen=True)
class Setting:
    """One run: a system at one table size."""

    system: str
    rows: int
    dim: int
    warmup: int
    steps: int
    pg_port: int
    rpc_port: int = 0
    group: str = ""
    """fxdist: the key the trainers of this run share on the servers (``parameter_servers(group=...)``)."""
    profile: int = 0
    """Steps profiled (``torch.profiler``, trainer 0) after the timed ones; 0: none."""
    profile_file: str = ""
    """Where trainer 0 writes the profile's top ops (by self CPU time)."""
    servers: int = SERVERS
    """fxdist: separate server processes (``fx_inproc_*``: one in each trainer, :data:`WORLD`, whatever this says)."""

    @property
    def num_servers(self) -> int:
        """The servers an fxdist system of this setting runs: :attr:`servers`, or :data:`WORLD` in the trainers."""
        return WORLD if in_trainers(self.system) else self.servers

    @property
    def total(self) -> int:
        """Batches a trainer needs: warm-up, timed and profiled steps."""
        return self.warmup + self.steps + self.profile


# ---- the common start ---------------------------------------------------------------------------------------
def batches(rank: int, count: int, rows: int) -> list[tuple[torch.Tensor, Any, torch.Tensor]]:
    """``count`` batches ``(dense (B, 13), KJT with keys C1..C26 and one id per bag, labels (B,))`` of trainer
    ``rank``; ids uniform in ``[0, rows)``."""
    from recsys.criteo import criteo_kjt

    gen = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(count):
        ids = torch.randint(0, rows, (BATCH, TABLES), generator=gen)
        out.append((torch.rand(BATCH, 13, generator=gen), criteo_kjt(ids), torch.rand(BATCH, generator=gen).round()))
    return out


def initial_table(i: int, rows: int, dim: int) -> torch.Tensor:
    """Table ``i`` (0-based, feature ``C<i+1>``) ``(rows, dim)`` as fxdist's servers create it from
    :data:`TABLE_SEED` (uniform in ``±1/sqrt(rows)``, torchrec's default), with the servers' own function (one
    shard of all its rows; the rows depend on the seed, the table's name and the first row, not the server)."""
    from scheduling.ps.server import PSServer
    from scheduling.ps.shard_plan import ShardSpec, TableSpec

    spec = TableSpec(f"t_C{i + 1}", rows, dim, (f"C{i + 1}",))
    return PSServer._init_weight(ShardSpec(spec, 0, 0, rows), TABLE_SEED, None)


def dlrm(rows: int, dim: int, tables_device: str | None = None, sparse_grad: bool = False) -> nn.Module:
    """torchrec's DLRM over 26 tables ``rows x dim``, dense arch 512-256-dim, over arch 512-256-1."""
    from recsys.criteo import criteo_dlrm

    return criteo_dlrm(rows, dim, dense_layers=(512, 256, dim), over_layers=(512, 256, 1), sparse_grad=sparse_grad,
                       tables_device=tables_device, seed=MODEL_SEED)


def _bce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits.squeeze(-1), labels)


_PROFILING = False
_PIDS: list[Any] = []
"""``--cpu-account``, trainer 0 only: the driver's shared array of the run's process ids (trainers, then servers)."""


def _processes() -> dict[int, str]:
    """``{pid: "trainer" | "server"}`` of the run (read from :data:`_PIDS` after the warm-up, when the driver has
    long filled it); empty without ``--cpu-account`` and on other trainers."""
    return {pid: "trainer" if i < WORLD else "server" for i, pid in enumerate(_PIDS[0][:]) if pid} if _PIDS else {}


@contextlib.contextmanager
def region(name: str) -> Iterator[None]:
    """``torch.profiler.record_function("peer.<name>")`` while a profile is being taken; else nothing."""
    if not _PROFILING:
        yield
        return
    with torch.profiler.record_function(f"peer.{name}"):
        yield


def _profiled(step: Callable[[int], torch.Tensor], s: Setting, finish: Callable[[], None]) -> dict[str, float]:
    """Run the ``s.profile`` steps after the timed ones, trainer 0 under ``torch.profiler`` (CPU): write its
    top ops by self CPU time to ``s.profile_file``; return ms per step of each :data:`PROFILE_REGIONS`
    region (trainer 0; other ranks: {})."""
    global _PROFILING
    first = s.warmup + s.steps
    if dist.get_rank() != 0:
        for i in range(first, first + s.profile):
            step(i)
        finish()
        return {}
    from torch.profiler import ProfilerActivity, profile

    _PROFILING = True
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(first, first + s.profile):
                with region("step"):
                    step(i)
            finish()
    finally:
        _PROFILING = False
    averages = prof.key_averages()
    path = Path(s.profile_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{s.system} {s.rows}x{s.dim}: {s.profile} steps after {first}, trainer 0, torch.profiler "
                    "(CPU); top 30 by self CPU time\n"
                    + averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    totals = {e.key: e.cpu_time_total for e in averages}   # microseconds, over the profiled steps
    return {r: totals.get(f"peer.{r}", 0.0) / 1e3 / s.profile for r in PROFILE_REGIONS}


def _sgd_step(forward: Callable[[], torch.Tensor], opt: torch.optim.Optimizer,
              after_backward: Callable[[], None] = lambda: None) -> torch.Tensor:
    """One training step in the profiled regions: ``forward()`` -> the loss, ``zero_grad``, ``backward`` (then
    ``after_backward()``, inside the backward region), ``opt.step()``; returns the detached loss."""
    with region("forward"):
        loss = forward()
    with region("optimizer"):
        opt.zero_grad()
    with region("backward"):
        loss.backward()
        after_backward()
    with region("optimizer"):
        opt.step()
    return loss.detach()


def _timed(step: Callable[[int], torch.Tensor], s: Setting, finish: Callable[[], None] = lambda: None,
           tables: Callable[[], dict[int, list]] | None = None) -> dict:
    """Run ``step(0..warmup+steps-1)``; time the last ``steps`` between barriers (after ``finish()``); then, for
    small sizes, :func:`_table_change` of ``tables()`` (so every round compares the same steps); then
    :func:`_profiled` steps when ``s.profile``."""
    import _peer_cpu

    ready_at = time.time()   # the run's set-up is over: processes, imports, groups, model, tables
    losses = [float(step(i)) for i in range(s.warmup)]
    dist.barrier()
    processes = _processes()
    before = _peer_cpu.snapshot(processes) if processes else None
    start = time.perf_counter()
    for i in range(s.warmup, s.warmup + s.steps):
        losses.append(float(step(i)))
    finish()
    dist.barrier()
    seconds = time.perf_counter() - start
    out: dict[str, Any] = {"seconds": seconds, "first_loss": losses[0], "last_loss": losses[-1], "ready_at": ready_at}
    if before is not None:
        out["cpu"] = {**_peer_cpu.account(before, _peer_cpu.snapshot(processes), s.steps), "step_ms": seconds * 1e3 / s.steps}
    if tables is not None and TABLES * s.rows * s.dim * 4 <= CHECK_BYTES:   # before the profiled steps train on
        out["table_change"] = _table_change(tables(), s)
    if s.profile:
        out["profile"] = _profiled(step, s, finish)
        dist.barrier()
    return out


def _table_change(parts: dict[int, list], s: Setting) -> float:
    """``||W - W0||`` (Frobenius, float64) over all tables, trained ``W`` against :func:`initial_table` ``W0``,
    summed over the trainers; ``parts``: ``{table index: [(row offset, col offset, this trainer's block)]}``
    (DMP's local shards; a full table on one trainer)."""
    total = torch.zeros((), dtype=torch.float64)
    for i, blocks in parts.items():
        start = initial_table(i, s.rows, s.dim).double()
        for r, c, w in blocks:
            total += (w.double() - start[r:r + w.shape[0], c:c + w.shape[1]]).square().sum()
    dist.all_reduce(total)
    return float(total.sqrt())


# ---- torchrec DistributedModelParallel ----------------------------------------------------------------------
def _sharder(row_wise: bool) -> Any:
    """torchrec's EmbeddingBagCollectionSharder; for row-wise a subclass that also offers ``row_wise`` on the
    CPU (torchrec 1.8 offers it for CUDA only; the CPU kernel runs it)."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingType

    class RowWiseOnCPU(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type: str) -> list[str]:
            types = super().sharding_types(compute_device_type)
            return types if ShardingType.ROW_WISE.value in types else types + [ShardingType.ROW_WISE.value]

    return RowWiseOnCPU() if row_wise else EmbeddingBagCollectionSharder()


def _local_shards(model: nn.Module) -> dict[int, list]:
    """``{table index: [(row offset, col offset, block)]}``: this rank's shards of the DMP model's tables (views
    of its fused tables)."""
    state = model.state_dict()
    out = {}
    for i in range(TABLES):
        (key,) = [k for k in state if k.endswith(f"embedding_bags.t_C{i + 1}.weight")]
        shards = state[key].local_shards()
        if shards:
            out[i] = [(*shard.metadata.shard_offsets, shard.tensor) for shard in shards]
    return out


def _load_tables(model: nn.Module, s: Setting) -> None:
    """Copy :func:`initial_table` into this rank's shards of the DMP model."""
    with torch.no_grad():
        for i, blocks in _local_shards(model).items():
            full = initial_table(i, s.rows, s.dim)
            for r, c, w in blocks:
                w.copy_(full[r:r + w.shape[0], c:c + w.shape[1]])


def build_dmp(s: Setting, sharding: str) -> tuple[nn.Module, Any]:
    """``(DistributedModelParallel(DLRMTrain(dlrm)), optimizer)``: tables sharded ``sharding`` (planner
    constrained to it), updated by fused SGD in backward; the dense part DDP (DMP's) with SGD."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.models.dlrm import DLRMTrain
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    train = DLRMTrain(dlrm(s.rows, s.dim, tables_device="meta"))
    apply_optimizer_in_backward(torch.optim.SGD, train.model.sparse_arch.parameters(), {"lr": LR})
    sharder = _sharder(sharding == "row_wise")
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=WORLD, local_world_size=WORLD, compute_device="cpu"),
        constraints={f"t_C{i + 1}": ParameterConstraints(sharding_types=[sharding]) for i in range(TABLES)})
    group = dist.GroupMember.WORLD
    plan = planner.collective_plan(train, [sharder], group)
    model = DistributedModelParallel(train, env=ShardingEnv.from_process_group(group), device=torch.device("cpu"),
                                     plan=plan, sharders=[sharder])
    _load_tables(model, s)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=LR))
    return model, CombinedOptimizer([model.fused_optimizer, dense])


def run_dmp(rank: int, s: Setting) -> dict:
    """``dmp_tw`` / ``dmp_rw``: a plain loop; ``dmp_tw_pipeline``: ``TrainPipelineSparseDist``."""
    from torchrec.datasets.utils import Batch

    model, opt = build_dmp(s, "row_wise" if s.system == "dmp_rw" else "table_wise")
    data = [Batch(d, k, l) for d, k, l in batches(rank, s.total, s.rows)]
    if s.system == "dmp_tw_pipeline":
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        pipe, it = TrainPipelineSparseDist(model, opt, torch.device("cpu")), iter(data)
        return _timed(lambda i: pipe.progress(it)[0], s, tables=lambda: _local_shards(model))

    def step(i: int) -> torch.Tensor:   # the tables' fused SGD runs in backward
        return _sgd_step(lambda: model(data[i])[0], opt)

    return _timed(step, s, tables=lambda: _local_shards(model))


# ---- DDP with local tables ----------------------------------------------------------------------------------
def run_ddp_local(rank: int, s: Setting) -> dict:
    """The plain DLRM, tables in every trainer with sparse gradients averaged after backward
    (``jobs.trainer.sparse_grads``), the rest DDP; SGD on all."""
    from jobs.trainer.sparse_grads import data_parallel

    model = dlrm(s.rows, s.dim, sparse_grad=True)
    bags = model.sparse_arch.embedding_bag_collection.embedding_bags
    with torch.no_grad():
        for i in range(TABLES):
            bags[f"t_C{i + 1}"].weight.copy_(initial_table(i, s.rows, s.dim))
    ddp, average = data_parallel(model, torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = batches(rank, s.total, s.rows)

    def step(i: int) -> torch.Tensor:
        dense, kjt, labels = data[i]
        return _sgd_step(lambda: _bce(ddp(dense, kjt), labels), opt, average)

    def tables() -> dict[int, list]:
        return {i: [(0, 0, bags[f"t_C{i + 1}"].weight.detach())] for i in range(TABLES)} if rank == 0 else {}

    return _timed(step, s, tables=tables)


# ---- the ceiling: no tables ---------------------------------------------------------------------------------
class ConstantPooled(nn.Module):
    """In place of DLRM's sparse arch: a constant ``(B, F, D)`` tensor (what the sparse arch returns), uniform in
    ``±1/sqrt(rows)`` like the tables' rows; no lookups, no table gradients, nothing sent for tables."""

    def __init__(self, batch: int, tables: int, rows: int, dim: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(TABLE_SEED)
        bound = rows ** -0.5
        self.register_buffer("value", (torch.rand(batch, tables, dim, generator=gen) * 2 - 1) * bound,
                             persistent=False)

    def forward(self, features: Any) -> torch.Tensor:
        return self.value


def dense_only_model(rows: int, dim: int, batch: int = BATCH) -> nn.Module:
    """:func:`dlrm` (tables on ``meta``) with its sparse arch replaced by :class:`ConstantPooled`."""
    model = dlrm(rows, dim, tables_device="meta")
    model.sparse_arch = ConstantPooled(batch, TABLES, rows, dim)  # type: ignore[assignment]
    return model


def run_dense_only(rank: int, s: Setting) -> dict:
    """``dense_only``: the DLRM without tables (:func:`dense_only_model`), in DDP as fxdist's dense part (no
    buffer broadcast), SGD: the ceiling of a system that trains these tables."""
    model = dense_only_model(s.rows, s.dim)
    ddp = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    data = batches(rank, s.total, s.rows)

    def step(i: int) -> torch.Tensor:
        dense, kjt, labels = data[i]
        return _sgd_step(lambda: _bce(ddp(dense, kjt), labels), opt)

    return _timed(step, s)


# ---- fxdist parameter servers -------------------------------------------------------------------------------
_LOOKUP_METHODS = ("lookup", "lookup_async", "finish_lookup", "prefetch")
_PUSH_METHODS = ("push", "push_async", "push_grad_async", "finish_push", "settle_push", "defer_push", "flush")


def _regions_on_client(client: Any) -> None:
    """Wrap this process's client's lookup and push methods (on the instance) in :func:`region` ``lookup`` /
    ``push``, so a profile shows where they go (a measuring aid; the client itself is unchanged)."""
    active: set[str] = set()   # a method calling another of its kind counts once

    def wrapped(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            if name in active:
                return method(*args, **kwargs)
            active.add(name)
            try:
                with region(name):
                    return method(*args, **kwargs)
            finally:
                active.discard(name)
        return call

    for names, kind in ((_LOOKUP_METHODS, "lookup"), (_PUSH_METHODS, "push")):
        for m in names:
            if hasattr(client, m):
                setattr(client, m, wrapped(kind, getattr(client, m)))


_TAGS = ("rpc", "inproc", "dynamic", "noauth")
"""The words of an fxdist system's name between ``fx_`` and its schedule (``fx_rpc_inproc_prefetch_0ms``); besides
them ``nice<N>`` (:func:`server_nice`), ``send<0|1>`` (:func:`send_thread_setting`) and ``shm0``
(:func:`shm_setting`)."""


def _tags(system: str) -> set[str]:
    parts = system.split("_")[1:]
    return set(itertools.takewhile(lambda p: p in _TAGS or any(t.fullmatch(p) for t in _VALUED_TAGS), parts))


def _tag_value(system: str, tag: re.Pattern[str]) -> str | None:
    """The value a tag of :data:`_VALUED_TAGS` gives in ``system``'s name (``nice19``: ``"19"``), None without it."""
    for word in _tags(system):
        if (found := tag.fullmatch(word)) is not None:
            return found.group(1)
    return None


def send_thread_setting(system: str) -> str | None:
    """``FXDIST_SOCKET_SEND_THREAD`` for fxdist system ``system``'s trainers: ``"1"`` for ``fx_send1_*``, ``"0"``
    for ``fx_send0_*``, None (the environment's, by default ``auto``) otherwise."""
    return _tag_value(system, SEND_TAG)


def shm_setting(system: str) -> str | None:
    """``FXDIST_SOCKET_SHM_BYTES`` for fxdist system ``system``'s trainers: ``"0"`` (no arena) for ``fx_shm0_*``,
    None (the environment's, by default an arena per connection) otherwise."""
    return _tag_value(system, SHM_TAG)


def server_nice(system: str, default: int = 0) -> int:
    """The nice value of fxdist system ``system``'s separate server processes: ``N`` for ``fx_nice<N>_*``, else
    ``default`` (``--server-nice``; 0: the trainers' priority)."""
    nice = _tag_value(system, NICE_TAG)
    return default if nice is None else int(nice)


def security_off(system: str) -> bool:
    """Whether fxdist system ``system`` runs with the socket transport's security layer off (``fx_noauth_*``,
    :func:`without_security`)."""
    return "noauth" in _tags(system)


def without_security() -> None:
    """Switch the ``socket`` transport's security layer off in this process, for the ``fx_noauth_*`` systems: the
    cost of authentication measured against a peer without it, in the same run. A benchmark-only monkeypatch (the
    shipped code has no switch for it), applied by both the trainers and the servers before their first connection:

    - ``auth.server_handshake`` / ``auth.client_handshake``: no-ops (both ends skip it, so neither waits for the
      other's bytes; the server still sets its read and send timeouts after it);
    - ``socket_wire.safe_loads`` (the name ``recv_frame`` calls, imported from ``safe_pickle.loads``): plain
      ``pickle.loads``, as before the restricted unpickler;
    - ``socket_wire.fresh_bytes`` and ``shm_arena.fresh_bytes`` (the receive buffers, inline and copied out of the
      arena): ``torch.empty(n, dtype=torch.uint8)`` instead of numpy-backed memory, as before.

    Frame limits and the connection cap stay (checks on a header's integers, no per-byte work)."""
    import pickle

    from scheduling.ps.transport import auth, shm_arena, socket_wire

    def no_handshake(*args: Any, **kwargs: Any) -> None:
        return None

    def empty_bytes(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8)

    auth.server_handshake = no_handshake   # type: ignore[assignment]
    auth.client_handshake = no_handshake   # type: ignore[assignment]
    socket_wire.safe_loads = pickle.loads   # type: ignore[assignment]
    socket_wire.fresh_bytes = empty_bytes   # type: ignore[assignment]
    shm_arena.fresh_bytes = empty_bytes     # type: ignore[assignment]


def in_trainers(system: str) -> bool:
    """Whether fxdist system ``system`` keeps its servers inside the trainers (``fx_inproc_*``, ``fx_rpc_inproc_*``)."""
    return "inproc" in _tags(system)


def dynamic_tables(system: str) -> bool:
    """Whether fxdist system ``system`` makes its tables dynamic (``fx_dynamic_*``)."""
    return "dynamic" in _tags(system)


def over_socket(system: str) -> bool:
    """Whether fxdist system ``system`` reaches its servers over the ``socket`` transport: every ``fx_*`` but the
    ``fx_rpc_*`` ones (``torch.distributed.rpc``)."""
    return system.startswith("fx_") and "rpc" not in _tags(system)


def _fx_kind(system: str) -> str:
    """``blocking``, ``prefetch`` or ``stale<k>`` of an fxdist system name."""
    return system.split("_")[1 + len(_tags(system))]


def _fx_model(rank: int, s: Setting, prefetch: bool) -> nn.Module:
    """The DLRM (tables on ``meta``) through ``parameter_servers`` (+ ``async_rpc``, ``async_rpc_prefetch``, or
    for ``fx_stale<k>_*`` ``async_rpc(prefetch=True, max_staleness=k)``); rank 0 creates the tables on the
    servers, then the other trainer attaches."""
    import fxdist
    import scheduling
    from scheduling.ps import trainer_servers

    rpc_in_trainers = in_trainers(s.system) and not over_socket(s.system)   # else registered socket names
    servers = trainer_servers(WORLD) if rpc_in_trainers else [f"ps{i}" for i in range(s.num_servers)]
    placed = plan(s.num_servers)
    dynamic = {name: {"capacity": s.rows} for name in placed} if dynamic_tables(s.system) else None
    ps = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=LR, rank=rank, world_size=WORLD,
                           group=s.group, verbose=False, plan=placed, servers=servers, seed=TABLE_SEED,
                           timeout_s=120.0, dynamic=dynamic)
    if rank != 0:
        dist.barrier()
    kind = _fx_kind(s.system)
    schedule: Any = (functools.partial(scheduling.async_rpc, prefetch=True, max_staleness=int(kind[5:]))
                     if kind.startswith("stale") else "async_rpc_prefetch" if prefetch else "async_rpc")
    gm = fxdist.optimize(dlrm(s.rows, s.dim, tables_device="meta"), passes=(ps, schedule))
    if rank == 0:
        dist.barrier()
    return gm


def run_fx(rank: int, s: Setting) -> dict:
    """``fx_{blocking,prefetch}_{0,1}ms``: tables on ``s.servers`` servers, with the emulated latency per
    lookup (``PSClient.set_delays``); the dense part DDP; SGD. ``fx_inproc_*``: the servers are the trainers."""
    from scheduling import placement
    from scheduling.ps import get_client

    prefetch = _fx_kind(s.system) != "blocking"
    gm = _fx_model(rank, s, prefetch)
    names = placement.client_names(gm)
    if rank == 0:
        get_client(names[0]).set_delays(fetch_delay_s=float(s.system.split("_")[-1][:-2]) / 1e3)
    if s.profile and rank == 0:
        for n in names:
            _regions_on_client(get_client(n))
    dist.barrier()
    # as torchrec's DMP wraps its dense part (DefaultDataParallelWrapper): the traced module's buffers are the
    # trace's tensor constants (DLRM's interaction indices), the same on every trainer; nothing to broadcast
    ddp = nn.parallel.DistributedDataParallel(gm, broadcast_buffers=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    data = batches(rank, s.total, s.rows)
    total = len(data)

    def step(i: int) -> torch.Tensor:
        dense, kjt, labels = data[i]
        extra = {"next_sparse_features": data[i + 1][1] if i + 1 < total else None} if prefetch else {}
        return _sgd_step(lambda: _bce(ddp(dense, kjt, **extra), labels), opt)   # pushes start in backward

    def tables() -> dict[int, list]:
        if rank != 0:
            return {}
        state = placement.table_state_dict(gm)
        return {i: [(0, 0, state[f"sparse_arch.embedding_bag_collection.embedding_bags.t_C{i + 1}.weight"])]
                for i in range(TABLES)}

    # the timing ends at a barrier; dynamic tables' rows start as made per id, not as W0: no table check
    result = _timed(step, s, finish=lambda: placement.flush(gm), tables=None if dynamic_tables(s.system) else tables)
    result["prefetch_hits"] = sum(get_client(n).prefetch_hits for n in names)
    if rank == 0 and not in_trainers(s.system):   # servers in the trainers end with them
        get_client(names[0]).stop_servers()
    placement.close(gm)
    if in_trainers(s.system):   # no trainer still sends to a server that ends with its trainer
        dist.barrier()
    return result


# ---- process entry points -----------------------------------------------------------------------------------
def _quiet() -> None:
    """Silence torchrec's advice (topology built directly, storage reservation, DMP's DDP arguments), the RPC
    group's deprecation warning and torch.fx's ``is_fx_tracing`` note, printed by every process of every run."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message="You are using a Backend")   # torch.distributed.rpc's init
    for name in ("torchrec", "torch.fx._symbolic_trace"):
        logging.getLogger(name).setLevel(logging.ERROR)


def server_main(rank: int, rpc_port: int, servers: int, nice: int = 0) -> None:
    """Parameter server ``ps<rank - WORLD>`` of ``servers`` (ranks after the trainers'); serves until a trainer
    stops it.
    ``nice``: added to the process's nice value first (``os.nice``; a lower scheduling priority than the
    trainers' for ``nice > 0``)."""
    import os

    from scheduling.ps import start_server

    if nice:
        os.nice(nice)
    _quiet()
    start_server(f"ps{rank - WORLD}", rank, WORLD + servers, master_port=rpc_port, timeout_s=120)


def socket_server_main(index: int, queue: Any, nice: int = 0, system: str = "") -> None:
    """Parameter server ``ps<index>`` over the ``socket`` transport: binds a free port, puts ``(index, "host:port")``
    on ``queue``, serves until a trainer stops it. ``nice``: as :func:`server_main`'s; ``system``: the run's system
    (``fx_noauth_*``: the security layer off here too, :func:`without_security`)."""
    import os

    from scheduling.ps.transport.socket_server import serve

    if nice:
        os.nice(nice)
    if security_off(system):
        without_security()
    _quiet()
    serve(f"ps{index}", on_ready=lambda address: queue.put((index, address)))


def trainer_main(rank: int, s: Setting, queue: Any, pids: Any = None, addresses: Any = None) -> None:
    """Trainer ``rank`` of ``s.system``; puts ``(rank, result)`` on ``queue``. ``pids`` (``--cpu-account``): a
    shared array of the run's process ids, trainers first (ranks ``0..WORLD-1``), then the servers; trainer 0
    then accounts their CPU over the timed steps (``result["cpu"]``, :mod:`_peer_cpu`). ``addresses``
    (socket systems): a queue that brings the servers' ``host:port`` tuple, in server order, once they listen (each
    bound its port, then published it; the trainers start beside the servers instead of after them)."""
    torch.set_num_threads(1)
    if (send := send_thread_setting(s.system)) is not None:   # before the first connection opens
        os.environ["FXDIST_SOCKET_SEND_THREAD"] = send
    if (shm := shm_setting(s.system)) is not None:
        os.environ["FXDIST_SOCKET_SHM_BYTES"] = shm
    if security_off(s.system):   # before the first connection opens (servers in the trainers too)
        without_security()
    if pids is not None and rank == 0:
        _PIDS.append(pids)
    _quiet()
    fx = s.system.startswith("fx_")
    rpc_group = fx and not over_socket(s.system)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{s.pg_port}", rank=rank, world_size=WORLD)
        if over_socket(s.system) and in_trainers(s.system):   # server `rank` here, then every trainer's address
            from scheduling.ps.in_trainers import serve_in_trainer_socket, share_addresses

            serve_in_trainer_socket(f"ps{rank}")
            share_addresses([f"ps{i}" for i in range(WORLD)])   # registers the names: the clients pick socket
        elif over_socket(s.system):   # clients given these names pick the socket transport
            from scheduling.ps.transport.socket_transport import register_servers

            register_servers({f"ps{i}": address for i, address in enumerate(addresses.get(timeout=120))})
        if rpc_group:
            from scheduling.ps import init_trainer, serve_in_trainer

            if in_trainers(s.system):   # server `rank` in this process, before any request can reach it
                serve_in_trainer(f"trainer{rank}", name=f"ps{rank}")
            world = WORLD if in_trainers(s.system) else WORLD + s.servers
            init_trainer(f"trainer{rank}", rank, world, master_port=s.rpc_port, timeout_s=120)
        run = (run_fx if fx else run_ddp_local if s.system == "ddp_local" else
               run_dense_only if s.system == "dense_only" else run_dmp)
        queue.put((rank, run(rank, s)))
    except BaseException as e:
        queue.put((rank, {"error": f"{type(e).__name__}: {e}"}))
        raise
    finally:
        if rpc_group:
            from torch.distributed import rpc

            rpc.shutdown(graceful=False)
        from scheduling.ps import stop_serving

        stop_serving()   # nothing when this process serves none
        if dist.is_initialized():
            dist.destroy_process_group()
