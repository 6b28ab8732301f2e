"""The trainers' part in writing the model's deltas (``[export] every_steps``, read with :mod:`jobs.deltas`).

Every ``N`` steps of the optimized phase (the phase whose model ``RUN_DIR/model/`` holds, the last one), after
step ``k``'s updates, :class:`DeltaWriter` writes ``RUN_DIR/model/deltas/<k>/``: the rows the parameter servers
changed since the previous delta (only those rows leave the servers, :mod:`scheduling.ps.changes`), the dynamic
tables' new and evicted ids, and the dense weights. Every trainer waits for its pushes and meets the others at a
barrier (all pushes of step ``k`` are then applied); rank 0 takes the changes (copies of the rows) and a copy of
the dense weights; a second barrier holds the others until it has, so no push of step ``k + 1`` reaches the servers
before the changes are taken. The delta is then written on a background thread of rank 0
(:class:`jobs.deltas.DeltaQueue`, in step order) while training goes on; :meth:`DeltaWriter.close` waits for it. With tables in the trainers (no parameter servers) the delta carries them whole among the dense weights.

The chain starts with a full delta (the whole model) where the run starts: step 0, or the step a run resumes at when
no delta at or after it is committed (e.g. ``every_steps`` set on resume). Its tables, when on parameter servers,
never pass through a trainer: the servers copy their rows and write them by shard (:mod:`scheduling.placement.sharded`)
into a hidden folder of ``deltas/`` while training goes on; rank 0 hands the delta over once their writes finished
(asked after each step, waited for at the next delta or :meth:`DeltaWriter.close`), and the queue moves the folder
into the delta's before committing it (:func:`jobs.deltas.write_delta`). Tables in the trainers go whole
(:func:`full_delta`). Exactly once: a delta
of a step at or before the newest committed one is not written again, and its changes are not taken, so after a
restart from the checkpoint of step ``c`` (tracking starts again at ``c``) the next delta written covers every row
changed since ``c`` (a superset of those since the last committed delta: rows are set, never added). The prefetching optimized model does not look a step's next batch up before a delta of dynamic
tables (:meth:`jobs.trainer.pipeline.TrainPipeline._lookahead`): that lookup would admit its ids into the delta.

Source: Liu et al. 2022, "Monolith: Real Time Recommendation System With Collisionless Embedding Table" §2.3
(the training job syncs the parameters it changed to serving every few minutes, the dense ones whole).
"""

from __future__ import annotations

import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from jobs.deltas import DELTAS_DIR, Delta, DeltaQueue, DynamicDelta, TableDelta, delta_path, whole_tables

__all__ = ["DeltaWriter", "delta_of", "full_delta"]


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def delta_of(step: int, dense: dict[str, torch.Tensor], changes: dict[str, dict[str, torch.Tensor]]) -> Delta:
    """A :class:`jobs.deltas.Delta` from the dense weights and the tables' changes under the model's state-dict names
    (:func:`scheduling.placement.restore.table_changes`: ``"<path>.weight"`` rows and values, ``"<path>.dynamic"``
    id map changes); the dense tensors are detached copies (the module trains on)."""
    tables = {k: TableDelta(v["rows"], v["values"]) for k, v in changes.items() if k.endswith(".weight")}
    dynamic = {k.removesuffix(".dynamic"): DynamicDelta(v["ids"], v["slots"], v["evicted"])
               for k, v in changes.items() if k.endswith(".dynamic")}
    return Delta(step, {k: v.detach().clone() for k, v in dense.items()}, tables, dynamic)


def full_delta(step: int, dense: dict[str, torch.Tensor], tables: dict[str, Any]) -> Delta:
    """The whole model of ``step`` as a full :class:`jobs.deltas.Delta`: the dense weights and every row of the tables of
    a :func:`scheduling.placement.restore.table_checkpoint` (``"<path>.weight"`` whole; a dynamic table's
    ``"<path>.dynamic"`` state gives its whole id map; optimizer state left out; :func:`jobs.deltas.whole_tables`)."""
    weights, dynamic = whole_tables(tables)
    return Delta(step, {k: v.detach().clone() for k, v in dense.items()}, weights, dynamic, full=True)


_SHARDS_PREFIX = ".tables-"
"""Hidden folders of ``deltas/`` (not a step's) the servers write a full delta's tables into before it is committed."""


@dataclass
class _Full:
    """A full delta (dense weights; no tables) whose tables the servers write by shard into ``folder``."""

    delta: Delta
    folder: Path
    rows: int


