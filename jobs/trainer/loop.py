"""The per-trainer training loop that Ray Train runs: baseline phase, optimized phase, checkpoints.

``train_loop({"spec": spec})`` is the ``train_loop_per_worker`` of the job's ``TorchTrainer`` (``spec``: a
:class:`jobs.trainer.spec.TrainerSpec`). It meets the model only through the seams of :mod:`jobs.trainer.protocols` (a ``Workload``
and its ``Tables``). Each trainer:

1. reads its shard of the data (:mod:`jobs.trainer.workload`: the Criteo reader, or your ``[data] batches``) and
   starts its metrics exporter;
2. sets up the embedding tables: in the trainer (DDP, sparse gradients) or on the parameter servers
   (``jobs.trainer.servers.ServerTables``, over ``torch.distributed.rpc``: the ``parameter_servers`` pass moves the tables
   of each phase's model, the built-in torchrec DLRM or yours, there);
3. trains both phases over the same batches, interleaved: ``baseline`` trains the eager module (on servers:
   after only the ``parameter_servers`` pass, so its lookups block), ``optimized`` trains
   ``fxdist.optimize(model, passes)`` (both wrapped in DDP), each from the same
   initial weights with its own optimizer and its own tables; they alternate blocks of
   ``[phases] block_steps`` steps (the order flips every block), so both see the same machine load
   and the QPS gain is the median of paired block ratios (:func:`jobs.stats.interleaved_gain`);
4. checkpoints every ``checkpoint_every`` steps (both phases' dense weights, optimizer states and
   server tables in one Ray Train checkpoint) and at the end, so a restarted worker group resumes both
   phases at the same step;
5. measures the held-out AUC / log loss of each phase's model after ``[job] eval_epochs`` passes over
   its shard (:func:`eval_step`; one epoch by default, where DLRM on Criteo is known to peak and
   longer training over-fits) and again at the end; for the last phase it keeps a copy of the
   evaluated model, which the launcher quantizes;
6. sends progress to the launcher's :class:`JobState` actor, and per-phase statistics at phase ends.

Source: Ray Train ``TorchTrainer`` user guide (report / get_checkpoint); DLRM training recipe.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import os
import signal
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from jobs.config import JobConfig
from jobs.optimizers import dense_optimizer
from jobs.stats import interleaved_gain, peak_rss_bytes, phase_summary
from jobs.trainer.lookups import optimize_record
from jobs.trainer.metrics import Exporter
from jobs.trainer.protocols import StepBatch, Tables, Workload
from jobs.trainer.sparse_grads import data_parallel
from jobs.trainer.spec import TrainerSpec
from jobs.trainer.workload import build_model, make_tables, make_workload, release_tables
from jobs.user_code import user_error_frame

__all__ = ["train_loop", "PhaseRun", "PhaseTrainer", "build_model", "run_phase", "eval_step", "block_ends"]

PHASES = ("baseline", "optimized")
REGISTER_WAIT_S = 3.0


@dataclass
class PhaseRun:
    """Measurements of one phase on one trainer."""

    phase: str
    start_step: int
    steps: int = 0
    samples: int = 0
    wall_seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)
    lookup_seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    """Training seconds since the phase started (callbacks excluded), at the end of each step."""
    callback_seconds: float = 0.0
    """Time spent in ``on_step`` (checkpoints, progress, fault checks); excluded from ``wall_seconds``."""
    prefetched_lookups: int = 0
    """Parameter-server lookups answered by a prefetch (``async_rpc_prefetch``) during the phase."""
    metrics_seconds: float = 0.0
    """Time spent updating the Prometheus metrics after each step (``Exporter.observe_step``); part of
    ``wall_seconds``: the direct measure of the export's cost in the training loop."""
    blocks: list[float] = field(default_factory=list)
    """Training seconds of each block of steps (phases alternate block by block; see :func:`block_ends`)."""


