"""Ray Train checkpoints of every phase at one step (:func:`save_checkpoint`, :func:`load_checkpoint`): dense
weights, server tables and optimizer state per phase, so a restarted worker group resumes both phases at the same
step; :func:`digest` checks that a restore is exact.

Source: Ray Train user guide (``ray.train.report(metrics, checkpoint=...)``, ``ray.train.get_checkpoint()``).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from jobs.records import Checkpoint, EarlyEval
from scheduling.ps.safe_load import safe_load

if TYPE_CHECKING:
    from jobs.trainer.pipeline import TrainPipeline


def digest(state: dict[str, Any]) -> str:
    """SHA-1 of a state dict's tensors (names, shapes, bytes), also those in nested dicts and lists (dynamic tables'
    server state: rows, optimizer state, id maps), to check that a restore is exact."""
    h = hashlib.sha1()
    _update(h, "", state)
    return h.hexdigest()


def _update(h: Any, prefix: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        h.update(f"{prefix}:{tuple(value.shape)}:{value.dtype}".encode())
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            _update(h, f"{prefix}.{key}" if prefix else str(key), value[key])
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _update(h, f"{prefix}[{i}]", item)


def save_checkpoint(step: int, trainers: dict[str, TrainPipeline], early: dict[str, EarlyEval], rank: int,
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
            saved: Checkpoint = {"step": step, "final": final, "models": {}, "tables": {}, "optim": {},
                                 "eval": {p: e.copy() for p, e in early.items()}}
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


def load_checkpoint() -> dict | None:
    """The checkpoint Ray Train restores this worker group from (``fxdist launch --resume DIR``, or a restart after a
    failure), or None: read with :func:`scheduling.ps.safe_load.safe_load` (``weights_only=True``).

    Raises:
        scheduling.ps.safe_load.CheckpointRefused: ``state.pt`` holds a type other than those a job's checkpoint
            holds (the file is not loaded; the job stops without a retry, :func:`jobs.trainer.loop.train_loop`).
    """
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as d:
        return safe_load(os.path.join(d, "state.pt"), map_location="cpu")

