"""Criteo lines and table sizes for the reader tests."""

from __future__ import annotations

from recsys.criteo_format import NUM_DENSE, NUM_SPARSE

SIZES = [50 + 7 * j for j in range(NUM_SPARSE)]
"""26 different table sizes (50, 57, ...)."""


def criteo_line(label="1", ints=None, cats=None):
    """One Criteo line (with its ``\\n``): ``label``, 13 ints (default ``0..12``), 26 hex ids (default ``j`` as 8 hex
    digits)."""
    ints = ints if ints is not None else [str(i) for i in range(NUM_DENSE)]
    cats = cats if cats is not None else [f"{j:08x}" for j in range(NUM_SPARSE)]
    return "\t".join([label, *ints, *cats]) + "\n"
