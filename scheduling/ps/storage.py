"""How a parameter server stores embedding rows: fp32, fp16, or FBGEMM's fused 8-bit row-wise form.

Servers hold the tables, and for Criteo-size models the tables are most of a job's memory. Storing rows in
reduced precision cuts a server's memory while lookups still answer float32 and the optimizer still works in
float32 on the rows a push touches (gather, decode, update, encode, scatter back). The optimizer state stays
as it is (row-wise Adagrad's one fp32 accumulator per row).

===============  ==========================  ===============================================================
storage          bytes per row of ``D``       encoding
===============  ==========================  ===============================================================
``"fp32"``       ``4 D``                     as is (the default; bit-identical to the float path)
``"fp16"``       ``2 D``                     ``torch.float16``, round to nearest
``"fused8bit"``  ``D + 8``                   FBGEMM's fused 8-bit row-wise format: ``D`` uint8 codes then the
                                             row's fp32 scale and bias (``FloatToFused8BitRowwiseQuantized``);
                                             an update is re-encoded with stochastic rounding (below)
===============  ==========================  ===============================================================

Stochastic rounding for 8-bit rows: an update smaller than a row's quantization step (``(max - min) / 255``)
would round back to the same code every time and be lost, so updated rows are encoded with
``code = floor((w - bias) / scale + u)``, ``u ~ U[0, 1)`` (unbiased in expectation), from a generator seeded
per server, so a run is reproducible. Lookups decode with FBGEMM's ``Fused8BitRowwiseQuantizedToFloat``.

Source: FBGEMM fused 8-bit row-wise quantization (``fbgemm_gpu`` quantize ops, used by torchrec's quantized
EmbeddingBagCollection); stochastic rounding for low-precision embedding training (FBGEMM's
``stochastic_rounding`` option of its split-table-batched embeddings; Gupta et al., "Deep Learning with
Limited Numerical Precision", ICML 2015).
"""

from __future__ import annotations

import torch

__all__ = ["RowStore", "STORAGES", "make_store"]

STORAGES = ("fp32", "fp16", "fused8bit")


class RowStore:
    """Encodes, decodes and updates the rows of one storage kind. Shapes: float rows ``(N, D)`` float32;
    stored rows ``(R, D)`` (fp32/fp16) or ``(R, D + 8)`` uint8 (fused8bit)."""

    name = "fp32"

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """Float rows ``(N, D)`` -> stored rows."""
        return rows.float()

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        """Stored rows -> float32 ``(N, D)``."""
        return stored

    def gather(self, stored: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Float32 values ``(N, D)`` of rows ``rows`` ``(N,)`` int64."""
        return self.decode(stored.index_select(0, rows))

    def apply(self, stored: torch.Tensor, rows: torch.Tensor, update: torch.Tensor, lr: float) -> None:
        """``stored[rows] -= lr * update`` for unique ``rows`` ``(U,)``, ``update`` ``(U, D)`` float32: gather,
        update in float32, scatter back (half the time of ``index_add_``, which also handles repeated rows)."""
        stored.index_copy_(0, rows, self._reencode(self.gather(stored, rows).sub_(update, alpha=lr)))

    def _reencode(self, rows: torch.Tensor) -> torch.Tensor:
        return self.encode(rows)

    def bytes_per_row(self, dim: int) -> int:
        """Stored bytes of one row of width ``dim``."""
        return 4 * dim


class _FP16(RowStore):
    name = "fp16"

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.to(torch.float16)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        return stored.float()

    def bytes_per_row(self, dim: int) -> int:
        return 2 * dim


class _Fused8Bit(RowStore):
    name = "fused8bit"

    def __init__(self, seed: int = 0) -> None:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

        self.generator = torch.Generator().manual_seed(seed)

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(rows.float().contiguous())

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        return torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(stored.contiguous())

    def _reencode(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows -> fused 8-bit with stochastic rounding, in FBGEMM's layout (codes, then fp32 scale, bias)."""
        lo, hi = rows.min(dim=1, keepdim=True).values, rows.max(dim=1, keepdim=True).values
        scale = ((hi - lo) / 255.0).clamp_min(1e-8)
        noise = torch.rand(rows.shape, generator=self.generator)
        codes = ((rows - lo) / scale + noise).floor_().clamp_(0, 255).to(torch.uint8)
        tail = torch.cat([scale, lo], dim=1).contiguous().view(torch.uint8)      # (N, 8): fp32 scale, bias
        return torch.cat([codes, tail], dim=1)

    def bytes_per_row(self, dim: int) -> int:
        return dim + 8


def make_store(name: str, seed: int = 0) -> RowStore:
    """The :class:`RowStore` of ``name`` (one of :data:`STORAGES`).

    Raises:
        ValueError: an unknown storage name.
    """
    if name == "fp32":
        return RowStore()
    if name == "fp16":
        return _FP16()
    if name == "fused8bit":
        return _Fused8Bit(seed)
    raise ValueError(f"unknown row storage {name!r}; use one of {', '.join(STORAGES)}")
