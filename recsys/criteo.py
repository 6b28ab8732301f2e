"""Criteo input for torchrec's DLRM: table configs, a factory, and batches from the Criteo TSV.

The model is torchrec's own ``torchrec.models.dlrm.DLRM``; put its tables on parameter servers with
:func:`scheduling.parameter_servers` (``fxdist.optimize(model, passes=("parameter_servers", "async_rpc"))``)::

    model = criteo_dlrm(num_embeddings=1000, dim=16)
    gm = fxdist.optimize(model, passes=("parameter_servers", "async_rpc_prefetch"))
    for (dense, kjt, labels), nxt in scheduling.lookahead(criteo_batches(path, 256)):
        logits = gm(dense, kjt, next_sparse_features=None if nxt is None else nxt[1])

:func:`criteo_batches` reads with the job's reader (:func:`recsys.criteo_shard.read_file`; the format and the one
id hash: :mod:`recsys.criteo_format`), so a line gives the ids the job and ``quant``'s ``load_criteo`` give it.

Source: torchrec ``DLRM`` (Naumov et al. 2019); the Criteo Kaggle display-advertising format.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from recsys.criteo_format import NUM_DENSE, NUM_SPARSE
from recsys.criteo_shard import read_file

__all__ = ["criteo_tables", "criteo_dlrm", "criteo_batches", "criteo_kjt", "CRITEO_DENSE", "CRITEO_SPARSE"]

CRITEO_DENSE = NUM_DENSE
CRITEO_SPARSE = NUM_SPARSE


# ---- Criteo ---------------------------------------------------------------------------------------------
def criteo_tables(num_embeddings: int | Sequence[int] = 1000, dim: int = 16,
                  num_tables: int = CRITEO_SPARSE) -> list[EmbeddingBagConfig]:
    """One table ``t_Cj`` per categorical feature ``C1..C<num_tables>``: ``num_embeddings`` rows each (the hash
    buckets of that feature's ids), or one size per feature.

    Raises:
        ValueError: a list of sizes whose length is not ``num_tables``, or a size below 1.
    """
    sizes = [int(num_embeddings)] * num_tables if isinstance(num_embeddings, int) else [int(n) for n in num_embeddings]
    if len(sizes) != num_tables or min(sizes, default=1) < 1:
        raise ValueError(f"criteo_tables: expected {num_tables} positive table sizes (one per feature), got {sizes}")
    return [EmbeddingBagConfig(name=f"t_C{i}", embedding_dim=dim, num_embeddings=n, feature_names=[f"C{i}"])
            for i, n in enumerate(sizes, 1)]


def criteo_dlrm(num_embeddings: int | Sequence[int] = 1000, dim: int = 16, num_tables: int = CRITEO_SPARSE,
                dense_layers: Sequence[int] = (64, 16), over_layers: Sequence[int] = (64, 1), *,
                sparse_grad: bool = False, tables_device: str | torch.device | None = None,
                seed: int | None = None) -> nn.Module:
    """torchrec's ``DLRM`` over :func:`criteo_tables` (an ``EmbeddingBagCollection``) and the 13 dense features.

    Shapes: ``forward(dense_features (B, 13) float, sparse_features KJT with keys C1..)`` -> logits ``(B, 1)``.

    Args:
        num_embeddings: rows of every table, or one size per feature (:func:`criteo_tables`).
        dim: the embedding dim; ``dense_layers`` must end there.
        sparse_grad: the tables give sparse gradients (tables trained in the trainer: DDP all-reduces and
            Adagrad updates only the rows a step touched).
        tables_device: where the tables live; ``"meta"`` allocates nothing (shapes only), for tables that the
            ``parameter_servers`` pass moves and the servers initialise (:func:`scheduling.parameter_servers`).
        seed: if given, the tables are initialised from ``torch.manual_seed(seed)`` and the dense and over arches
            from ``torch.manual_seed(seed + 1)``, so the arches' weights do not depend on ``tables_device`` or
            on the table sizes; None: from the global generator as it stands.

    Returns:
        ``torchrec.models.dlrm.DLRM``; tables initialised as torchrec does (uniform in ``±sqrt(1 / rows)``).

    Raises:
        ValueError: ``dense_layers[-1] != dim`` (torchrec's interaction needs the dense arch to end at the
            embedding dim), or bad table sizes (:func:`criteo_tables`).
    """
    from torchrec.models.dlrm import DLRM

    if not dense_layers or dense_layers[-1] != dim:
        raise ValueError(f"criteo_dlrm: dense_layers must end at the embedding dim {dim}, got {list(dense_layers)}")
    tables = criteo_tables(num_embeddings, dim, num_tables)
    if seed is not None:
        torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables=tables, device=None if tables_device is None else torch.device(tables_device))
    for bag in ebc.embedding_bags.values():
        bag.sparse = sparse_grad
    if seed is not None:
        torch.manual_seed(seed + 1)
    return DLRM(embedding_bag_collection=ebc, dense_in_features=CRITEO_DENSE,
                dense_arch_layer_sizes=list(dense_layers), over_arch_layer_sizes=list(over_layers))


def criteo_kjt(sparse: torch.Tensor) -> Any:
    """``(B, 26)`` ids -> torchrec ``KeyedJaggedTensor`` with keys ``C1..C26``, one id per bag.

    Raises:
        ValueError: ``sparse`` is not ``(B, 26)``.
    """
    if sparse.dim() != 2 or sparse.shape[1] != CRITEO_SPARSE:
        raise ValueError(f"criteo_kjt: expected ids of shape (B, {CRITEO_SPARSE}), got {tuple(sparse.shape)}")
    return KeyedJaggedTensor(keys=[f"C{i + 1}" for i in range(CRITEO_SPARSE)], values=sparse.t().reshape(-1),
                             lengths=torch.ones(sparse.numel(), dtype=torch.int32))


def criteo_batches(path: str | Path, batch_size: int, num_embeddings: int = 1000,
                   num_tables: int = CRITEO_SPARSE, limit: int | None = None,
                   ) -> Iterator[tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]]:
    """Batches ``(dense (B, 13) float, kjt with keys C1.., labels (B,) float)`` from the Criteo TSV.

    The job's parser and ids (:func:`recsys.criteo_shard.read_file`, :mod:`recsys.criteo_format`): dense values
    become ``log(1 + max(x, 0))`` (empty: 0); categorical feature ``j``'s value is hashed into ``[1,
    num_embeddings)`` (:func:`recsys.criteo_format.hash_ids`), an empty one is an empty bag. The last partial
    batch is dropped; ``limit``: read at most that many rows.

    Raises:
        ValueError: a malformed line, e.g. without 40 columns (a :class:`recsys.criteo_format.DataError` naming
            the file and line).
        FileNotFoundError: no file at ``path``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Criteo file not found at {path}")
    dense, sparse, labels = read_file(path, num_embeddings, limit=limit)
    keys = [f"C{i}" for i in range(1, num_tables + 1)]
    for lo in range(0, len(labels) - batch_size + 1, batch_size):
        ids = sparse[lo:lo + batch_size, :num_tables].t().reshape(-1)  # key-major, as the KJT's bags
        kjt = KeyedJaggedTensor(keys=keys, values=ids[ids > 0], lengths=(ids > 0).to(torch.int32))
        yield dense[lo:lo + batch_size], kjt, labels[lo:lo + batch_size]
