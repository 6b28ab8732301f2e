"""Ray Train checkpoints of every phase at one step (:func:`save_checkpoint`, :func:`load_checkpoint`): dense
weights, server tables and optimizer state per phase, so a restarted worker group resumes both phases at the same
step; :func:`digest` checks that a restore is exact.

Tables on parameter servers are checkpointed by shard (:mod:`scheduling.placement.sharded`): at a checkpoint every
server copies its rows and answers (training is blocked only that long), then writes them with
``torch.distributed.checkpoint`` into ``RUN_DIR/tables/step-<k>-<id>/<phase>/`` in the background; ``state.pt``
holds the dense weights, optimizer state and early-eval record, and per phase ``{"dcp": "<that folder, relative to
the run folder>"}``. The checkpoint is reported to Ray Train only once every server's write finished and the
metadata is merged (:func:`finish_pending`: at the first step after it where the writes are done, before a fault
the config injects, at the next checkpoint or at the end): a crash before that resumes from the previous one. The
newest :data:`KEEP_TABLES` table folders are kept, and besides them the folder of the evaluated model's snapshot
that the checkpoint's early-eval record names (``RUN_DIR/tables/eval-<step>-<id>/<phase>/``, written by shard as
well: :func:`jobs.trainer.evaluation.snapshot_tables`). Tables in the trainers (no servers) stay whole in ``state.pt``,
and so do the tables of a checkpoint written before (restored through the old gather-and-scatter path).

Source: Ray Train user guide (``ray.train.report(metrics, checkpoint=...)``, ``ray.train.get_checkpoint()``);
``torch.distributed.checkpoint.async_save`` (a blocking copy, a background write).
"""

from __future__ import annotations

import copy
import hashlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
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


TABLES_DIR = "tables"
"""The run folder's sub-folder of the table checkpoints by shard."""
KEEP_TABLES = 3
"""Table checkpoint folders kept (the newest finished ones; Ray Train keeps the 2 newest ``state.pt``)."""


@dataclass
class _Pending:
    """A checkpoint whose tables the servers are still writing (rank 0 holds ``saved``; others only the step)."""

    step: int
    final: bool
    saved: Checkpoint | None = None
    folders: dict[str, Path] = field(default_factory=dict)
    run_dir: Path | None = None
    copy_s: float = 0.0
    started: float = 0.0


_PENDING: list[_Pending] = []
"""This process's checkpoint not yet reported (at most one)."""


def _by_shard(trainers: dict[str, TrainPipeline]) -> Path | None:
    """The run folder when every phase's tables are on parameter servers and checkpointed by shard, else None."""
    dirs = {getattr(t.tables, "run_dir", None) for t in trainers.values()}
    moved = all(getattr(t.tables, "moved", None) for t in trainers.values())
    return next(iter(dirs)) if len(dirs) == 1 and None not in dirs and moved else None


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_checkpoint(step: int, trainers: dict[str, TrainPipeline], early: dict[str, EarlyEval], rank: int,
                    final: bool, state: Any = None) -> None:
    """Checkpoint every phase at ``step`` (every rank calls it; rank 0 writes).

    Per phase: dense weights, server tables, optimizer state, and ``early``: the phase's mid-phase
    evaluation so far (``step``, ``quality``, and in the last phase the evaluated model's ``model`` /
    ``tables``), so it survives a restart. A checkpoint still pending is reported first. Tables on servers are
    written by shard (see the module docstring): this returns once the servers copied their rows, and the
    checkpoint is reported later (:func:`finish_pending`), at once when ``final``.
    """
    for t in trainers.values():
        t.tables.sync()
    _barrier()  # every rank has pushed its updates for `step` to the servers
    finish_pending(trainers, rank, state, wait=True)
    run_dir = _by_shard(trainers)
    if run_dir is None:
        _save_whole(step, trainers, early, rank, final, state)
        return
    pending = _Pending(step, final, run_dir=run_dir, started=time.perf_counter())
    if rank == 0:
        rel = f"{TABLES_DIR}/step-{step:08d}-{uuid.uuid4().hex[:8]}"
        pending.saved = {"step": step, "final": final, "models": {}, "tables": {}, "optim": {},
                         "eval": copy.deepcopy({p: e.copy() for p, e in early.items()})}
        for phase, t in trainers.items():
            pending.folders[phase] = run_dir / rel / phase
            by_shard: Any = t.tables   # servers' tables (jobs.trainer.servers._PhaseTables)
            copied = by_shard.start_checkpoint(pending.folders[phase])
            pending.copy_s += copied["copy_s"]
            pending.saved["models"][phase] = {k: v.detach().clone() for k, v in t.dense_state().items()}
            pending.saved["tables"][phase] = {"dcp": f"{rel}/{phase}"}
            pending.saved["optim"][phase] = copy.deepcopy(t.optimizer.state_dict())
    _PENDING[:] = [pending]
    _barrier()  # the servers copied their rows before any rank pushes the next step's updates
    if final:
        finish_pending(trainers, rank, state, wait=True)


