"""The fast path of the Criteo chunk parser: Apache Arrow's multithreaded CSV reader (``pyarrow.csv``) for chunks
whose every line is well formed.

Real click logs are almost all clean lines, and the strict numpy parser (:mod:`recsys.criteo_parse`) spends its
time finding the 40 fields of each line. Arrow's reader splits and converts the fields in C++ on every core, so a
chunk is first offered to it under conditions that make its result provably the strict parser's:

1. the chunk holds only the bytes a valid line can hold: ``0-9 a-f A-F - \\t \\n`` (no NUL, no non-ASCII, no
   ``\\r``, no spaces, no ``+``, ``x``, ``.``: Arrow's integer conversion would accept ``" 3"`` and ``"0x1"``,
   the strict rules do not);
2. Arrow finds 40 fields on every line (a blank line or one with another field count is an *invalid row*, which
   sends the chunk back);
3. the label is exactly ``0`` or ``1``; ``I1..I13`` convert to int64 (``-?[0-9]+``, empty = missing; any
   conversion error, such as a hex letter or an int64 overflow, sends the chunk back); ``C1..C26`` are at most 16
   hex digits (with condition 1, a field without ``-``).

Any other chunk returns None and is parsed line by line by the strict parser, which names each malformed line's
reason. Both give the same arrays, bit for bit (the tests compare them on clean and corrupted chunks).

Shapes: ``dense (n, 13) float32`` (``log1p(max(x, 0))``), ``values (n, 26) uint64`` (hex digits read as a
number), ``present (n, 26) bool``, ``labels (n,) float32``; ``n`` = the chunk's lines.

Source: Apache Arrow, ``pyarrow.csv.read_csv`` (ReadOptions, ParseOptions ``invalid_row_handler``,
ConvertOptions) in the PyArrow API reference.
"""

from __future__ import annotations

import functools
import io
from typing import Any

import numpy as np

from recsys.criteo_format import NUM_DENSE, NUM_SPARSE, hex_values, right_aligned

__all__ = ["parse_clean_chunk", "available"]

_NAMES = ["label", *(f"I{j + 1}" for j in range(NUM_DENSE)), *(f"C{j + 1}" for j in range(NUM_SPARSE))]
_ALLOWED = b"0123456789abcdefABCDEF-\t\n"


@functools.cache
def available() -> bool:
    """Whether pyarrow (with its CSV reader) can be imported here (imported on the first call, not on import)."""
    try:
        import pyarrow.csv  # noqa: F401
    except ImportError:
        return False
    return True


def _options() -> tuple[Any, Any, Any, list[bool]]:
    import pyarrow as pa
    import pyarrow.csv as csv

    invalid: list[bool] = []

    def on_invalid(row: Any) -> str:
        invalid.append(True)
        return "skip"

    read = csv.ReadOptions(column_names=_NAMES, use_threads=True, block_size=1 << 20)
    parse = csv.ParseOptions(delimiter="\t", quote_char=False, double_quote=False, escape_char=False,
                             newlines_in_values=False, ignore_empty_lines=False, invalid_row_handler=on_invalid)
    types = {"label": pa.binary(), **{n: pa.int64() for n in _NAMES[1:1 + NUM_DENSE]},
             **{n: pa.binary() for n in _NAMES[1 + NUM_DENSE:]}}
    convert = csv.ConvertOptions(column_types=types, null_values=[""], strings_can_be_null=False,
                                 quoted_strings_can_be_null=False)
    return read, parse, convert, invalid


def _binary(column: Any) -> tuple[np.ndarray, np.ndarray]:
    """(offsets ``(n + 1,)`` int64, data bytes) of a binary table column (a ChunkedArray, combined)."""
    array = column.combine_chunks()
    _, offsets, data = array.buffers()
    off = np.frombuffer(offsets, np.int32, count=len(array) + 1, offset=array.offset * 4).astype(np.int64)
    return off, (np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8))


def _hex_values(off: np.ndarray, data: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(values ``(n,)`` uint64, present ``(n,)``) of one categorical column, None if a field is too long."""
    lengths = np.diff(off)
    present = lengths > 0
    values = np.zeros(len(lengths), np.uint64)
    if not present.any():
        return values, present
    width = int(lengths.max())
    if width > 16 or (data[off[0]:off[-1]] == 45).any():  # 45: "-", the one non-hex byte a field may hold here
        return None
    if width == 8 and (lengths[present] == 8).all():  # Criteo's 32-bit ids: the data is an (m, 8) matrix
        g = data[off[0]:off[-1]].reshape(-1, 8)
    else:
        g = right_aligned(data, off[1:][present], lengths[present], 16, 48)
    values[present] = hex_values(g)
    return values, present


def parse_clean_chunk(buf: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """``(dense, values, present, labels)`` of every line of ``buf`` (whole lines, the last one may lack its
    ``\\n``) when all of them are valid Criteo lines (see the module docstring), else None.

    Never raises for any content of ``buf``; raises ImportError when pyarrow is missing (see :func:`available`).
    """
    if not buf or buf.translate(None, _ALLOWED):
        return None
    import pyarrow as pa
    import pyarrow.csv as csv

    read, parse, convert, invalid = _options()
    try:
        table = csv.read_csv(io.BytesIO(buf), read_options=read, parse_options=parse, convert_options=convert)
    except pa.ArrowInvalid:
        return None
    if invalid:
        return None
    off, data = _binary(table.column("label"))
    if not (np.diff(off) == 1).all() or not ((data[off[0]:off[-1]] == 48) | (data[off[0]:off[-1]] == 49)).all():
        return None
    n = table.num_rows
    dense = np.empty((n, NUM_DENSE), np.float32)
    for j in range(NUM_DENSE):
        x = table.column(1 + j).to_numpy(zero_copy_only=False)
        x = np.nan_to_num(x.astype(np.float64), nan=0.0) if x.dtype != np.int64 else x
        dense[:, j] = np.log1p(np.maximum(x, 0).astype(np.float64)).astype(np.float32)
    values = np.empty((n, NUM_SPARSE), np.uint64)
    present = np.empty((n, NUM_SPARSE), bool)
    for j in range(NUM_SPARSE):
        got = _hex_values(*_binary(table.column(1 + NUM_DENSE + j)))
        if got is None:
            return None
        values[:, j], present[:, j] = got
    labels = (data[off[0]:off[-1]] == 49).astype(np.float32)
    return dense, values, present, labels