def _make_trained_module(model: nn.Module, phase: str, config: JobConfig, tables: Tables,
                         ) -> tuple[nn.Module, dict[str, Any]]:
    """The module trained in ``phase``: the eager model, or ``fxdist.optimize(model, passes)``; when the
    tables have a ``placement_pass()`` (parameter servers), that pass comes first in both phases
    (no eager fallback then: the tables must move)."""
    info: dict[str, Any] = {"passes": [], "fallback": None}
    first = tables.placement_pass()
    passes = [first] if first is not None else []
    passes += list(config.phases.passes) if phase != "baseline" else []
    if not passes:
        return model, info
    import fxdist

    try:
        gm = fxdist.optimize(model, passes=tuple(passes))
    except Exception as e:  # the tracer's error carries the hint; we only decide whether to go on
        if not config.job.allow_eager_fallback or first is not None:
            raise
        info["fallback"] = f"{type(e).__name__}: {e}"
        return model, info
    if first is not None:
        tables.attach(gm)
        info["placement"] = gm.meta["fxdist"].get("placement", {}).get("plan_text")
    info.update(optimize_record(gm))  # the passes run; per lookup, whether async_rpc_prefetch prefetches it
    return gm, info


class PhaseTrainer:
    """One phase's model in training: the trained module (eager, or ``fxdist.optimize``), its DDP wrapper,
    optimizer and batch stream, trained in blocks of steps so that phases can alternate (:meth:`train`).

    Args:
        tables: The phase's tables (:class:`jobs.trainer.protocols.Tables`: :class:`jobs.trainer.workload.LocalTables` or a
            :class:`jobs.trainer.servers.ServerTables` view): ``lookup_seconds()``, ``after_backward()`` and, on servers, the
            ``parameter_servers`` pass.
        workload: The model and its data (:class:`jobs.trainer.protocols.Workload`, e.g. ``CriteoWorkload(config, shard)``).
        start_step: The first step (a resumed trainer continues the batch sequence there).
        optim_state: Optimizer state to resume from.

    Prefetch: a module from ``async_rpc_prefetch`` takes ``next_<input>`` arguments; each step passes the next
    batch's input of that name (positional inputs are named by the module's ``forward`` signature).
    """

    def __init__(self, phase: str, model: nn.Module, tables: Tables, workload: Workload, config: JobConfig, *,
                 start_step: int = 0, optim_state: dict | None = None, exporter: Exporter | None = None) -> None:
        self.phase, self.model, self.tables, self.config, self.exporter = phase, model, tables, config, exporter
        self.workload = workload
        self.device = _device(config)
        model._apply(lambda t: t if t.is_meta else t.to(self.device))  # tables on meta stay there (servers')
        self.module, self.info = _make_trained_module(model, phase, config, tables)
        release_tables(model, tables.moved)
        # a model on servers is evaluated through its module (its own tables left the trainer)
        self.evaluated = model if tables.local else self.module
        self.trained, sync_sparse = data_parallel(self.module, self.device)  # DDP; sparse tables averaged apart
        self._after_backward = lambda: (sync_sparse(), tables.after_backward())
        self.optimizer = dense_optimizer(config, (p for p in self.trained.parameters() if p.requires_grad))
        if optim_state is not None:
            self.optimizer.load_state_dict(optim_state)
        self.run = PhaseRun(phase, start_step)
        self.step = start_step
        self._batches = self.workload.train_batches(start_step)
        self._names, self._ahead = _next_batch_inputs(self.module)
        self._hits = self._prefetch_hits()
        self._upcoming = self._next() if start_step < config.job.steps else None

    def _prefetch_hits(self) -> int:
        return self.tables.prefetch_hits()

    def dense_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict without the tables that live on the servers (``tables.state_dict()`` has those)
        and without non-tensor entries: what a checkpoint saves as the phase's model."""
        return {k: v for k, v in _plain_state(self.model.state_dict()).items() if k not in self.tables.moved}

    def _next(self) -> StepBatch:
        return self.workload.step_batch(next(self._batches), self.tables, self.device)

    def _lookahead(self) -> dict[str, Any]:
        """``{next_<input>: the next batch's <input>}`` for the module's ``next_*`` parameters."""
        if not self._ahead or self._upcoming is None:
            return {}
        given = {**dict(zip(self._names, self._upcoming.args)), **self._upcoming.kwargs}
        return {nxt: given[name] for nxt, name in self._ahead.items() if name in given}

    def train(self, until: int, on_step: Any = None) -> float:
        """Train steps ``self.step .. until - 1``; returns their training seconds (``on_step`` excluded).

        ``on_step(step, run, module, optimizer)`` runs after each step (checkpoints, progress, faults).
        """
        run, steps = self.run, self.config.job.steps
        block_start, callbacks = time.perf_counter(), 0.0
        before = run.wall_seconds
        while self.step < min(until, steps):
            step = self._upcoming
            self._upcoming = self._next() if self.step + 1 < steps else None
            # a module from async_rpc(prefetch=True) takes the next batch's inputs, to look them up in this step
            ahead = self._lookahead()
            t0 = time.perf_counter()
            loss = self.workload.step_loss(self.trained, step, ahead)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self._after_backward()
            self.optimizer.step()
            t1 = time.perf_counter()
            self._record(step.rows, t1 - t0, loss.item(), before + t1 - block_start - callbacks)
            self.step += 1
            if on_step is not None:
                t2 = time.perf_counter()
                on_step(self.step, run, self.module, self.optimizer)
                callbacks += time.perf_counter() - t2
        block = time.perf_counter() - block_start - callbacks
        run.wall_seconds += block
        run.callback_seconds += callbacks
        run.blocks.append(block)
        run.prefetched_lookups = self._prefetch_hits() - self._hits
        return block

    def _record(self, samples: int, step_seconds: float, loss: float, since_start: float) -> None:
        run, fetch = self.run, self.tables.lookup_seconds()
        run.steps += 1
        run.samples += samples
        run.step_seconds.append(step_seconds)
        run.losses.append(loss)
        run.times.append(since_start)
        if fetch is not None:
            run.lookup_seconds.append(fetch)
        if self.exporter is not None:
            t_metrics = time.perf_counter()
            self.exporter.observe_step(self.phase, samples=samples, step_seconds=step_seconds,
                                       lookup_seconds=fetch, loss=loss)
            run.metrics_seconds += time.perf_counter() - t_metrics


