"""Held-out evaluation of a phase's model: when (:func:`eval_step`: after ``[job] eval_epochs`` passes over the
shard), on which batches (the workload's eval batches), and mid-phase between two barriers
(:func:`evaluate_mid_phase`, with a snapshot of the model the job quantizes).

Source: DLRM training recipe (AUC peaks after one epoch on Criteo).
"""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from jobs.config import JobConfig
from jobs.records import EarlyEval, Quality
from jobs.trainer.protocols import Tables, Workload

if TYPE_CHECKING:
    from jobs.trainer.pipeline import TrainPipeline


@torch.no_grad()
def evaluate(model: nn.Module, workload: Workload, tables: Tables) -> Quality:
    """The held-out quality of ``model`` on the workload's eval batches (:meth:`quality`: AUC and log loss
    for the DLRM); ``{}`` when this rank has none. Lookups of tables on parameter servers are read-only
    (:func:`scheduling.placement.read_only`): evaluation changes no dynamic table and leaves training's prefetches
    alone, so the training that follows is the same however often one evaluates."""
    from scheduling.placement import read_only

    batches = workload.eval_batches()
    if batches is None:
        return {}
    model.eval()
    device = next(model.parameters()).device
    outputs, labels = [], []
    with read_only(model):
        for batch in batches:
            args, kwargs, y = workload.inputs(batch, tables, device)
            outputs.append(tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), model(*args, **kwargs)))
            labels.append(y.cpu())
    model.train()
    return workload.quality(outputs, labels)


def eval_step(config: JobConfig, shard_rows: int) -> int:
    """The step after which a phase's held-out AUC / log loss are measured.

    ``ceil([job] eval_epochs * shard_rows / batch_size)``: the model after that many passes over a
    trainer's shard (``shard_rows``: the largest shard), capped at ``[job] steps``; ``eval_epochs = 0``
    means the end of the phase, and so does ``shard_rows = 0`` (a stream, ``[data] follow``: no epochs).
    """
    epochs, steps = config.job.eval_epochs, config.job.steps
    if epochs <= 0 or shard_rows <= 0:
        return steps
    return max(1, min(steps, math.ceil(epochs * shard_rows / config.job.batch_size)))


def evaluate_mid_phase(t: TrainPipeline, step: int, snapshot: bool) -> EarlyEval:
    """All ranks: held-out quality of ``model`` now (rank 0), and with ``snapshot`` a copy of its dense
    weights and tables (the model the job quantizes). Between two barriers, so no trainer's timed step
    waits for rank 0's evaluation.

    The snapshot's tables on parameter servers are written by shard (:func:`snapshot_tables`): ``out["tables"]`` is
    then ``{"dcp": "tables/eval-<step>-<id>/<phase>"}`` (relative to the run folder), which the launcher reads whole
    (:func:`jobs.launcher.model_export.with_tables`); tables in the trainers are copied whole.
    """
    tables = t.tables
    tables.sync()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank's updates for `step` are on the servers
    out: EarlyEval = {}
    if t.workload.has_eval:
        written = snapshot_tables(t, step) if snapshot else None
        out = {"step": step, "quality": evaluate(t.evaluated, t.workload, tables)}
        if snapshot:
            out["model"] = {k: v.detach().clone() for k, v in t.dense_state().items()}
            out["tables"] = written.finish() if written is not None else tables.state_dict()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return out


class _Snapshot:
    """A snapshot of one phase's tables the servers are writing by shard (:func:`snapshot_tables`)."""

    def __init__(self, tables: Any, run_dir: Path, rel: str) -> None:
        self.tables, self.run_dir, self.rel = tables, run_dir, rel
        tables.start_checkpoint(run_dir / rel)

    def finish(self) -> dict[str, Any]:
        """Wait for the servers' writes, merge their metadata; the reference ``{"dcp": folder}`` (relative)."""
        self.tables.finish_checkpoint(self.run_dir / self.rel, True)
        return {"dcp": self.rel}


def snapshot_tables(t: TrainPipeline, step: int) -> _Snapshot | None:
    """Rank 0, tables on parameter servers of a job with a run folder: the servers copy the phase's tables and write
    them by shard into ``RUN_DIR/tables/eval-<step>-<id>/<phase>/`` in the background
    (:mod:`scheduling.placement.sharded`, as a checkpoint's); ``.finish()`` waits for the writes and gives the
    record's reference. None otherwise (other ranks; tables in the trainers: the caller copies them whole).

    Raises:
        scheduling.ps.PSUnavailableError: a server did not answer.
    """
    from jobs.trainer.checkpoints import TABLES_DIR, _by_shard

    run_dir = _by_shard({t.phase: t})
    if run_dir is None or getattr(t.tables, "rank", 0) != 0:
        return None
    return _Snapshot(t.tables, Path(run_dir), f"{TABLES_DIR}/eval-{step:08d}-{uuid.uuid4().hex[:8]}/{t.phase}")
