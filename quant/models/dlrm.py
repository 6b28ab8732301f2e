"""torchrec's own ``DLRM`` on the Criteo sample, and its int8 form: torchrec's quantized tables, fxdist's passes
for the rest.

The model is ``torchrec.models.dlrm.DLRM`` (built by :func:`recsys.criteo.criteo_dlrm`: an
``EmbeddingBagCollection`` of 26 tables, one per categorical feature; torchrec ``MLP``s of ``Perceptron``
(Linear + ReLU) layers for the dense and over arches). For int8:

- the tables: torchrec's ``quantize_embeddings`` (``torchrec.inference.modules``) swaps the EBC for
  ``torchrec.quant.embedding_modules.EmbeddingBagCollection`` (8-bit row-wise rows with a per-row scale and bias,
  FBGEMM's ``IntNBitTableBatchedEmbeddingBagsCodegen``): :func:`quantize_tables`;
- the dense and over arches: fxdist's static PTQ (``quant.prepare`` / ``calibrate`` / ``convert``) on the graph
  traced with the EBC as a leaf (:func:`trace_dlrm`), which turns each Perceptron into ``nniq.LinearReLU``.

Shapes: ``dense (B, 13)`` float (log-transformed counts), ``sparse (B, 26)`` int64 (hashed ids, one per table),
given to the model as ``(dense, criteo_kjt(sparse))`` -> logits ``(B, 1)``.

Source: Naumov et al. 2019 (DLRM); torchrec/models/dlrm.py; torchrec/inference/modules.py
(``quantize_embeddings``); torch.fx paper §6.2.1.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

import fxdist as fx
from recsys.criteo import criteo_kjt
from recsys.criteo_shard import read_file
from recsys.embedding import EmbeddingLeafTracer
from recsys.shared_data import default_criteo_path  # re-exported

__all__ = ["load_criteo", "criteo_kjt", "train_dlrm", "quantize_tables", "trace_dlrm",
           "default_criteo_path"]


def load_criteo(path: str | Path | None = None, *, table_size: int = 1000) -> tuple[torch.Tensor, ...]:
    """Read a Criteo TSV (label, I1..I13, C1..C26) into ``(dense (N, 13), sparse (N, 26), labels (N,))`` with the
    job's parser and ids (:func:`recsys.criteo_shard.read_file`).

    Dense counts become ``log1p(max(x, 0))`` (missing = 0); categorical values are hashed
    (:func:`recsys.criteo_format.hash_ids`) into ``table_size`` rows per table (missing = row 0).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a malformed line, e.g. without 40 tab-separated fields (a
            :class:`recsys.criteo_format.DataError` naming the file and line).
    """
    path = Path(path) if path is not None else default_criteo_path()
    if not path.is_file():
        raise FileNotFoundError(f"Criteo sample not found at {path}")
    return read_file(path, table_size)


def train_dlrm(
    dense: torch.Tensor, sparse: torch.Tensor, labels: torch.Tensor, *, epochs: int = 2, batch_size: int = 128,
    lr: float = 3e-3, seed: int = 0, table_size: int = 1000, dim: int = 16,
    dense_layers: tuple[int, ...] = (64, 16), over_layers: tuple[int, ...] = (64, 32, 1),
) -> nn.Module:
    """Train torchrec's DLRM (:func:`recsys.criteo.criteo_dlrm` with these sizes) with Adam and binary
    cross-entropy on ``(dense, criteo_kjt(sparse))``; returns it in eval mode."""
    from recsys.criteo import criteo_dlrm

    torch.manual_seed(seed)
    model = criteo_dlrm(table_size, dim, dense_layers=dense_layers, over_layers=over_layers)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(labels), generator=gen).split(batch_size):
            opt.zero_grad()
            logits = model(dense[idx], criteo_kjt(sparse[idx])).squeeze(1)
            nn.functional.binary_cross_entropy_with_logits(logits, labels[idx]).backward()
            opt.step()
    return model.eval()


def quantize_tables(model: nn.Module, dtype: torch.dtype = torch.qint8) -> nn.Module:
    """A copy of ``model`` (eval mode) whose torchrec ``EmbeddingBagCollection``s are torchrec's quantized EBC
    (8-bit row-wise for ``torch.qint8``, 4-bit for ``torch.quint4x2``), via ``quantize_embeddings``."""
    from torchrec.inference.modules import quantize_embeddings

    return quantize_embeddings(copy.deepcopy(model), dtype=dtype, inplace=True).eval()


def trace_dlrm(model: nn.Module) -> fx.GraphModule:
    """``model`` traced by fxdist with each embedding module (torchrec's EBCs, float or quantized) as a leaf
    (:class:`recsys.embedding.EmbeddingLeafTracer`), ready for ``quant.prepare``."""
    tracer = EmbeddingLeafTracer()
    graph = tracer.trace(model)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)
