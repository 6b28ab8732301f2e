"""What a trainer trains: the built-in DLRM on Criteo, or your model on your batches (:mod:`jobs.entry`).

A *workload* gives the training loop (:mod:`jobs.worker`) everything that depends on the model and the data:

- ``rows``: this trainer's training rows per epoch (for ``[job] eval_epochs``), ``parse``: the reader's
  statistics or None, ``has_eval``: this rank evaluates (rank 0, with held-out data);
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
from jobs.data import Batch, CriteoShard
from jobs.model import DLRM, LocalEmbeddings
from jobs.stats import binary_metrics

__all__ = ["build_model", "CriteoWorkload", "UserWorkload", "make_workload"]


def build_model(config: JobConfig, sparse_arch: nn.Module | None = None) -> DLRM:
    """The job's DLRM, initialised from ``[job] seed`` (same weights in every phase and rank)."""
    m = config.model
    torch.manual_seed(config.job.seed)
    if sparse_arch is None:
        sparse_arch = LocalEmbeddings(26, m.table_size, m.embedding_dim)
    return DLRM(sparse_arch, dim=m.embedding_dim, bottom=m.bottom_mlp, top=m.top_mlp)


class CriteoWorkload:
    """The built-in DLRM on a :class:`jobs.data.CriteoShard` (``eval_shard``: the held-out rows, or None)."""

    quantizable = True

    def __init__(self, config: JobConfig, shard: CriteoShard, eval_shard: CriteoShard | None = None) -> None:
        self.config, self.shard, self.eval_shard = config, shard, eval_shard
        self.has_eval = eval_shard is not None
        self.rows = len(shard)
        self.parse = shard.stats.as_dict()
        self._loss = nn.BCEWithLogitsLoss()

    def build(self, view: Any) -> nn.Module:
        return build_model(self.config, view.sparse_arch())

    def warm_up(self, tables: Any) -> None:
        tables.prepare(self.shard.sparse[:2])  # the first use imports torchrec, outside the timed phases

    def train_batches(self, start: int = 0) -> Iterator[Batch]:
        return self.shard.batches(self.config.job.batch_size, start=start)

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


def make_workload(config: JobConfig, rank: int, world: int, data_path: str) -> CriteoWorkload | UserWorkload:
    """This trainer's workload: :class:`UserWorkload` with ``[model] factory``, else the DLRM on the Criteo
    file ``data_path`` (rank 0 also reads the held-out rows when ``[data] eval_fraction > 0``).

    Raises:
        jobs.data.DataError: the Criteo file cannot be used; ConfigError: see :class:`UserWorkload`.
    """
    if config.user_model:
        return UserWorkload(config, rank, world)
    fraction = config.data.eval_fraction
    shard = CriteoShard(data_path, config.model.table_size, rank=rank, world_size=world, eval_fraction=fraction)
    eval_shard = None
    if rank == 0 and fraction > 0:
        eval_shard = CriteoShard(data_path, config.model.table_size, eval_fraction=fraction, split="eval")
    return CriteoWorkload(config, shard, eval_shard)
