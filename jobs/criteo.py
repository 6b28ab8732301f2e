"""The built-in model: torchrec's DLRM on Criteo, one ``EmbeddingBagCollection`` table per categorical feature.

``fxdist launch`` with no ``[model] factory`` trains :func:`dlrm`, ``torchrec.models.dlrm.DLRM`` built from
the ``[model]`` keys: an ``EmbeddingBagCollection`` of 26 tables ``t_C1 .. t_C26`` (feature ``Cj`` looked up in
``t_Cj``, ``embedding_dim`` columns, rows from :func:`table_sizes`), a dense arch ``13 -> bottom_mlp ->
embedding_dim`` and an over arch ``top_mlp -> 1``. It goes through the same path as your model
(:mod:`jobs.trainer.workload`): with parameter servers, each phase's module gets the ``scheduling.parameter_servers``
pass, which moves the 26 tables to the servers, then the optimized phase's passes. With servers the tables are
built on the ``meta`` device and the servers initialise them, so no trainer allocates them.

A Criteo :class:`~recsys.criteo_format.Batch` becomes the model's inputs with :func:`model_inputs`: the ``(B, 26)``
hashed ids become a ``KeyedJaggedTensor`` with one id per bag (:func:`to_kjt`).

Shapes: ``dense (B, 13) float32``, ``sparse`` a ``KeyedJaggedTensor`` (keys ``C1..C26``, ``B`` bags each) ->
logits ``(B, 1)``. With ``F = 27`` features (the dense arch's output and 26 pooled embeddings) the interaction
has ``F * (F - 1) / 2 = 351`` dot products, so the over arch's input is ``embedding_dim + 351`` wide.

Source: Naumov et al., "Deep Learning Recommendation Model for Personalization and Recommendation Systems" (2019),
§2; ``torchrec.models.dlrm.DLRM`` (DenseArch / SparseArch / InteractionArch / OverArch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from jobs import table_sizes
from recsys.criteo_format import NUM_SPARSE, Batch

__all__ = ["FEATURES", "dlrm", "to_kjt", "model_inputs"]

FEATURES = tuple(f"C{j + 1}" for j in range(NUM_SPARSE))
"""The categorical features, in the Criteo column order: the ``KeyedJaggedTensor`` keys."""


def dlrm(config: Any, sizes: Sequence[int] | None = None, *, sparse_grad: bool = True,
         tables_device: str | torch.device | None = None) -> nn.Module:
    """torchrec's DLRM of the ``[model]`` keys (:func:`recsys.criteo.criteo_dlrm`), seeded by ``[job] seed``.

    Args:
        config: the job config (:class:`jobs.config.JobConfig`).
        sizes: rows per table, in :data:`FEATURES` order (default :func:`table_sizes`).
        sparse_grad: the tables give sparse gradients (tables kept in the trainers: DDP all-reduces only the rows
            a step touched, and Adagrad updates only those).
        tables_device: ``"meta"`` for tables the ``parameter_servers`` pass moves: the trainer allocates none of
            their memory, and the servers initialise them (same distribution, seeded by ``[job] seed``).

    Returns:
        ``torchrec.models.dlrm.DLRM``; the same weights on every call with the same seed (the arches' weights
        do not depend on ``sizes`` or ``tables_device``).

    Raises:
        ValueError: ``sizes`` does not have one positive size per feature (:func:`recsys.criteo.criteo_tables`).
    """
    from recsys.criteo import criteo_dlrm  # imports torchrec: only when the model is built

    m = config.model
    sizes = table_sizes.sizes(config) if sizes is None else [int(n) for n in sizes]
    return criteo_dlrm(sizes, m.embedding_dim, NUM_SPARSE, dense_layers=[*m.bottom_mlp, m.embedding_dim],
                       over_layers=[*m.top_mlp, 1], sparse_grad=sparse_grad, tables_device=tables_device,
                       seed=config.job.seed)


def to_kjt(ids: torch.Tensor) -> Any:
    """``(B, 26)`` int64 ids -> a ``KeyedJaggedTensor`` with keys :data:`FEATURES`, one id per bag (key-major).

    Raises:
        ValueError: ``ids`` is not ``(B, 26)``.
    """
    from recsys.criteo import criteo_kjt  # imports torchrec: only when a batch is made

    return criteo_kjt(ids)


def model_inputs(batch: Batch) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """A Criteo batch as the job's batch contract (:mod:`jobs.entry`): ``(dense, kjt, labels)``."""
    return batch.dense, to_kjt(batch.sparse), batch.labels