def run_phase(
    phase: str,
    model: nn.Module,
    tables: Tables,
    workload: Workload,
    config: JobConfig,
    *,
    start_step: int = 0,
    optim_state: dict | None = None,
    exporter: Exporter | None = None,
    on_step: Any = None,
) -> tuple[PhaseRun, dict[str, Any], torch.optim.Optimizer]:
    """Train ``model`` for the rest of ``phase`` (steps ``start_step .. steps - 1``) in one block.

    Returns:
        (measurements, optimize info, optimizer).
    """
    trainer = PhaseTrainer(phase, model, tables, workload, config, start_step=start_step, optim_state=optim_state,
                           exporter=exporter)
    trainer.train(config.job.steps, on_step)
    return trainer.run, trainer.info, trainer.optimizer


def _device(config: JobConfig) -> torch.device:
    """This trainer's device: Ray Train's GPU with ``[cluster] use_gpu``, else the CPU."""
    if not config.cluster.use_gpu:
        return torch.device("cpu")
    import ray.train.torch

    return ray.train.torch.get_device()


def _next_batch_inputs(module: nn.Module) -> tuple[list[str], dict[str, str]]:
    """(the names of ``module.forward``'s inputs, ``{"next_<input>": "<input>"}`` for every ``next_*``
    parameter that ``async_rpc(prefetch=True)`` added), so each step can pass the next batch's inputs."""
    params = inspect.signature(module.forward).parameters
    ahead = {n: n[len("next_"):] for n in params if n.startswith("next_") and n[len("next_"):] in params}
    return [n for n in params if n not in ahead], ahead


