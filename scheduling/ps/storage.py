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

import ctypes
import sys

import torch

from .dynamic_native import gather_rows, scatter_rows

__all__ = ["RowStore", "STORAGES", "make_store", "empty_rows"]

HUGE_PAGE = 2 << 20
"""Bytes of one x86-64 transparent huge page (Linux THP)."""
_MADV_HUGEPAGE = 14   # <linux/mman.h>


def empty_rows(num_rows: int, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialized CPU tensor ``(num_rows, width)`` for a server's rows, its memory advised for transparent huge
    pages (Linux ``madvise(MADV_HUGEPAGE)`` on its 2 MiB-aligned interior, before any page of it is touched) where
    it spans two huge pages or more (so that its interior holds one at least): a lookup or update touches rows at
    random, and with 4 KiB pages nearly every row is a TLB miss (measured on a 2-core AMD EPYC, 26 x 1e6 x 16
    float32 rows, 3,328 rows per request: gather 79 -> 60 us, SGD update 180 -> 120 us). The advice holds for pages
    not yet touched: all of them where the allocation is mapped afresh (glibc: from 32 MiB at most, its largest mmap
    threshold); memory reused from the heap keeps the pages it has. Where THP is off or unsupported the advice is a
    no-op.

    Source: Linux ``madvise(2)``; torch's own ``THP_MEM_ALLOC_ENABLE`` (c10/core/alloc_cpu.cpp) advises every
    large allocation of a process the same way, from the environment at start-up.
    """
    out = torch.empty(num_rows, width, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    if sys.platform == "linux" and nbytes >= 2 * HUGE_PAGE:
        start = -(-out.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (out.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            _madvise(start, end - start, _MADV_HUGEPAGE)
    return out


def _madvise(start: int, length: int, advice: int) -> None:
    """``madvise(start, length, advice)``; a failure (an old kernel, no THP) leaves the pages as they are."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise(start, length, advice)


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
        """Float32 values ``(N, D)`` of rows ``rows`` ``(N,)`` int64 (the stored rows gathered with prefetching:
        :func:`scheduling.ps.dynamic_native.gather_rows`, the bytes of ``index_select``).

        Raises:
            IndexError: a row outside the stored rows.
        """
        return self.decode(gather_rows(stored, rows))

    def apply(self, stored: torch.Tensor, rows: torch.Tensor, update: torch.Tensor, lr: float) -> None:
        """``stored[rows] -= lr * update`` for unique ``rows`` ``(U,)``, ``update`` ``(U, D)`` float32: gather,
        update in float32, scatter back (half the time of ``index_add_``, which also handles repeated rows)."""
        scatter_rows(stored, rows, self._reencode(self.gather(stored, rows).sub_(update, alpha=lr)))

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
