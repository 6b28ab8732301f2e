"""What a trainer trains (the built-in torchrec DLRM on Criteo, or your model on your batches), and where its
embedding tables live.

A *workload* (the :class:`jobs.trainer.protocols.Workload` protocol) gives the training loop (:mod:`jobs.trainer.loop`)
everything that depends on the model and the data:

- ``rows``: this trainer's training rows per epoch (for ``[job] eval_epochs``), ``parse``: the reader's
  statistics or None, ``has_eval``: this rank evaluates (rank 0, with held-out data);
- ``reader_stats()``: the parse throughput of the trainer's reader (lines/s) or None; ``close()``: stop it;
- ``build(view)``: the phase's model, from ``[job] seed`` (``view``: the phase's tables backend);
- ``train_batches(start)``: endless batches from batch ``start`` on; ``eval_batches()``: the held-out ones
  (rank 0; None elsewhere); every batch follows the contract of :mod:`jobs.entry`;
- ``inputs(batch, tables, device)``: ``(args, kwargs, labels)`` of the model's call; ``step_batch(batch, tables,
  device)``: a training batch on the device with those parts (:class:`jobs.trainer.protocols.StepBatch`);
- ``step_loss(module, step, ahead)``: one training step's loss (``[train] loss`` of the module's output,
  or your ``[train] train_step``); ``loss(output, labels)`` and ``quality(outputs, labels)``: the loss and the
  held-out metrics.

:class:`UserWorkload` is your model (``[model] factory``, ``[data] batches``); :class:`CriteoWorkload` is the same
machinery with the built-in model (:func:`jobs.criteo.dlrm`) and the Criteo reader. Both train through the same
path: with parameter servers, each phase's module first gets the ``parameter_servers`` pass
(:class:`jobs.trainer.servers.ServerTables`).

A *tables backend* (:func:`make_tables`, the :class:`jobs.trainer.protocols.TableBackend` protocol):
:class:`LocalTables` (the tables stay in the model: DDP parameters) or :class:`jobs.trainer.servers.ServerTables` (the
``parameter_servers`` pass moves them to the job's servers), with ``view(phase)`` (each phase's own tables,
:class:`jobs.trainer.protocols.Tables`: ``local``, ``placement_pass()`` (None when local) and ``attach(gm)``,
``after_backward()``, ``sync()`` (wait for updates in flight), ``lookup_seconds()`` (seconds blocked on lookups since
the last call, or None), ``prefetch_hits()``, ``state_dict()`` / ``load_state_dict(state)`` (checkpoints, rank 0),
``moved`` (the model's state-dict keys that live on the servers), and ``close(graceful)``; the backend's ``servers``:
the worker group's servers, None when local.

Source: torchrec's train pipelines (a model, a batch iterator and a loss, kept apart from the loop).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from jobs import criteo, entry, table_sizes
from jobs.config import JobConfig
from jobs.records import Quality
from jobs.trainer.protocols import StepBatch, TableBackend, Tables
from recsys.criteo_follow import FollowStream, HeldOut, held_out_rows, present_rows
from recsys.criteo_format import Batch, DataError, ParseCounts, ParseStats
from recsys.criteo_shard import CriteoShard, DataPlan, scan
from recsys.criteo_stream import CriteoStream, ReaderStats, SharedBatches

__all__ = ["build_model", "criteo_shard", "CriteoWorkload", "UserWorkload", "make_workload", "LocalTables",
           "make_tables", "release_tables", "inference_batches"]


def build_model(config: JobConfig) -> nn.Module:
    """The job's model: ``[model] factory``'s, else the built-in torchrec DLRM (:func:`jobs.criteo.dlrm`), both
    initialised from ``[job] seed`` (the same weights in every phase and rank)."""
    return entry.make_model(config) if config.user_model else criteo.dlrm(config)


def criteo_shard(config: JobConfig, data_path: str | Path, **kwargs: Any) -> CriteoShard:
    """A :class:`~recsys.criteo_shard.CriteoShard` of ``data_path`` hashed for the built-in model's tables (``kwargs``:
    ``rank``, ``world_size``, ``split``); ``eval_fraction`` defaults to ``[data] eval_fraction``."""
    kwargs.setdefault("eval_fraction", config.data.eval_fraction)
    return CriteoShard(data_path, table_sizes.reader_sizes(config), **kwargs)


class UserWorkload:
    """Your model (``[model] factory``) on your batches (``[data] batches``) with ``[train] loss``.

    Args:
        rank, world_size: this trainer; rank 0 also reads the "eval" split.

    Raises:
        ConfigError: an entry point that does not resolve, or an epoch without a batch.
    """

    parse: ParseCounts | None = None
    has_eval: bool = False
    rows: int = 0
    _forward: Any = None
    """The signature of the model's ``forward`` (set by :meth:`build`), which splits a dataclass batch
    (:func:`jobs.entry.split_batch`); None: the keyword form."""

    def __init__(self, config: JobConfig, rank: int, world_size: int) -> None:
        self.config = config
        self._train = entry.data_context(config, "train", rank, world_size)
        self._eval = entry.data_context(config, "eval") if rank == 0 else None
        self.has_eval = self._eval is not None
        self._loss = entry.loss_fn(config)
        self._train_step = entry.train_step_fn(config)
        epoch = entry.epoch_batches(config, self._train)
        if not epoch:
            raise entry.ConfigError(f"{config.source}: [data] batches = {config.data.batches!r} gave no train "
                                    f"batch for rank {rank} of {world_size}")
        self.rows = sum(entry.batch_rows(b, config.job.batch_size) for b in epoch)

    def build(self, view: Tables) -> nn.Module:
        model = build_model(self.config)
        self._forward = inspect.signature(model.forward)
        return model

    def train_batches(self, start: int = 0) -> Iterator[Any]:
        return entry.endless(self.config, self._train, start)

    def eval_batches(self) -> Iterable[Any] | None:
        return None if self._eval is None else entry.epoch_batches(self.config, self._eval)

    def reader_stats(self) -> ReaderStats | None:
        """None: your ``[data] batches`` report no parse throughput."""
        return None

    def close(self) -> None:
        """Nothing to stop."""

    def inputs(self, batch: Any, tables: Tables, device: torch.device) -> tuple[tuple, dict[str, Any], torch.Tensor]:
        """The batch's ``(args, kwargs, labels)`` (:func:`jobs.entry.split_batch` by the model's ``forward``),
        moved to ``device`` (:func:`jobs.entry.move_batch`; a ``KeyedJaggedTensor`` stays on the CPU when the
        tables are not local: server lookups take it there).

        Raises:
            ConfigError: the batch does not follow the contract.
        """
        moved = entry.move_batch(batch, device, own_to=tables.local)
        return entry.split_batch(moved, f"{self.config.source}: [data] batches = {self.config.data.batches!r}",
                                 self._forward)

    def step_batch(self, batch: Any, tables: Tables, device: torch.device) -> StepBatch:
        """The batch moved as by :meth:`inputs`, with its parts; with ``[train] train_step`` it need not split
        (then no parts, and its rows are :func:`jobs.entry.batch_rows`'s).

        Raises:
            ConfigError: with ``[train] loss``, the batch does not follow the contract.
        """
        moved = entry.move_batch(batch, device, own_to=tables.local)
        try:
            args, kwargs, labels = entry.split_batch(moved, f"{self.config.source}: [data] batches = "
                                                            f"{self.config.data.batches!r}", self._forward)
        except entry.ConfigError:
            if self._train_step is None:
                raise
            return StepBatch(moved, entry.batch_rows(moved, self.config.job.batch_size))
        return StepBatch(moved, labels.shape[0], args, kwargs, labels)

    def loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._loss(output, labels)

    def step_loss(self, module: nn.Module, step: StepBatch, ahead: dict[str, Any]) -> torch.Tensor:
        """The loss of one training step: ``loss(module(*step.args, **step.kwargs, **ahead), step.labels)``, or with
        ``[train] train_step`` ``train_step(module, step.batch)`` (the batch as yielded, on the device; ``ahead``,
        the next batch's ``next_<input>`` lookups, added to the module's call).

        Raises:
            ConfigError: ``train_step`` returned something other than a scalar tensor.
        """
        if self._train_step is None:
            labels = cast(torch.Tensor, step.labels)  # set without train_step
            return self._loss(module(*step.args, **step.kwargs, **ahead), labels)
        loss = self._train_step(_Lookahead(module, ahead) if ahead else module, step.batch)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise entry.ConfigError(f"{self.config.source}: [train] train_step = {self.config.train.train_step!r} "
                                    f"returned {type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}, expected a "
                                    "scalar loss tensor")
        return loss

    def quality(self, outputs: list[torch.Tensor], labels: list[torch.Tensor]) -> Quality:
        return entry.quality(self.config, outputs, labels)


class _Lookahead:
    """The trained module, its call given the next batch's ``next_<input>`` arguments (prefetch); other
    attributes are the module's."""

    def __init__(self, module: nn.Module, ahead: dict[str, Any]) -> None:
        self.module, self.ahead = module, ahead

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs, **self.ahead)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)


