"""DLRM for Criteo: bottom MLP on dense features, embedding lookups, pairwise dot interaction, top MLP.

The embedding lookup (``sparse_arch``) is pluggable: :class:`LocalEmbeddings` keeps the 26 tables in the
trainer (one ``nn.Embedding`` with per-table row offsets, sparse gradients), while a job with parameter
servers plugs in :class:`jobs.ps.PSSparseArch`, which fetches pooled rows over RPC (``scheduling.ps``).
A sparse arch has two steps, ``fetched = fetch(sparse)`` and ``combine(sparse, fetched) -> (B, 26, D)``;
:class:`DLRM` issues the fetch first, runs the bottom MLP, then combines, so that once
``scheduling.async_rpc`` has split a blocking fetch into start and wait, the bottom MLP overlaps the fetch.

Shapes: ``dense (B, 13)``, ``sparse (B, 26)`` -> logits ``(B,)``. With ``F = 27`` features (the bottom
MLP output plus 26 embeddings) the interaction has ``F * (F - 1) / 2 = 351`` dot products.

Source: Naumov et al., "Deep Learning Recommendation Model for Personalization and Recommendation
Systems" (2019), §2 (architecture); torchrec.models.dlrm (DenseArch / InteractionArch / OverArch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["mlp", "LocalEmbeddings", "Interaction", "DLRM", "DenseDLRM"]


def mlp(in_features: int, widths: Sequence[int], *, final_relu: bool = True) -> nn.Sequential:
    """Linear+ReLU layers of the given widths; ``final_relu=False`` leaves the last Linear bare."""
    layers: list[nn.Module] = []
    for i, width in enumerate(widths):
        layers.append(nn.Linear(in_features, width))
        if final_relu or i < len(widths) - 1:
            layers.append(nn.ReLU())
        in_features = width
    return nn.Sequential(*layers)


class LocalEmbeddings(nn.Module):
    """``num_tables`` embedding tables of ``table_size`` rows each (one size for all, or one per table, e.g.
    :attr:`jobs.config.JobConfig.table_sizes`) and ``dim`` columns, stored as one ``nn.Embedding`` with
    per-table row offsets. Table ``j`` is initialised uniformly in ``±table_size_j ** -0.5``.

    Shapes: ``ids (B, T) int64 -> (B, T, D)``.

    Raises:
        ValueError: a list of sizes whose length is not ``num_tables``.
    """

    def __init__(self, num_tables: int, table_size: int | Sequence[int], dim: int, *, sparse: bool = True) -> None:
        super().__init__()
        sizes = [table_size] * num_tables if isinstance(table_size, int) else [int(s) for s in table_size]
        if len(sizes) != num_tables:
            raise ValueError(f"LocalEmbeddings: {len(sizes)} table sizes for {num_tables} tables")
        self.table_sizes = sizes
        self.embedding = nn.Embedding(sum(sizes), dim, sparse=sparse)
        starts = [0]
        for size in sizes[:-1]:
            starts.append(starts[-1] + size)
        with torch.no_grad():
            if len(set(sizes)) == 1:  # one draw, as before per-table sizes existed
                self.embedding.weight.uniform_(-(sizes[0] ** -0.5), sizes[0] ** -0.5)
            else:
                for start, size in zip(starts, sizes):
                    self.embedding.weight[start:start + size].uniform_(-(size**-0.5), size**-0.5)
        self.register_buffer("offsets", torch.tensor(starts, dtype=torch.int64), persistent=False)

    def fetch(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.offsets

    def combine(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.embedding(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.combine(ids, self.fetch(ids))


class Interaction(nn.Module):
    """Pairwise dot products of the F feature vectors (upper triangle), concatenated to the dense vector.

    Shapes: ``dense (B, D)``, ``embedded (B, T, D) -> (B, D + F * (F - 1) / 2)`` with ``F = T + 1``.
    """

    def __init__(self, num_features: int) -> None:
        super().__init__()
        rows, cols = torch.triu_indices(num_features, num_features, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        features = torch.cat([dense.unsqueeze(1), embedded], dim=1)
        dots = torch.bmm(features, features.transpose(1, 2))
        return torch.cat([dense, dots[:, self.rows, self.cols]], dim=1)


class DLRM(nn.Module):
    """DLRM with a pluggable sparse arch.

    Args:
        sparse_arch: Module with ``fetch(sparse)`` and ``combine(sparse, fetched) -> (B, T, D)``; ``sparse``
            is ``(B, T) int64`` ids (local tables) or a torchrec ``KeyedJaggedTensor`` (servers).
        num_dense: Dense features (13 for Criteo).
        num_tables: T, categorical features (26 for Criteo).
        dim: D, the embedding width.
        bottom: Hidden widths of the bottom MLP (its output width is D).
        top: Hidden widths of the top MLP (its output width is 1).
    """

    def __init__(
        self,
        sparse_arch: nn.Module,
        *,
        num_dense: int = 13,
        num_tables: int = 26,
        dim: int = 16,
        bottom: Sequence[int] = (512, 256),
        top: Sequence[int] = (512, 256),
    ) -> None:
        super().__init__()
        self.bottom = mlp(num_dense, [*bottom, dim])
        self.sparse_arch = sparse_arch
        self.interaction = Interaction(num_tables + 1)
        num_inter = dim + (num_tables + 1) * num_tables // 2
        self.top = mlp(num_inter, [*top, 1], final_relu=False)

    def forward(self, dense: torch.Tensor, sparse: Any) -> torch.Tensor:
        fetched = self.sparse_arch.fetch(sparse)
        x = self.bottom(dense)
        embedded = self.sparse_arch.combine(sparse, fetched).to(x.device)  # server rows arrive on the CPU
        return self.top(self.interaction(x, embedded)).squeeze(1)


class DenseDLRM(nn.Module):
    """The dense part of a trained DLRM, fed with embeddings looked up beforehand (for quantization).

    Shapes: ``dense (B, 13)``, ``embedded (B, T, D) -> logits (B,)``.
    """

    def __init__(self, model: DLRM) -> None:
        super().__init__()
        self.bottom = model.bottom
        self.interaction = model.interaction
        self.top = model.top

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        return self.top(self.interaction(x, embedded)).squeeze(1)