class DeltaWriter:
    """Writes the deltas of one phase's model (``trainer``, a :class:`jobs.trainer.pipeline.TrainPipeline`) every
    ``every`` steps into ``model_dir/deltas/`` (rank 0 writes; every rank calls).

    Args:
        model_dir: ``RUN_DIR/model``.
        state: the launcher's JobState actor (an event per delta written), or None.
        exporter: rank 0's metrics exporter (``fxdist_export_deltas_total``), or None.
    """

    def __init__(self, trainer: Any, every: int, rank: int, model_dir: Path, state: Any = None,
                 exporter: Any = None) -> None:
        self.trainer, self.every, self.rank, self.model_dir = trainer, every, rank, Path(model_dir)
        self.state, self.exporter = state, exporter
        self.written: list[int] = []
        """The steps of the deltas this writer handed over to be committed."""
        self.queue: DeltaQueue | None = None
        """Rank 0's writer thread (:meth:`start` makes it)."""
        self.skipped: list[int] = []
        """The steps it did not write: committed before (a restarted run)."""
        self.pending: _Full | None = None
        """Rank 0's full delta whose tables the servers are still writing by shard."""

    def start(self) -> Path | None:
        """Start the servers' records (after the tables were restored, before the first step of this run); rank 0
        writes a full delta of the model as it is now when no delta at or after this step is committed (a new run's
        step 0, or a run resumed past its newest delta), so the chain of deltas has no gap. Returns its folder."""
        self.trainer.tables.sync()
        _barrier()
        path = None
        try:
            if self.rank == 0:
                track = getattr(self.trainer.tables, "track_changes", None)
                if track is not None:
                    track()
                self.queue = DeltaQueue(self.model_dir)
                step, newest = self.trainer.step, self.queue.newest
                if newest is None or newest < step:
                    path = self._start_full(step)
        finally:
            _barrier()   # no push before the records started and the full delta was read
        return path

    def _start_full(self, step: int) -> Path | None:
        """Rank 0: the full delta of ``step``. Tables on parameter servers of a job with a run folder: the servers copy
        their rows and write them by shard into a hidden folder of ``deltas/`` (:mod:`scheduling.placement.sharded`);
        the delta is handed over to be committed once they finished (:meth:`_finish_full`), no table passes through
        this trainer. Otherwise (tables in the trainers) the tables whole. Its folder (once committed)."""
        from jobs.trainer.checkpoints import _by_shard

        tables: Any = self.trainer.tables
        if _by_shard({self.trainer.phase: self.trainer}) is None:
            return self._commit(full_delta(step, self.trainer.dense_state(), tables.state_dict()))
        root = self.model_dir / DELTAS_DIR
        for stale in root.glob(f"{_SHARDS_PREFIX}*"):   # a crashed attempt's
            shutil.rmtree(stale, ignore_errors=True)
        folder = root / f"{_SHARDS_PREFIX}{step:010d}-{uuid.uuid4().hex[:8]}"
        copied = tables.start_checkpoint(folder)
        dense = {k: v.detach().clone() for k, v in self.trainer.dense_state().items()}
        self.pending = _Full(Delta(step, dense, {}, {}, full=True), folder, int(copied["rows"]))
        self._finish_full(wait=False)
        return delta_path(self.model_dir, step)

    def _finish_full(self, wait: bool) -> bool:
        """Rank 0: hand the pending full delta over once the servers' writes finished (``wait``: until then; their
        metadata merged, :func:`scheduling.placement.sharded.finish_checkpoint`). Whether none is pending now.

        Raises:
            Exception: a server's write failed (its error).
        """
        full = self.pending
        if full is None:
            return True
        tables: Any = self.trainer.tables
        if tables.finish_checkpoint(full.folder, wait) is None:
            return False
        self.pending = None
        self._commit(full.delta, shards=full.folder, rows=full.rows)
        return True

    def after_step(self, step: int) -> Path | None:
        """After step ``step``'s updates: the delta when ``step`` is a multiple of ``every`` (its folder on rank 0,
        None elsewhere or when not written). Rank 0 first hands over a full delta whose tables are written now."""
        if self.rank == 0 and self.pending is not None and step % self.every:
            self._finish_full(wait=False)   # rank 0 alone asks the servers, no barrier
        if step % self.every:
            return None
        self.trainer.tables.sync()
        _barrier()   # every trainer's pushes of `step` are on the servers
        try:
            return self.write(step) if self.rank == 0 else None
        finally:
            _barrier()   # no push of the next step before rank 0 took the changes

    def write(self, step: int) -> Path | None:
        """Rank 0: take the changes and hand the delta of ``step`` over to be committed; its folder (None: a delta of
        this step or a later one is committed already; the changes are then left to accumulate).

        Raises:
            OSError: an earlier delta could not be written (:class:`jobs.deltas.DeltaQueue`).
        """
        assert self.queue is not None, "DeltaWriter.start() first"
        self._finish_full(wait=True)   # the chain in order: the full delta before this one
        if self.queue.newest is not None and step <= self.queue.newest:
            self.skipped.append(step)
            return None
        take = getattr(self.trainer.tables, "take_changes", None)
        return self._commit(delta_of(step, self.trainer.dense_state(), take() if take is not None else {}))

    def _commit(self, delta: Delta, shards: Path | None = None, rows: int | None = None) -> Path | None:
        step, queue = delta.step, self.queue
        assert queue is not None
        rows = delta.num_rows if rows is None else rows
        if not queue.put(delta, extra={"phase": self.trainer.phase, "taken_at": round(time.time(), 3)}, shards=shards):
            self.skipped.append(step)
            if shards is not None:
                shutil.rmtree(shards, ignore_errors=True)
            return None
        self.written.append(step)
        if self.exporter is not None:
            self.exporter.observe_delta(self.trainer.phase, rows)
        if self.state is not None:
            self.state.event.remote(f"delta {self.trainer.phase} step {step}: {rows} rows"
                                    f"{' (full)' if delta.full else ''}")
        return delta_path(self.model_dir, step)

    def close(self) -> None:
        """Wait until every delta handed over is committed (rank 0; nothing elsewhere).

        Raises:
            OSError: a delta could not be written.
        """
        if self.queue is not None:
            self._finish_full(wait=True)
            self.queue.close()