class CriteoWorkload(UserWorkload):
    """The built-in model (:func:`jobs.criteo.dlrm`) on Criteo rows; batches are ``(dense, kjt, labels)``
    (:func:`jobs.criteo.model_inputs`), the loss ``[train] loss = "bce_with_logits"`` (AUC and log loss held out).

    ``shard``: a :class:`recsys.criteo_shard.CriteoShard` (in memory) or a :class:`recsys.criteo_stream.CriteoStream`
    (streamed; its batches are shared by the ``readers`` phases, :class:`recsys.criteo_stream.SharedBatches`);
    ``eval_shard``: the held-out rows, or None; ``parse``: the parse statistics to report (default: the shard's).
    """

    def __init__(self, config: JobConfig, shard: Any, eval_shard: CriteoShard | HeldOut | None = None, *,
                 parse: ParseCounts | None = None, readers: int = 1) -> None:
        self.config, self.shard, self.eval_shard = config, shard, eval_shard
        self.has_eval = eval_shard is not None
        self.rows = len(shard)
        self.parse = parse if parse is not None else shard.stats.as_dict()
        self.readers = readers
        self._shared: SharedBatches | None = None
        self._loss = entry.loss_fn(config)
        self._train_step = None

    def build(self, view: Tables) -> nn.Module:
        """The built-in DLRM (:func:`jobs.criteo.dlrm`); with parameter servers (``view`` not local) its tables
        are on the ``meta`` device: the trainer allocates none of them and the servers initialise them (the
        ``parameter_servers`` pass, seeded by ``[job] seed``), the same rows for every phase."""
        return criteo.dlrm(self.config, tables_device=None if view.local else "meta")

    def train_batches(self, start: int = 0) -> Iterator[Any]:
        """Endless batches from batch ``start``; a stream's are read once and shared by the ``readers`` phases
        (a further call makes a new stream)."""
        if not isinstance(self.shard, CriteoStream):
            return map(criteo.model_inputs, self.shard.batches(self.config.job.batch_size, start=start))
        shared = self._shared
        if shared is None or shared.made >= shared.readers or shared.start != start:
            shared = self._shared = SharedBatches(self.shard.batches(self.config.job.batch_size, start=start),
                                                  self.readers, start)
        return map(criteo.model_inputs, shared.reader())

    def reader_stats(self) -> ReaderStats | None:
        """The stream's parse throughput (:meth:`recsys.criteo_stream.CriteoStream.stats`), or None."""
        return self.shard.stats() if isinstance(self.shard, CriteoStream) else None

    def close(self) -> None:
        """Stop the stream's worker processes."""
        if isinstance(self.shard, CriteoStream):
            self.shard.close()

    def eval_batches(self) -> Iterable[Any] | None:
        return None if self.eval_shard is None else map(criteo.model_inputs, self.eval_shard.all_batches(512))


