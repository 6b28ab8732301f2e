"""The step loop of one phase on one trainer (:class:`TrainPipeline`, after torchrec's ``TrainPipeline``): the trained
module (the eager model, or ``fxdist.optimize(model, passes)``), its DDP wrapper, optimizer and batch stream, trained
in blocks of steps so that phases can alternate (:mod:`jobs.trainer.phases`); each step's measurements go to a
:class:`PhaseRun`.

Source: torchrec ``torchrec.distributed.train_pipeline.TrainPipeline`` (``progress(iterator)``: one step);
PyTorch DDP.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from jobs.config import JobConfig
from jobs.optimizers import dense_optimizer
from jobs.records import OptimizeRecord
from jobs.staleness import optimized_passes
from jobs.trainer.lookups import optimize_record
from jobs.trainer.metrics import Exporter
from jobs.trainer.protocols import StepBatch, Tables, Workload
from jobs.trainer.sparse_grads import data_parallel
from jobs.trainer.workload import release_tables

PHASES = ("baseline", "optimized")
"""The phases of a job, in order: the eager model, then ``fxdist.optimize``'s."""


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
                         ) -> tuple[nn.Module, OptimizeRecord]:
    """The module trained in ``phase``: the eager model, or ``fxdist.optimize(model, passes)``; when the
    tables have a ``placement_pass()`` (parameter servers), that pass comes first in both phases
    (no eager fallback then: the tables must move)."""
    info: OptimizeRecord = {"passes": [], "fallback": None}
    first = tables.placement_pass()
    passes = [first] if first is not None else []
    # with [phases] max_staleness, async_rpc_prefetch runs with that staleness (jobs.staleness)
    passes += optimized_passes(config.phases.passes, config.phases.max_staleness) if phase != "baseline" else []
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


class TrainPipeline:
    """One phase's model in training: the trained module (eager, or ``fxdist.optimize``), its DDP wrapper,
    optimizer and batch stream, trained in blocks of steps so that phases can alternate (:meth:`train`).

    Args:
        tables: The phase's tables (:class:`jobs.trainer.protocols.Tables`:
            :class:`jobs.trainer.workload.LocalTables` or a :class:`jobs.trainer.servers.ServerTables` view):
            ``lookup_seconds()``, ``after_backward()`` and, on servers, the ``parameter_servers`` pass.
        workload: The model and its data (:class:`jobs.trainer.protocols.Workload`, e.g.
            ``CriteoWorkload(config, shard)``).
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

        def after_backward() -> None:
            sync_sparse()
            tables.after_backward()

        self._after_backward = after_backward
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
        return {k: v for k, v in plain_state(self.model.state_dict()).items() if k not in self.tables.moved}

    def _next(self) -> StepBatch:
        return self.workload.step_batch(next(self._batches), self.tables, self.device)

    def _lookahead(self) -> dict[str, Any]:
        """``{next_<input>: the next batch's <input>}`` for the module's ``next_*`` parameters; none before a
        checkpoint of dynamic tables: looking the next batch up is a step of them, which the checkpoint would hold,
        and a run resumed from it would make that lookup again (the baseline makes it once); none before a delta of
        them either (``[export] every_steps``): the delta of step ``k`` is the tables after step ``k``."""
        every, nxt, deltas = self.config.job.checkpoint_every, self.step + 1, self.config.export.every_steps
        if self.config.model.table_sizes == "dynamic" and nxt < self.config.job.steps and (
                (every and nxt % every == 0) or (deltas and nxt % deltas == 0)):   # so is a delta (jobs.trainer.deltas)
            return {}
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
            step = cast(StepBatch, self._upcoming)  # None only once self.step reaches steps
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
) -> tuple[PhaseRun, OptimizeRecord, torch.optim.Optimizer]:
    """Train ``model`` for the rest of ``phase`` (steps ``start_step .. steps - 1``) in one block.

    Returns:
        (measurements, optimize info, optimizer).
    """
    trainer = TrainPipeline(phase, model, tables, workload, config, start_step=start_step, optim_state=optim_state,
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


def plain_state(state: dict) -> dict:
    """State dict with server-side entries (non-tensors) dropped."""
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}

