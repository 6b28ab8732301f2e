"""What a trainer trains: the built-in DLRM on Criteo, or your model on your batches (:mod:`jobs.entry`).

A *workload* gives the training loop (:mod:`jobs.worker`) everything that depends on the model and the data:

- ``rows``: this trainer's training rows per epoch (for ``[job] eval_epochs``), ``parse``: the reader's
  statistics or None, ``has_eval``: this rank evaluates (rank 0, with held-out data);
- ``reader_stats()``: the parse throughput of the trainer's reader (lines/s) or None; ``close()``: stop it;
- ``build(view)``: the phase's model, from ``[job] seed`` (``view``: the phase's tables backend);
- ``train_batches(start)``: endless batches from batch ``start`` on; ``eval_batches()``: the held-out ones
  (rank 0; None elsewhere);
- ``inputs(batch, tables, device)``: ``(args, kwargs, labels)`` of the model's call;
- ``loss(output, labels)`` and ``quality(outputs, labels)``: the training loss and the held-out metrics;
- ``quantizable``: the evaluated model is snapshotted for the launcher's fp32-vs-int8 comparison.

Source: torchrec's train pipelines (a model, a batch iterator and a loss, kept apart from the loop).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from jobs import entry
from jobs.config import JobConfig
from jobs.criteo_stream import CriteoStream, DataPlan, SharedBatches, scan
from jobs.data import NUM_SPARSE, Batch, CriteoShard, DataError
from jobs.model import DLRM, LocalEmbeddings
from jobs.stats import binary_metrics

__all__ = ["build_model", "CriteoWorkload", "UserWorkload", "make_workload"]


def build_model(config: JobConfig, sparse_arch: nn.Module | None = None) -> DLRM:
    """The job's DLRM, initialised from ``[job] seed`` (same weights in every phase and rank)."""
    m = config.model
    torch.manual_seed(config.job.seed)
    if sparse_arch is None:
        sparse_arch = LocalEmbeddings(26, config.table_sizes, m.embedding_dim)
    return DLRM(sparse_arch, dim=m.embedding_dim, bottom=m.bottom_mlp, top=m.top_mlp)


class CriteoWorkload:
    """The built-in DLRM on Criteo rows: ``shard``, a :class:`jobs.data.CriteoShard` (in memory) or a
    :class:`jobs.criteo_stream.CriteoStream` (streamed; its batches are shared by the ``readers`` phases,
    :class:`jobs.criteo_stream.SharedBatches`); ``eval_shard``: the held-out rows, or None; ``parse``: the
    parse statistics to report (default: the shard's)."""

    quantizable = True

    def __init__(self, config: JobConfig, shard: Any, eval_shard: CriteoShard | None = None, *,
                 parse: dict[str, Any] | None = None, readers: int = 1) -> None:
        self.config, self.shard, self.eval_shard = config, shard, eval_shard
        self.has_eval = eval_shard is not None
        self.rows = len(shard)
        self.parse = parse if parse is not None else shard.stats.as_dict()
        self.readers = readers
        self._shared: SharedBatches | None = None
        self._loss = nn.BCEWithLogitsLoss()

    def build(self, view: Any) -> nn.Module:
        return build_model(self.config, view.sparse_arch())

    def warm_up(self, tables: Any) -> None:
        """The first use imports torchrec, outside the timed phases."""
        tables.prepare(torch.zeros(2, NUM_SPARSE, dtype=torch.int64))

    def train_batches(self, start: int = 0) -> Iterator[Batch]:
        """Endless batches from batch ``start``; a stream's are read once and shared by the ``readers`` phases
        (a further call makes a new stream)."""
        if not isinstance(self.shard, CriteoStream):
            return self.shard.batches(self.config.job.batch_size, start=start)
        shared = self._shared
        if shared is None or shared.made >= shared.readers or shared.start != start:
            shared = self._shared = SharedBatches(self.shard.batches(self.config.job.batch_size, start=start),
                                                  self.readers, start)
        return shared.reader()

    def reader_stats(self) -> dict[str, Any] | None:
        """The stream's parse throughput (:meth:`jobs.criteo_stream.CriteoStream.stats`), or None."""
        return self.shard.stats() if isinstance(self.shard, CriteoStream) else None

    def close(self) -> None:
        """Stop the stream's worker processes."""
        if isinstance(self.shard, CriteoStream):
            self.shard.close()

    def eval_batches(self) -> Iterable[Batch] | None:
        return None if self.eval_shard is None else self.eval_shard.all_batches(512)

    def inputs(self, batch: Batch, tables: Any, device: torch.device) -> tuple[tuple, dict[str, Any], torch.Tensor]:
        """``((dense, sparse), {}, labels)``; a KeyedJaggedTensor stays on the CPU (servers)."""
        sparse = tables.prepare(batch.sparse)
        if isinstance(sparse, torch.Tensor):
            sparse = sparse.to(device)
        return (batch.dense.to(device), sparse), {}, batch.labels.to(device)

    def loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._loss(output, labels)

    def quality(self, outputs: list[torch.Tensor], labels: list[torch.Tensor]) -> dict[str, float]:
        return binary_metrics(torch.sigmoid(torch.cat(outputs)), torch.cat(labels))