def make_workload(config: JobConfig, rank: int, world: int, data_path: str, *, plan: DataPlan | None = None,
                  exporter: Any = None, on_wait: Any = None) -> CriteoWorkload | UserWorkload:
    """This trainer's workload: :class:`UserWorkload` with ``[model] factory``, else the DLRM on the Criteo data
    ``data_path`` (a file, directory or glob), streamed (:class:`recsys.criteo_stream.CriteoStream`, ``[data]
    reader_workers`` processes); rank 0 also reads the held-out rows (at most ``[data] eval_max_rows``) when
    ``[data] eval_fraction > 0``. With ``[data] follow`` the files are read as they appear
    (:class:`recsys.criteo_follow.FollowStream`; ``workload.rows`` is 0, a stream has no epochs) and the held-out rows
    are those of the files there when the trainer starts (:func:`recsys.criteo_follow.held_out_rows`; none: no
    held-out metrics).

    Args:
        plan: The launcher's first pass (:func:`recsys.criteo_shard.scan`); None: this trainer scans the data.
        exporter: The trainer's :class:`jobs.trainer.metrics.Exporter` (its reader gauge), or None.
        on_wait: With ``follow``: ``on_wait(True)`` when the trainer starts waiting for data, ``on_wait(False)`` when
            data came again (:class:`recsys.criteo_follow.FollowStream`); or None.

    Raises:
        recsys.criteo_format.DataError: the Criteo data cannot be used, or this trainer's share has no valid line;
            ConfigError: see :class:`UserWorkload`.
    """
    if config.user_model:
        return UserWorkload(config, rank, world)
    d = config.data
    if d.follow:
        return _follow_workload(config, rank, world, data_path, plan, exporter, on_wait)
    if plan is None:
        plan = scan(data_path, world, d.eval_fraction)
    if plan.rows[rank] == 0:
        stats = plan.stats
        raise DataError(f"CriteoShard: {data_path} has no valid train line for rank {rank} of {world} "
                        f"({stats['valid']} valid, {sum(stats['malformed'].values())} malformed)")
    on_chunk = None if exporter is None else (lambda s: exporter.observe_reader(s["lines_per_s"]))
    stream = CriteoStream(plan.files, table_sizes.reader_sizes(config), rank=rank, world_size=world, every=plan.every,
                          workers=d.reader_workers, rows_per_epoch=plan.rows[rank], on_chunk=on_chunk)
    eval_shard = None
    if rank == 0 and d.eval_fraction > 0:
        eval_shard = criteo_shard(config, data_path, split="eval", max_rows=d.eval_max_rows, count_all=False)
    readers = 2 if config.phases.baseline else 1
    return CriteoWorkload(config, stream, eval_shard, parse=plan.stats, readers=readers)


