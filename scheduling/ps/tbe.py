"""A server's stacked tables on FBGEMM's CPU table-batched embedding kernel, with the optimizer fused into its
backward, as torchrec's fused kernel runs them.

:class:`~scheduling.ps.fused.FusedTables` stacks one namespace's shards into one ``(R, D)`` weight; where FBGEMM
has a kernel for that layout (float32 rows, ``"sgd"`` or ``"rowwise_adagrad"``), :class:`TBEKernel` makes
FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` (one table per shard, ``EmbeddingLocation.HOST`` on
``ComputeDevice.CPU``) own that weight and the row-wise Adagrad accumulators: a lookup is one forward of the
kernel, a push one forward and one backward, whose fused optimizer updates the touched rows in place
(``EmbOptimType.EXACT_SGD`` / ``EXACT_ROWWISE_ADAGRAD``: the formulas of :mod:`scheduling.ps.optimizer`).
Elsewhere (fp16 or fused 8-bit rows) the server keeps fxdist's own ``index_select`` / ``index_add_`` path.

The rows summed by FBGEMM come in another order than fxdist's own path sums them, so the two agree to float32
rounding, not bit for bit.

Which one a server runs: ``FXDIST_PS_KERNEL`` in its environment, ``"fxdist"`` (the default) or ``"fbgemm"``.
Measured with benchmarks/server_kernel.py on a 2-core AMD EPYC (AVX-512), one thread, 26 tables, batch 256:
FBGEMM's CPU kernel ran a lookup + push at 0.56-1.03x the speed of fxdist's own stacked path (a push runs the
kernel's forward again before its fused backward: the public API has no backward without it), so fxdist's path
stays the default until a machine measures otherwise.

Source: FBGEMM ``fbgemm_gpu.split_table_batched_embeddings_ops_training.SplitTableBatchedEmbeddingBagsCodegen``;
torchrec ``EmbeddingBagCollectionSharder`` fused parameters.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["TBEKernel", "kernel_for", "KERNEL_ENV"]

KERNEL_ENV = "FXDIST_PS_KERNEL"
"""Environment variable choosing the servers' kernel: ``"fxdist"`` (default) or ``"fbgemm"`` (where it applies)."""


def kernel_for(optimizer: Any, store: Any, dim: int, rows: list[int], feature_tables: list[int],
               ) -> "TBEKernel | None":
    """FBGEMM's kernel for tables of ``rows`` rows and dimension ``dim`` with ``optimizer`` (``feature_tables``:
    the table pooling each output feature), or None where it does not apply (rows not stored as float32, another
    optimizer, FBGEMM missing, or not chosen by :data:`KERNEL_ENV`)."""
    if os.environ.get(KERNEL_ENV, "fxdist") != "fbgemm" or getattr(store, "name", "fp32") != "fp32":
        return None
    if getattr(optimizer, "name", None) not in ("sgd", "rowwise_adagrad") or dim % 4:
        return None
    try:
        return TBEKernel(optimizer, dim, rows, feature_tables)
    except ImportError:
        return None


class TBEKernel:
    """FBGEMM's CPU kernel over tables of ``rows`` rows each, all of dimension ``dim``.

    :attr:`weight` ``(sum(rows), dim)`` and :attr:`state` ``(sum(rows),)`` (row-wise Adagrad; None for SGD) are
    the kernel's own storage: the tables stacked in order, as ``FusedTables`` stacks its shards. Output feature
    ``f`` is pooled by table ``feature_tables[f]``.

    Raises:
        ImportError: fbgemm_gpu is not installed.
    """

    def __init__(self, optimizer: Any, dim: int, rows: list[int], feature_tables: list[int]) -> None:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        adagrad = optimizer.name == "rowwise_adagrad"
        kind = EmbOptimType.EXACT_ROWWISE_ADAGRAD if adagrad else EmbOptimType.EXACT_SGD
        extra = {"eps": optimizer.eps} if adagrad else {}
        self.dim, self.rows = dim, list(rows)
        self.module = SplitTableBatchedEmbeddingBagsCodegen(
            [(n, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for n in rows],
            feature_table_map=list(feature_tables), optimizer=kind,
            learning_rate=optimizer.lr, pooling_mode=PoolingMode.SUM, **extra)
        self.weight = self.module.weights_host.detach().view(-1, dim)  # the kernel's storage, no autograd
        self.state: torch.Tensor | None = None
        if adagrad:
            state = self.module.momentum1_host.detach()
            state.fill_(float(optimizer.initial_accumulator_value))
            self.state = state
        self._features = len(feature_tables)

    def _inputs(self, local: torch.Tensor, bags: torch.Tensor, weights: torch.Tensor | None,
                batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """FBGEMM's ``(indices, offsets, per_sample_weights)`` from per-id table-local rows and output bags."""
        if bags.numel() > 1 and not bool((bags[1:] >= bags[:-1]).all()):
            order = torch.argsort(bags, stable=True)
            local, bags = local.index_select(0, order), bags.index_select(0, order)
            weights = weights.index_select(0, order) if weights is not None else None
        counts = torch.bincount(bags, minlength=self._features * batch_size)
        offsets = torch.zeros(counts.numel() + 1, dtype=torch.long)
        torch.cumsum(counts, 0, out=offsets[1:])
        return local, offsets, (weights.float() if weights is not None else None)

    def lookup(self, local: torch.Tensor, bags: torch.Tensor, weights: torch.Tensor | None,
               batch_size: int) -> torch.Tensor:
        """Pooled sums ``(B, F * D)``, feature ``f``'s columns at ``f * D``."""
        indices, offsets, psw = self._inputs(local, bags, weights, batch_size)
        with torch.no_grad():
            return self.module(indices, offsets, per_sample_weights=psw)

    def push(self, local: torch.Tensor, bags: torch.Tensor, weights: torch.Tensor | None, batch_size: int,
             grad: torch.Tensor) -> None:
        """Apply the lookup output's gradient ``grad`` ``(B, F * D)``: the fused optimizer updates the rows."""
        indices, offsets, psw = self._inputs(local, bags, weights, batch_size)
        with torch.enable_grad():
            out = self.module(indices, offsets, per_sample_weights=psw)
            out.backward(grad.to(out.dtype))