class UserWorkload:
    """Your model (``[model] factory``) on your batches (``[data] batches``) with ``[train] loss``.

    Args:
        rank, world_size: this trainer; rank 0 also reads the "eval" split.

    Raises:
        ConfigError: an entry point that does not resolve, or an epoch without a batch.
    """

    quantizable = True
    parse = None

    def __init__(self, config: JobConfig, rank: int, world_size: int) -> None:
        self.config = config
        self._train = entry.data_context(config, "train", rank, world_size)
        self._eval = entry.data_context(config, "eval") if rank == 0 else None
        self.has_eval = self._eval is not None
        self._loss = entry.loss_fn(config)
        epoch = entry.epoch_batches(config, self._train)
        if not epoch:
            raise entry.ConfigError(f"{config.source}: [data] batches = {config.data.batches!r} gave no train "
                                    f"batch for rank {rank} of {world_size}")
        self.rows = sum(entry.split_batch(b)[2].shape[0] for b in epoch)

    def build(self, view: Any) -> nn.Module:
        return entry.make_model(self.config)

    def warm_up(self, tables: Any) -> None:
        """Nothing to warm up."""

    def train_batches(self, start: int = 0) -> Iterator[Any]:
        return entry.endless(self.config, self._train, start)

    def eval_batches(self) -> Iterable[Any] | None:
        return None if self._eval is None else entry.epoch_batches(self.config, self._eval)

    def inputs(self, batch: Any, tables: Any, device: torch.device) -> tuple[tuple, dict[str, Any], torch.Tensor]:
        """The batch's ``(args, kwargs, labels)`` (:func:`jobs.entry.split_batch`), tensors on ``device``."""
        args, kwargs, labels = entry.split_batch(batch, f"[data] batches = {self.config.data.batches!r}")
        move = (lambda v: v.to(device) if isinstance(v, torch.Tensor) else v)  # noqa: E731
        return tuple(map(move, args)), {k: move(v) for k, v in kwargs.items()}, labels.to(device)

    def loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._loss(output, labels)

    def quality(self, outputs: list[torch.Tensor], labels: list[torch.Tensor]) -> dict[str, float]:
        return entry.quality(self.config, outputs, labels)


def make_workload(config: JobConfig, rank: int, world: int, data_path: str, *, plan: DataPlan | None = None,
                  exporter: Any = None) -> CriteoWorkload | UserWorkload:
    """This trainer's workload: :class:`UserWorkload` with ``[model] factory``, else the DLRM on the Criteo data
    ``data_path`` (a file, directory or glob), streamed (:class:`jobs.criteo_stream.CriteoStream`, ``[data]
    reader_workers`` processes); rank 0 also reads the held-out rows (at most ``[data] eval_max_rows``) when
    ``[data] eval_fraction > 0``.

    Args:
        plan: The launcher's first pass (:func:`jobs.criteo_stream.scan`); None: this trainer scans the data.
        exporter: The trainer's :class:`jobs.metrics.Exporter` (its reader gauge), or None.

    Raises:
        jobs.data.DataError: the Criteo data cannot be used, or this trainer's share has no valid line;
            ConfigError: see :class:`UserWorkload`.
    """
    if config.user_model:
        return UserWorkload(config, rank, world)
    d = config.data
    if plan is None:
        plan = scan(data_path, world, d.eval_fraction)
    if plan.rows[rank] == 0:
        stats = plan.stats
        raise DataError(f"CriteoShard: {data_path} has no valid train line for rank {rank} of {world} "
                        f"({stats['valid']} valid, {sum(stats['malformed'].values())} malformed)")
    on_chunk = None if exporter is None else (lambda s: exporter.observe_reader(s["lines_per_s"]))
    stream = CriteoStream(plan.files, config.table_sizes, rank=rank, world_size=world, every=plan.every,
                          workers=d.reader_workers, rows_per_epoch=plan.rows[rank], on_chunk=on_chunk)
    eval_shard = None
    if rank == 0 and d.eval_fraction > 0:
        eval_shard = CriteoShard(data_path, config.table_sizes, eval_fraction=d.eval_fraction, split="eval",
                                 max_rows=d.eval_max_rows, count_all=False)
    readers = 2 if config.phases.baseline else 1
    return CriteoWorkload(config, stream, eval_shard, parse=plan.stats, readers=readers)