def _follow_workload(config: JobConfig, rank: int, world: int, data_path: str, plan: DataPlan | None, exporter: Any,
                     on_wait: Any) -> CriteoWorkload:
    """:func:`make_workload` with ``[data] follow``: the stream of ``data_path`` and, on rank 0, the held-out rows there
    now; the parse statistics reported are the launcher's first pass over the lines there at launch."""
    d = config.data
    every = round(1 / d.eval_fraction) if d.eval_fraction > 0 else 0
    on_chunk = None if exporter is None else (lambda s: exporter.observe_reader(s["lines_per_s"]))
    stream = FollowStream(data_path, table_sizes.reader_sizes(config), rank=rank, world_size=world, every=every,
                          workers=d.reader_workers, poll_s=d.follow_poll_s, on_chunk=on_chunk, on_wait=on_wait)
    held = held_out_rows(data_path, table_sizes.reader_sizes(config), every, d.eval_max_rows) if rank == 0 else None
    return CriteoWorkload(config, stream, held, parse=plan.stats if plan is not None else ParseStats().as_dict(),
                          readers=2 if config.phases.baseline else 1)


def inference_batches(config: JobConfig, data_path: str | Path | None) -> tuple[list[Any], list[Any]]:
    """(held-out batches, calibration batches) for the launcher's fp32-vs-int8 comparison
    (:mod:`jobs.launcher.inference`): the Criteo held-out rows in batches of ``[quant] eval_batch_size`` and the first
    ``[quant] calibration_batches`` training batches; for your model, the "eval" split of ``[data] batches`` and the
    first train batches of rank 0 of 1. With ``[data] follow`` (a writer may still be appending), the complete lines
    there now only (:func:`recsys.criteo_follow.present_rows`).

    Raises:
        recsys.criteo_format.DataError: the Criteo data has no held-out or no training line (with ``follow``: no
            training line; no held-out line gives no held-out batch).
    """
    q = config.quant
    if config.user_model:
        held_out = entry.epoch_batches(config, entry.data_context(config, "eval"))
        train = entry.endless(config, entry.data_context(config, "train"))
        return held_out, [next(train) for _ in range(q.calibration_batches)]
    fraction = config.data.eval_fraction or 0.1
    path = cast("str | Path", data_path)  # the built-in model reads its Criteo file
    if config.data.follow:
        return _follow_inference_batches(config, path, round(1 / fraction))
    eval_shard = criteo_shard(config, path, split="eval", eval_fraction=fraction,
                              max_rows=config.data.eval_max_rows, count_all=False)
    calibration = criteo_shard(config, path, eval_fraction=fraction, count_all=False,
                               max_rows=q.eval_batch_size * q.calibration_batches).batches(q.eval_batch_size)
    return ([criteo.model_inputs(b) for b in eval_shard.all_batches(q.eval_batch_size)],
            [criteo.model_inputs(next(calibration)) for _ in range(q.calibration_batches)])


