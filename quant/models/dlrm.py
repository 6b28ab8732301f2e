"""A DLRM built from torchrec's own ``DenseArch``, ``InteractionArch`` and ``OverArch``, with one
``nn.EmbeddingBag`` per categorical feature, trained briefly on the Criteo sample.

The embedding bags are what FBGEMM's 8-bit row-wise kernels quantize (``torch.ao.nn.quantized.EmbeddingBag``);
the dense and over arches are torchrec ``MLP``s of ``Perceptron`` (Linear + ReLU) layers, which static PTQ turns
into ``nniq.LinearReLU``.

Shapes: ``dense (B, 13)`` float (log-transformed counts), ``sparse (B, 26)`` int64 (hashed ids, one per table)
-> logits ``(B,)``.

Source: Naumov et al. 2019 (DLRM); torchrec/models/dlrm.py; torch.fx paper §6.2.1.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

__all__ = ["EmbeddingBagDLRM", "load_criteo", "train_dlrm", "default_criteo_path"]

NUM_DENSE, NUM_SPARSE = 13, 26


def default_criteo_path() -> Path:
    """``<repo>/../shared/data/criteo/train_examples.txt`` (absent outside CI)."""
    return Path(__file__).resolve().parents[2].parent / "shared" / "data" / "criteo" / "train_examples.txt"


def load_criteo(path: str | Path | None = None, *, table_size: int = 1000) -> tuple[torch.Tensor, ...]:
    """Read a Criteo TSV (label, I1..I13, C1..C26) into ``(dense (N, 13), sparse (N, 26), labels (N,))``.

    Dense counts become ``log1p(max(x, 0))`` (missing = 0); categorical hex strings are hashed (crc32) into
    ``table_size`` rows per table (missing = row 0).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a line without 40 tab-separated fields (names the line).
    """
    path = Path(path) if path is not None else default_criteo_path()
    if not path.is_file():
        raise FileNotFoundError(f"Criteo sample not found at {path}")
    dense, sparse, labels = [], [], []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split("\t")
        if len(fields) != 1 + NUM_DENSE + NUM_SPARSE:
            raise ValueError(f"{path}:{lineno}: expected 40 tab-separated fields, got {len(fields)}")
        labels.append(float(fields[0]))
        dense.append([float(f) if f else 0.0 for f in fields[1 : 1 + NUM_DENSE]])
        sparse.append([
            0 if not f else 1 + zlib.crc32(f"{t}:{f}".encode()) % (table_size - 1)
            for t, f in enumerate(fields[1 + NUM_DENSE :])
        ])
    dense_t = torch.tensor(dense).clamp_min(0).log1p()
    return dense_t, torch.tensor(sparse, dtype=torch.long), torch.tensor(labels)


class EmbeddingBagDLRM(nn.Module):
    """torchrec's DLRM arches around 26 ``nn.EmbeddingBag`` tables (sum pooling, one id per row and table)."""

    def __init__(
        self, table_size: int = 1000, dim: int = 16, dense_layers: Sequence[int] = (64, 16),
        over_layers: Sequence[int] = (64, 32, 1),
    ) -> None:
        super().__init__()
        from torchrec.models.dlrm import DenseArch, InteractionArch, OverArch

        if dense_layers[-1] != dim:
            raise ValueError(f"the dense arch must end at the embedding dim {dim}, got {list(dense_layers)}")
        self.tables = nn.ModuleList(nn.EmbeddingBag(table_size, dim, mode="sum") for _ in range(NUM_SPARSE))
        self.dense_arch = DenseArch(NUM_DENSE, list(dense_layers))
        self.inter_arch = InteractionArch(NUM_SPARSE)
        over_in = dim + NUM_SPARSE * (NUM_SPARSE + 1) // 2
        self.over_arch = OverArch(over_in, list(over_layers))

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        ids = sparse.t().contiguous()  # (26, B): each table reads one contiguous row (FBGEMM needs contiguous ids)
        pooled = [table(ids[i].unsqueeze(1)) for i, table in enumerate(self.tables)]
        embedded = torch.stack(pooled, dim=1)
        x = self.dense_arch(dense)
        return self.over_arch(self.inter_arch(x, embedded)).squeeze(1)


def train_dlrm(
    dense: torch.Tensor, sparse: torch.Tensor, labels: torch.Tensor, *, epochs: int = 2, batch_size: int = 128,
    lr: float = 3e-3, seed: int = 0, **model_kwargs: object,
) -> EmbeddingBagDLRM:
    """Train :class:`EmbeddingBagDLRM` with Adam and binary cross-entropy; returns it in eval mode."""
    torch.manual_seed(seed)
    model = EmbeddingBagDLRM(**model_kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(labels), generator=gen).split(batch_size):
            opt.zero_grad()
            loss = nn.functional.binary_cross_entropy_with_logits(model(dense[idx], sparse[idx]), labels[idx])
            loss.backward()
            opt.step()
    return model.eval()