def finish_pending(trainers: dict[str, TrainPipeline], rank: int, state: Any = None, wait: bool = False) -> bool:
    """Report the pending checkpoint to Ray Train once every server's write finished (rank 0 asks them; ``wait``:
    until then, else not if a write still runs) and its metadata is merged; every rank calls it at the same point.
    Returns whether nothing is pending now."""
    if not _PENDING:
        return True
    pending = _PENDING[0]
    digests: dict[str, str] = {}
    if rank == 0:
        for phase, t in trainers.items():
            by_shard: Any = t.tables
            d = by_shard.finish_checkpoint(pending.folders[phase], wait)
            if d is None:
                break
            digests[phase] = d
    done = len(digests) == len(trainers) if rank == 0 else False
    if dist.is_available() and dist.is_initialized():
        flag = torch.tensor([int(done)])
        dist.broadcast(flag, 0)
        done = bool(flag.item())
    if not done:
        return False
    _PENDING.clear()
    if rank == 0 and state is not None and pending.saved is not None:
        for phase, d in digests.items():
            state.checkpointed.remote(phase, pending.step, digest(pending.saved["models"][phase]), d)
        state.event.remote(f"checkpoint step {pending.step}: servers copied the tables in {pending.copy_s:.3f} s "
                           f"(training blocked), written by {time.perf_counter() - pending.started:.3f} s")
    _report(pending.step, pending.final, pending.saved if rank == 0 else None)
    if rank == 0 and pending.run_dir is not None:
        _prune(pending.run_dir / TABLES_DIR, referenced(pending.saved))
    return True


def _report(step: int, final: bool, saved: Checkpoint | None) -> None:
    """``ray.train.report`` of ``state.pt`` holding ``saved`` (rank 0) or of no checkpoint (the other ranks)."""
    import ray.train

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if saved is not None:
            torch.save(saved, os.path.join(tmp, "state.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report({"step": step, "final": final}, checkpoint=checkpoint)
    _barrier()  # the other ranks wait here, not in their next block (its time would include rank 0's save)


def referenced(saved: Checkpoint | None) -> set[str]:
    """The table folders (names under ``RUN_DIR/tables``) that ``saved``'s early-eval records refer to: the
    snapshot of the evaluated model (:func:`jobs.trainer.evaluation.snapshot_tables`), ``{"dcp": "tables/<name>/<phase>"}``."""
    out: set[str] = set()
    for early in ((saved or {}).get("eval") or {}).values():
        ref = early.get("tables") if isinstance(early, dict) else None
        if isinstance(ref, dict) and isinstance(ref.get("dcp"), str):
            parts = Path(ref["dcp"]).parts
            if len(parts) > 1 and parts[0] == TABLES_DIR:
                out.add(parts[1])
    return out


def _prune(root: Path, keep_names: Collection[str] = ()) -> None:
    """Remove the finished table folders under ``root`` but the newest :data:`KEEP_TABLES` (by their merged
    metadata's time) and those named in ``keep_names`` (the newest checkpoint's early-eval snapshot, kept besides),
    and the unfinished ones older than the newest (a crashed attempt's)."""
    folders = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    done = {p: max(m.stat().st_mtime for m in p.glob("*/.metadata")) for p in folders if any(p.glob("*/.metadata"))}
    ranked = [p for p in done if p.name not in keep_names]
    keep = set(sorted(ranked, key=done.__getitem__, reverse=True)[:KEEP_TABLES])
    newest = max(done.values(), default=0.0)
    for p in folders:
        if p not in keep and p.name not in keep_names and (p in done or p.stat().st_mtime < newest):
            shutil.rmtree(p, ignore_errors=True)


def _save_whole(step: int, trainers: dict[str, TrainPipeline], early: dict[str, EarlyEval], rank: int,
                final: bool, state: Any = None) -> None:
    """The checkpoint with every table whole in ``state.pt`` (tables in the trainers), reported at once."""
    saved: Checkpoint | None = None
    if rank == 0:
        saved = {"step": step, "final": final, "models": {}, "tables": {}, "optim": {},
                 "eval": {p: e.copy() for p, e in early.items()}}
        for phase, t in trainers.items():
            dense, tables = t.dense_state(), t.tables.state_dict()
            saved["models"][phase], saved["tables"][phase] = dense, tables
            saved["optim"][phase] = t.optimizer.state_dict()
            if state is not None:
                state.checkpointed.remote(phase, step, digest(dense), digest(tables))
    _report(step, final, saved)


def poll_pending(config: Any, trainers: dict[str, TrainPipeline], phase: str, step: int, rank: int,
                 state: Any = None) -> None:
    """After each step (every rank at the same one): report the pending checkpoint if its writes finished; wait for
    them when the config injects a fault at this step of the optimized phase (a fault is timed after the last
    checkpoint, which must then be reported)."""
    if _PENDING:
        f = config.faults
        due = phase == "optimized" and step in (f.kill_trainer_at_step, f.kill_server_at_step, f.pause_at_step)
        finish_pending(trainers, rank, state, wait=due)


def restore_tables(view: Any, saved: Any, rank: int) -> str | None:
    """Load one phase's checkpointed tables ``saved`` (``state.pt``'s ``tables[phase]``) into ``view``'s servers:
    by shard from the run folder (``{"dcp": folder}``; :meth:`jobs.trainer.servers._PhaseTables.load_sharded`), or
    whole tables of an older checkpoint (``view.load_state_dict``). Returns the tables' digest on rank 0.

    Raises:
        RuntimeError: a checkpoint by shard, and these tables cannot load one (no run folder: tables in the
            trainers, or servers in the trainers on sockets); the message names the folder.
    """
    if isinstance(saved, dict) and isinstance(saved.get("dcp"), str):
        run_dir = getattr(view, "run_dir", None)
        if run_dir is None or not hasattr(view, "load_sharded"):
            raise RuntimeError(f"the checkpoint holds its tables by shard in RUN_DIR/{saved['dcp']}, which these tables "
                               "cannot load (they are not on parameter servers of a job with a run folder)")
        return view.load_sharded(Path(run_dir) / saved["dcp"])
    view.load_state_dict(saved)
    return digest(view.state_dict()) if rank == 0 else None


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