@torch.no_grad()
def evaluate(model: nn.Module, workload: Workload, tables: Tables) -> dict[str, float]:
    """The held-out quality of ``model`` on the workload's eval batches (:meth:`quality`: AUC and log loss
    for the DLRM); ``{}`` when this rank has none."""
    batches = workload.eval_batches()
    if batches is None:
        return {}
    model.eval()
    device = next(model.parameters()).device
    outputs, labels = [], []
    for batch in batches:
        args, kwargs, y = workload.inputs(batch, tables, device)
        outputs.append(tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), model(*args, **kwargs)))
        labels.append(y.cpu())
    model.train()
    return workload.quality(outputs, labels)


def _gather(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _maybe_inject_faults(config: JobConfig, phase: str, step: int, rank: int, world: int, state,
                         tables: Tables) -> None:
    """Fire the configured faults once per job (the JobState actor remembers which fired): kill a trainer,
    kill a server, or pause rank 0 (a window for an outside fault; the pause's start is a timeline event).

    Before a fault the victim waits ``REGISTER_WAIT_S``: Ray Train registers a reported checkpoint at
    its next health check (every 2 s), and a fault timed right after a checkpoint would otherwise roll
    back to the one before, which real faults are not timed to do.
    """
    import ray

    faults = config.faults
    if phase != PHASES[1]:
        return
    if step == faults.kill_trainer_at_step and rank == world - 1:
        if ray.get(state.fire.remote("trainer")):
            time.sleep(REGISTER_WAIT_S)
            state.event.remote(f"fault: killing trainer rank {rank} (pid {os.getpid()}) at step {step}")
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
    if step == faults.pause_at_step and rank == 0:
        if ray.get(state.fire.remote("pause")):
            time.sleep(REGISTER_WAIT_S)
            ray.get(state.event.remote(f"fault: pausing trainer rank 0 (pid {os.getpid()}) for "
                                       f"{faults.pause_seconds} s at step {step}"))
            time.sleep(faults.pause_seconds)
    if step == faults.kill_server_at_step and rank == 0 and tables.can_kill_server:
        if ray.get(state.fire.remote("server")):
            time.sleep(REGISTER_WAIT_S)
            state.event.remote(f"fault: killing parameter server 0 at step {step}")
            tables.kill_server(0)


def digest(state: dict[str, Any]) -> str:
    """SHA-1 of a state dict's tensors (names, shapes, bytes), to check that a restore is exact."""
    h = hashlib.sha1()
    for key in sorted(state):
        value = state[key]
        if isinstance(value, torch.Tensor):
            h.update(f"{key}:{tuple(value.shape)}:{value.dtype}".encode())
            h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _save_checkpoint(step: int, trainers: dict[str, PhaseTrainer], early: dict[str, dict[str, Any]], rank: int,
                     final: bool, state: Any = None) -> None:
    """Report a Ray Train checkpoint of every phase at ``step`` (rank 0 writes it; every rank reports).

    Per phase: dense weights, server tables, optimizer state, and ``early``: the phase's mid-phase
    evaluation so far (``step``, ``quality``, and in the last phase the evaluated model's ``model`` /
    ``tables``), so it survives a restart.
    """
    import ray.train

    for t in trainers.values():
        t.tables.sync()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank has pushed its updates for `step` to the servers
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if rank == 0:
            saved: dict[str, Any] = {"step": step, "final": final, "models": {}, "tables": {}, "optim": {},
                                     "eval": {p: dict(e) for p, e in early.items()}}
            for phase, t in trainers.items():
                dense, tables = t.dense_state(), t.tables.state_dict()
                saved["models"][phase], saved["tables"][phase] = dense, tables
                saved["optim"][phase] = t.optimizer.state_dict()
                if state is not None:
                    state.checkpointed.remote(phase, step, digest(dense), digest(tables))
            torch.save(saved, os.path.join(tmp, "state.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report({"step": step, "final": final}, checkpoint=checkpoint)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # the other ranks wait here, not in their next block (its time would include rank 0's save)


def _plain_state(state: dict) -> dict:
    """State dict with server-side entries (non-tensors) dropped."""
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _load_checkpoint() -> dict | None:
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, "state.pt"), map_location="cpu", weights_only=False)


def _deterministic_errors() -> dict[type, str]:
    """Error types that a retry cannot fix -> the kind the launcher maps to an exit status."""
    from fxdist.errors import TraceError
    from jobs.config import ConfigError
    from recsys.criteo_format import DataError

    return {ConfigError: "config", DataError: "data", TraceError: "job"}


def train_loop(loop_config: dict[str, TrainerSpec]) -> None:
    """Ray Train entry point: run the job on this trainer, stopping for good on a deterministic error.

    ``loop_config``: ``{"spec": spec}`` (Ray Train's ``train_loop_config`` is a dict), ``spec`` the
    :class:`jobs.trainer.spec.TrainerSpec` every trainer of the job gets.

    A deterministic error (:func:`_deterministic_errors`: bad config or data, a model that does not trace, an
    exception raised in your own code or a loss of yours without gradient at ``loss.backward()``:
    :func:`jobs.user_code.user_error_frame`) is recorded on the launcher's JobState actor; with one trainer the
    loop then returns, so ``fit()`` ends without a retry; with more it re-raises (the other ranks may wait in a
    collective, and only a restart frees them), and every later attempt returns at once, seeing the recorded
    error. Ray Train's retries are thus left to process and node failures.
    """
    import ray
    import ray.train

    spec = loop_config["spec"]
    state = spec.state
    if ray.get(state.failure.remote()) is not None:
        return  # an earlier attempt hit a deterministic error: nothing to retry
    try:
        _train_loop(spec)
    except Exception as e:  # noqa: BLE001 - deterministic errors stop the job; the others are Ray Train's
        kind, message = next((k for t, k in _deterministic_errors().items() if isinstance(e, t)), None), str(e)
        if kind is None and (where := user_error_frame(e, spec.config)) is None:
            raise
        if kind is None:
            kind, message = "job", f"{e} (raised by your code at {where}; not retried)"
        ctx = ray.train.get_context()
        ray.get(state.fail.remote(kind, type(e).__name__, message, ctx.get_world_rank()))
        if ctx.get_world_size() > 1:
            raise


def _train_loop(spec: TrainerSpec) -> None:
    """Run every phase of the job on this trainer (``spec``: the launcher's plan and runtime handles)."""
    import ray
    import ray.train

    from jobs.cluster import serve_exporter, where

    config, state = spec.config, spec.state
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if rank == 0:
        state.event.remote("rank 0: training loop started")
    torch.set_num_threads(max(1, int(config.cluster.cpus_per_trainer)))
    exporter, bound = None, None
    if spec.metrics_port is not None:
        exporter = Exporter(config.job.name, rank)
        exporter.touch(PHASES)
        bound = serve_exporter(exporter, config.metrics.host, spec.metrics_port + rank)
    state.placed.remote(f"trainer{rank}", where(bound))  # where this trainer and its exporter run
    workload = make_workload(config, rank, world, str(spec.plan.data_path or ""), plan=spec.plan.data_plan,
                             exporter=exporter)
    if rank == 0 and workload.parse is not None:
        state.parse_stats.remote(workload.parse, workload.rows)
    resume = _load_checkpoint()
    tables = make_tables(config, rank, world, spec, exporter)
    if rank == 0:
        state.event.remote("rank 0: data loaded, tables ready")
    graceful = False
    try:
        _run_phases(config, rank, world, workload, tables, resume, state, exporter)
        graceful = True
    finally:
        tables.close(graceful=graceful)
        workload.close()
        if exporter is not None:
            exporter.close()
    ray.get(state.process_stats.remote(f"trainer{rank}", {"pid": os.getpid(), "peak_rss_bytes": peak_rss_bytes()}))


def eval_step(config: JobConfig, shard_rows: int) -> int:
    """The step after which a phase's held-out AUC / log loss are measured.

    ``ceil([job] eval_epochs * shard_rows / batch_size)``: the model after that many passes over a
    trainer's shard (``shard_rows``: the largest shard), capped at ``[job] steps``; ``eval_epochs = 0``
    means the end of the phase.
    """
    epochs, steps = config.job.eval_epochs, config.job.steps
    if epochs <= 0:
        return steps
    return max(1, min(steps, math.ceil(epochs * shard_rows / config.job.batch_size)))


def _evaluate_mid_phase(t: PhaseTrainer, step: int, snapshot: bool) -> dict[str, Any]:
    """All ranks: held-out quality of ``model`` now (rank 0), and with ``snapshot`` a copy of its dense
    weights and tables (the model the job quantizes). Between two barriers, so no trainer's timed step
    waits for rank 0's evaluation."""
    tables = t.tables
    tables.sync()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank's updates for `step` are on the servers
    out: dict[str, Any] = {}
    if t.workload.has_eval:
        out = {"step": step, "quality": evaluate(t.evaluated, t.workload, tables)}
        if snapshot:
            out["model"] = {k: v.detach().clone() for k, v in t.dense_state().items()}
            out["tables"] = tables.state_dict()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return out


def block_ends(start: int, steps: int, block_steps: int, checkpoint_every: int) -> list[int]:
    """The steps at which the blocks of an interleaved run end: every ``block_steps`` steps after ``start``,
    at every checkpoint step (both phases must be at the same step there) and at ``steps``.

    >>> block_ends(0, 25, 10, 0), block_ends(10, 40, 10, 15)
    ([10, 20, 25], [15, 20, 30, 40])
    """
    ends = set(range(start + block_steps, steps, block_steps)) if block_steps > 0 else set()
    if checkpoint_every:
        ends |= set(range(checkpoint_every, steps, checkpoint_every))
    return sorted(e for e in ends | {steps} if e > start)


def _start_phases(config, rank, workload, tables, resume, state, exporter) -> dict[str, PhaseTrainer]:
    """A :class:`PhaseTrainer` per phase, from the seed's weights or from the checkpoint ``resume`` (dense
    weights before the module is built, tables after: your model's tables exist once its pass has run)."""
    phases = [p for p in PHASES if p != "baseline" or config.phases.baseline]
    start = resume["step"] if resume is not None else 0
    trainers = {}
    for phase in phases:
        view = tables.view(phase)
        model = workload.build(view)
        optim_state = None
        if resume is not None:
            model.load_state_dict(resume["models"][phase], strict=False)
            optim_state = resume["optim"][phase]
        trainers[phase] = PhaseTrainer(phase, model, view, workload, config, start_step=start, optim_state=optim_state,
                                       exporter=exporter)
        if resume is not None:
            view.load_state_dict(resume["tables"][phase])
            if rank == 0:  # what the model and the (fresh) servers hold now, for the job's record
                state.restored.remote(phase, start, digest(trainers[phase].dense_state()), digest(view.state_dict()))
        if rank == 0:
            state.phase_started.remote(phase, start, config.job.steps)
    return trainers


def _run_phases(config, rank, world, workload, tables, resume, state, exporter) -> None:
    """Train every phase over the same batches, alternating blocks of ``[phases] block_steps`` steps (the
    order flips every block), each phase keeping its own model, optimizer and tables; then summarise."""
    if resume is not None and resume.get("final"):
        return  # every phase finished before this restart
    steps, every = config.job.steps, config.job.checkpoint_every
    shard_rows = max(_gather(workload.rows))
    at = eval_step(config, shard_rows)
    trainers = _start_phases(config, rank, workload, tables, resume, state, exporter)
    early = {p: dict(((resume or {}).get("eval") or {}).get(p) or {}) for p in trainers}
    last = list(trainers)[-1]

    def on_step(step, run, module, optimizer):
        phase = run.phase
        if rank == 0 and (step % 5 == 0 or step == steps):
            state.progress.remote(phase, step)
        if step == at and step < steps:
            early[phase].update(_evaluate_mid_phase(trainers[phase], step, snapshot=phase == last))
        _maybe_inject_faults(config, phase, step, rank, world, state, trainers[phase].tables)

    start = next(iter(trainers.values())).step
    for b, end in enumerate(block_ends(start, steps, config.phases.block_steps, every)):
        for phase in (list(trainers) if b % 2 == 0 else list(trainers)[::-1]):
            trainers[phase].train(end, on_step)
        if rank == 0 and exporter is not None and len(trainers) > 1:
            exporter.observe_gain(interleaved_gain([{p: t.run.blocks for p, t in trainers.items()}]))
        if every and end % every == 0 and end < steps:
            _save_checkpoint(end, trainers, early, rank, final=False, state=state)
    _finish_phases(config, rank, workload, trainers, early, state, shard_rows)


def reader_summary(stats: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The trainers' reader statistics (:meth:`recsys.criteo_stream.CriteoStream.stats`, one per rank) in one:
    ``lines_per_s`` (the mean per-worker parse rate), ``capacity_lines_per_s`` (all trainers' workers
    together), ``workers`` (per trainer), ``lines``, ``rows``, ``per_trainer``; None without a stream.

    >>> reader_summary([{"lines_per_s": 100.0, "capacity_lines_per_s": 200.0, "workers": 2, "lines": 5, "rows": 4},
    ...                 {"lines_per_s": 300.0, "capacity_lines_per_s": 600.0, "workers": 2, "lines": 5, "rows": 5}])
    ... # doctest: +NORMALIZE_WHITESPACE
    {'lines_per_s': 200.0, 'capacity_lines_per_s': 800.0, 'workers': 2, 'lines': 10, 'rows': 9,
     'per_trainer': [100.0, 300.0]}
    """
    stats = [s for s in stats if s]
    if not stats:
        return None
    return {"lines_per_s": sum(s["lines_per_s"] for s in stats) / len(stats),
            "capacity_lines_per_s": sum(s["capacity_lines_per_s"] for s in stats), "workers": stats[0]["workers"],
            "lines": sum(s["lines"] for s in stats), "rows": sum(s["rows"] for s in stats),
            "per_trainer": [s["lines_per_s"] for s in stats]}


def _finish_phases(config, rank, workload, trainers, early, state, shard_rows: int) -> None:
    """Every phase's summary to the JobState (rank 0), then the final checkpoint; ``shard_rows``: the largest
    trainer's shard."""
    steps = config.job.steps
    reader = reader_summary(_gather(workload.reader_stats()))
    for phase, t in trainers.items():
        t.tables.sync()
        runs = _gather(t.run)  # also a barrier: every rank's updates are on the servers before evaluation
        end = evaluate(t.evaluated, workload, t.tables) if workload.has_eval else {}
        if rank == 0:
            quality_step = early[phase].get("step", steps)
            summary = phase_summary(runs, config.job.batch_size, quality=early[phase].get("quality", end),
                                    quality_step=quality_step, quality_epochs=quality_step * config.job.batch_size
                                    / shard_rows, quality_end=end, optimize=t.info, resumed_from_step=t.run.start_step,
                                    epochs=steps * config.job.batch_size / shard_rows,
                                    block_seconds=[r.blocks for r in runs], reader=reader)
            __import__("ray").get(state.phase_done.remote(phase, summary))
    _save_checkpoint(steps, trainers, early, rank, final=True, state=state)