def _follow_inference_batches(config: JobConfig, path: str | Path, every: int) -> tuple[list[Any], list[Any]]:
    """:func:`inference_batches` of a stream: its complete lines now, never a half-written last line; the
    calibration batches wrap around the training rows read, as a :class:`recsys.criteo_shard.CriteoShard`'s do."""
    q, sizes, b = config.quant, table_sizes.reader_sizes(config), config.quant.eval_batch_size
    held = present_rows(path, sizes, every, config.data.eval_max_rows, split="eval")
    train = present_rows(path, sizes, every, b * q.calibration_batches, split="train")
    if train is None:
        raise DataError(f"{path}: no complete training line there now ([data] follow)")
    calibration = []
    for i in range(q.calibration_batches):
        idx = (torch.arange(b) + i * b) % len(train)
        calibration.append(criteo.model_inputs(Batch(train.dense[idx], train.sparse[idx], train.labels[idx])))
    held_out = [] if held is None else [criteo.model_inputs(batch) for batch in held.all_batches(b)]
    return held_out, calibration


class LocalTables:
    """Embedding tables inside the model (DDP parameters; the built-in DLRM's give sparse gradients): the
    :class:`jobs.trainer.protocols.TableBackend` and every phase's :class:`jobs.trainer.protocols.Tables` (:meth:`view`
    is itself)."""

    local = True
    moved: frozenset[str] = frozenset()
    servers = None
    """No parameter servers: the tables are local."""

    def placement_pass(self) -> None:
        """None: the tables stay in the module."""
        return None

    def attach(self, gm: nn.Module) -> None:
        """Nothing to do: no pass moved the tables."""


    def view(self, phase: str) -> "LocalTables":
        """Itself: each phase's tables are in its own model."""
        return self

    def after_backward(self) -> None:
        """Nothing to do: DDP all-reduces the gradients (the sparse tables' apart, :mod:`jobs.trainer.sparse_grads`) and
        the optimizer applies them."""

    def lookup_seconds(self) -> float | None:
        return None

    def prefetch_hits(self) -> int:
        return 0

    def sync(self) -> None:
        """Nothing in flight."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to do: the tables are in the model's state dict."""

    def dynamic_stats(self) -> None:
        """None: no dynamic tables without servers."""
        return None

    def close(self, graceful: bool = True) -> None:
        """Nothing to release."""


def release_tables(model: nn.Module, moved: frozenset[str]) -> None:
    """Free the eager model's copy of the tables the ``parameter_servers`` pass moved (``"<path>.weight"``
    keys): the servers hold them now, and the trainer keeps no table memory (the module it trains no longer
    refers to them; each weight becomes a ``(0, D)`` tensor)."""
    for key in moved:
        module = model.get_submodule(key.removesuffix(".weight"))
        weight = cast(torch.Tensor, module.weight)  # a table's weight
        module.weight = nn.Parameter(weight.new_empty(0, weight.shape[-1]), requires_grad=False)


def make_tables(config: JobConfig, rank: int, world: int, spec: Any, exporter: Any) -> TableBackend:
    """The tables backend of this trainer: local when ``[cluster] parameter_servers = 0``, else
    :class:`jobs.trainer.servers.ServerTables` (the job's servers, ``spec.servers`` of the
    :class:`jobs.trainer.spec.TrainerSpec` ``spec``, one table set per phase).

    Raises:
        RuntimeError: ``spec`` has another number of server actors than ``[cluster] parameter_servers``.
    """
    if config.cluster.parameter_servers == 0:
        return LocalTables()
    from jobs.trainer.servers import ServerTables

    phases = ("baseline", "optimized") if config.phases.baseline else ("optimized",)
    return ServerTables(config, rank, world, spec, exporter, phases)
