"""The only seams between the training loop (:mod:`jobs.trainer.loop`) and a model: a :class:`Workload` and its
:class:`Tables`.

The trainer asks for nothing else: every member below exists on every implementation, so it never probes
(``getattr`` / ``hasattr`` / ``isinstance``) what it was given.

- :class:`Workload`: :class:`jobs.trainer.workload.UserWorkload` (your ``[model] factory`` on your ``[data] batches``)
  and :class:`jobs.trainer.workload.CriteoWorkload` (the built-in torchrec DLRM on Criteo rows);
- :class:`TableBackend` (:func:`jobs.trainer.workload.make_tables`): :class:`jobs.trainer.workload.LocalTables` (the
  tables stay in the model: DDP parameters) or :class:`jobs.trainer.servers.ServerTables` (the ``parameter_servers``
  pass moves them to the job's servers); its :meth:`TableBackend.view` of a phase is that phase's :class:`Tables`
  (:class:`~jobs.trainer.workload.LocalTables` itself, or a server view).

Batches follow the contract of :mod:`jobs.entry`; a model's call is ``module(*args, **kwargs)`` with
``(args, kwargs, labels)`` from :meth:`Workload.inputs`, ``labels`` a tensor of shape ``(B,)`` or ``(B, ...)``
for a batch of ``B`` samples; a training step gets a :class:`StepBatch` (:meth:`Workload.step_batch`), which
also carries the batch as it was yielded (on the device) for your ``[train] train_step``.

Source: torchrec's train pipelines (a model, a batch iterator and a loss, kept apart from the loop).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from jobs.records import Quality
from recsys.criteo_format import ParseCounts
from recsys.criteo_stream import ReaderStats

__all__ = ["Workload", "Tables", "TableBackend", "StepBatch"]


@dataclass(frozen=True)
class StepBatch:
    """One training batch, ready for a step (:meth:`Workload.step_batch`)."""

    batch: Any
    """The batch as ``batches`` yielded it, of its own type, moved to the trainer's device
    (:func:`jobs.entry.move_batch`): what ``[train] train_step`` gets."""
    rows: int
    """Its samples ``B`` (the step's throughput)."""
    args: tuple = ()
    """The model's positional inputs (:func:`jobs.entry.split_batch` of :attr:`batch`; the same objects), for the
    loss and for the next step's ``next_<input>`` lookups; empty for a ``train_step`` batch that does not split."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """The model's keyword inputs, as :attr:`args`."""
    labels: torch.Tensor | None = None
    """The labels, ``(B,)`` or ``(B, ...)``; None for a ``train_step`` batch that does not split."""


class Tables(Protocol):
    """One phase's embedding tables, seen from the trainer."""

    local: bool
    """True: the tables are in the model (DDP parameters, :class:`jobs.trainer.workload.LocalTables`); False: on the
    parameter servers (the model built for them holds ``meta`` tables, lookups are RPCs taking CPU tensors)."""
    moved: frozenset[str]
    """The model's state-dict keys (``"<path>.weight"``) of the tables that live on the servers (empty when local)."""

    def placement_pass(self) -> Any:
        """The pass that moves the tables out of the module, run first in every phase (``fxdist.optimize`` pass,
        the ``parameter_servers`` pass with this phase's clients), or None when the tables stay local."""

    def attach(self, gm: nn.Module) -> None:
        """``gm`` went through :meth:`placement_pass`: read and time its tables from now on (a no-op when local)."""

    def after_backward(self) -> None:
        """After ``loss.backward()``, before the optimizer step: whatever the tables need (nothing when local:
        DDP reduces the gradients; on servers the gradient hooks pushed them during backward)."""

    def sync(self) -> None:
        """Wait for the updates in flight (pushes to the servers); a no-op when local."""

    def lookup_seconds(self) -> float | None:
        """Seconds this trainer was blocked on lookups since the last call, or None when nothing was fetched
        (always None when local)."""

    def prefetch_hits(self) -> int:
        """Lookups answered by a prefetch (``async_rpc_prefetch``) so far, a count (0 when local)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The server tables under the model's state-dict names (``"<path>.weight"``, ``(rows, dim)`` float32)
        with their optimizer state, gathered on rank 0 (``{}`` elsewhere, and when local: the tables are in the
        model's own state dict)."""

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load :meth:`state_dict`'s output (rank 0 writes it to the servers; every rank waits); a no-op when local."""

    def dynamic_stats(self) -> dict[str, dict[str, int]] | None:
        """Rank 0, dynamic tables (``[model] table_sizes = "dynamic"``): per table its rows, capacity and counters
        (:func:`jobs.trainer.servers.dynamic_stats`); None otherwise (always None when local)."""


class TableBackend(Protocol):
    """Where a trainer's tables live, for every phase (:func:`jobs.trainer.workload.make_tables`)."""

    servers: Any
    """This worker group's parameter servers (:class:`jobs.trainer.servers.ServerGroup`: its lifecycle, e.g. the
    fault injection's ``kill(index)``), or None when the tables are local."""

    def view(self, phase: str) -> Tables:
        """The tables of ``phase`` ("baseline" or "optimized"): each phase trains its own set."""

    def close(self, graceful: bool = True) -> None:
        """Release the tables at the end of the job on this trainer; ``graceful``: wait for every update and every
        trainer first (False after an error: leave at once)."""


class Workload(Protocol):
    """What a trainer trains: a model, its batches, its loss and its held-out metrics."""

    rows: int
    """This trainer's training rows (samples) per epoch, for ``[job] eval_epochs``."""
    parse: ParseCounts | None
    """The Criteo reader's parse statistics (lines, valid, malformed per reason), or None (your batches)."""
    has_eval: bool
    """This rank evaluates: rank 0 with held-out data (:meth:`eval_batches` is not None)."""

    def build(self, view: Tables) -> nn.Module:
        """The phase's model, initialised from ``[job] seed`` (the same weights in every phase and rank); with
        server tables (``view.local`` False) the built-in model's tables are on ``meta``."""

    def train_batches(self, start: int = 0) -> Iterator[Any]:
        """Endless training batches from batch ``start`` on (a resumed trainer continues the sequence)."""

    def eval_batches(self) -> Iterable[Any] | None:
        """The held-out batches (rank 0), or None (other ranks, or no held-out data)."""

    def reader_stats(self) -> ReaderStats | None:
        """The reader's parse throughput (``lines_per_s``, ``capacity_lines_per_s``, ``workers``, ``lines``,
        ``rows``: :meth:`recsys.criteo_stream.CriteoStream.stats`), or None without a stream."""

    def close(self) -> None:
        """Stop the reader's worker processes, if any."""

    def inputs(self, batch: Any, tables: Tables, device: torch.device) -> tuple[tuple, dict[str, Any], torch.Tensor]:
        """``(args, kwargs, labels)`` of the model's call on ``batch``, tensors on ``device`` (a lookup's
        ``KeyedJaggedTensor`` stays on the CPU when ``tables`` are not local)."""

    def step_batch(self, batch: Any, tables: Tables, device: torch.device) -> StepBatch:
        """A training batch on ``device`` and its parts (:class:`StepBatch`), the KJTs on the CPU when ``tables``
        are not local.

        Raises:
            ConfigError: a batch that does not follow the contract (with ``[train] loss``).
        """

    def step_loss(self, module: nn.Module, step: StepBatch, ahead: dict[str, Any]) -> torch.Tensor:
        """One training step's scalar loss (``[train] loss`` of ``module(*step.args, **step.kwargs, **ahead)``,
        or your ``[train] train_step`` of ``step.batch``); ``ahead``: the next batch's ``next_<input>`` arguments
        (prefetch).

        Raises:
            ConfigError: your ``train_step`` returned something other than a scalar tensor.
        """

    def loss(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        """``[train] loss`` of a model output against its labels, a scalar tensor."""

    def quality(self, outputs: list[Any], labels: list[torch.Tensor]) -> Quality:
        """The held-out metrics over the eval batches' outputs and labels (:func:`jobs.entry.quality`: AUC and log
        loss for "bce_with_logits", RMSE for "mse", else the mean loss; your ``[train] metric`` under ``"metric"``);
        ``{}`` without outputs."""
