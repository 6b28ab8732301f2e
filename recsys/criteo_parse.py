"""Vectorised parsing of a chunk of Criteo lines: numpy over the chunk's bytes, not Python per field.

:func:`parse_chunk` takes the bytes of whole lines (a chunk cut at a newline) and returns the valid lines'
features as arrays plus the malformed lines by reason, with exactly the rules of
:func:`recsys.criteo_format.parse_line` (the module docstring of :mod:`recsys.criteo_format` lists them).

A chunk is first offered to Arrow's multithreaded CSV reader (:mod:`recsys.criteo_arrow`), which answers only
when every line is valid and its reading provably equals this module's; any other chunk (and every chunk with
``engine="numpy"`` or without pyarrow) is parsed here. How:

1. line bounds from the ``\\n`` positions; a line is blank when it has only ASCII whitespace (skipped, not
   counted), and trailing ``\\r`` are dropped (as ``str.rstrip("\\r\\n")``);
2. lines with a non-ASCII or NUL byte, or an integer of more than 18 digits (whose int64 range needs an exact
   check) take the per-line path (:func:`recsys.criteo_format.parse_fields`); they are rare in real logs;
3. the others: per-line tab counts from a prefix sum (not 39 tabs: ``field_count``), then the 40 field
   bounds of every line as a ``(n, 40)`` matrix; digit / hex checks are prefix sums of a byte class over
   the chunk, so each field is checked in O(1); values are accumulated column by column over right-aligned
   ``(n * F, W)`` gathers of the field bytes (W: the widest field of the chunk, 8 for Criteo's ids);
4. a line's reason is the first failing check in parse_line's order (label, I1..I13, C1..C26).

Categorical values come back as their numeric value (``uint64``, the hex digits read as a number) with a
``present`` mask; :func:`recsys.criteo_format.hash_ids` maps them into each feature's table (``1 + mix64(v, j) %
(size_j - 1)``, 0 = missing) and :func:`recsys.criteo_format.parse_line` uses the same hash, so both paths give
the same ids.

Shapes: ``dense (n, 13) float32``, ``values (n, 26) uint64``, ``present (n, 26) bool``, ``labels (n,)
float32``, ``lines (n,) int64`` (each valid row's line index in the chunk, 0-based).

Source: the Criteo Kaggle format (see :mod:`recsys.criteo_format`, which also holds the id hash: splitmix64's
finaliser, Steele et al., "Fast splittable pseudorandom number generators", OOPSLA 2014).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from recsys.criteo_arrow import available, parse_clean_chunk
from recsys.criteo_format import NUM_DENSE, NUM_SPARSE, MalformedLine, hex_values, parse_fields, right_aligned

__all__ = ["ParsedChunk", "parse_chunk", "REASONS", "ENGINES"]

TABS = NUM_DENSE + NUM_SPARSE
REASONS = ("nul_byte", "field_count", "label", "integer_feature", "integer_range", "categorical_feature",
           "encoding")


def _lut(chars: bytes | range, value: bool = True) -> np.ndarray:
    table = np.full(256, not value)
    table[list(chars)] = value
    return table


_WHITESPACE = _lut(b" \t\n\r\x0b\x0c")
_SPECIAL = _lut(range(0x80, 0x100)) | _lut(b"\x00")


@dataclass
class ParsedChunk:
    """The valid lines of a chunk as arrays (see the module docstring for shapes) and its malformed lines."""

    dense: np.ndarray
    values: np.ndarray
    present: np.ndarray
    labels: np.ndarray
    lines: np.ndarray
    """Line index (0-based, in the chunk) of each valid row."""
    line_count: int = 0
    """Lines in the chunk, blank ones included."""
    malformed: Counter = field(default_factory=Counter)
    """reason -> count."""
    malformed_lines: list[int] = field(default_factory=list)
    """Line indices of the first few malformed lines (for the report's examples)."""

    def __len__(self) -> int:
        return self.labels.shape[0]


def _line_bounds(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of every line, ``end`` before the ``\\n``; a last line without one counts too."""
    nl = np.flatnonzero(a == 10)
    ends = nl if (len(a) == 0 or a[-1] == 10) else np.append(nl, len(a))
    starts = np.concatenate(([0], nl + 1))[: len(ends)]
    return starts, ends


def _in_lines(positions: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """How many of the sorted byte ``positions`` fall in each line ``[start, end)``."""
    return np.searchsorted(positions, ends) - np.searchsorted(positions, starts)


_DIGIT = _lut(b"0123456789")
_HEX = _lut(b"0123456789abcdefABCDEF")


def _integers(a: np.ndarray, s: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """I1..I13 of ``m`` lines: (ok ``(m, 13)``: empty or ``-?[0-9]+``; long ``(m,)``: a line with a field of
    more than 18 digits, to redo per line; dense ``(m, 13)`` float32 ``log1p(max(x, 0))``)."""
    n = e - s
    neg = (n > 0) & (a[np.minimum(s, len(a) - 1)] == 45)
    digits = n - neg
    long = (digits > 18).any(axis=1)
    short = (n > 0) & (digits <= 18)
    width = max(1, int(digits[short].max()) if short.any() else 1)
    g = right_aligned(a, e[short], digits[short], width, 48)
    ok = n == 0
    ok[short] = (digits[short] >= 1) & _DIGIT[g].all(axis=1)
    x = np.zeros(s.shape, np.int64)  # no BLAS product: it would spin up threads for a (m, <= 18) matrix
    x[short] = ((g - np.uint8(48)).astype(np.int64) * 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)).sum(axis=1)
    dense = np.log1p(np.where(neg, 0, x).astype(np.float64)).astype(np.float32)
    return ok, long, dense


def _categoricals(a: np.ndarray, s: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """C1..C26 of ``m`` lines: (ok ``(m, 26)``: empty or 1 to 16 hex digits; values ``(m, 26)`` uint64;
    present ``(m, 26)``; :func:`recsys.criteo_format.hex_values`)."""
    n = e - s
    present = n > 0
    fits = present & (n <= 16)
    width = max(1, int(n[fits].max()) if fits.any() else 1)
    width += width % 2
    g = right_aligned(a, e[fits], n[fits], width, 48)
    ok = ~present
    ok[fits] = _HEX[g].all(axis=1)
    values = np.zeros(s.shape, np.uint64)
    values[fits] = hex_values(g)
    return ok, values, present


def _parse_fast(a: np.ndarray, starts: np.ndarray, ends: np.ndarray, tab_pos: np.ndarray) -> tuple:
    """Lines with 39 tabs and only ASCII bytes: (reason code per line, -1 = valid; dense, values, present,
    labels of all lines; ``slow``: lines with a > 18-digit integer, to redo per line)."""
    m = len(starts)
    tabs = tab_pos[np.searchsorted(tab_pos, starts)[:, None] + np.arange(TABS)]
    fs = np.concatenate([starts[:, None], tabs + 1], axis=1)
    fe = np.concatenate([tabs, ends[:, None]], axis=1)
    first = a[np.minimum(fs[:, 0], len(a) - 1)]
    label_ok = (fe[:, 0] - fs[:, 0] == 1) & ((first == 48) | (first == 49))
    int_ok, slow, dense = _integers(a, fs[:, 1:14], fe[:, 1:14])
    cat_ok, values, present = _categoricals(a, fs[:, 14:], fe[:, 14:])
    reason = np.full(m, -1, np.int64)
    reason[~cat_ok.all(axis=1)] = REASONS.index("categorical_feature")
    reason[~int_ok.all(axis=1)] = REASONS.index("integer_feature")
    reason[~label_ok] = REASONS.index("label")
    return reason, dense, values, present, (first == 49).astype(np.float32), slow


ENGINES = ("auto", "numpy")
"""``auto``: Arrow's reader (:mod:`recsys.criteo_arrow`) for chunks of valid lines, this module's parser for the
others and where pyarrow is missing; ``numpy``: this module's parser only (the reference, and the benchmark's
"before")."""


def parse_chunk(buf: bytes, select: Callable[[np.ndarray], np.ndarray] | None = None,
                examples: int = 5, engine: str = "auto") -> ParsedChunk:
    """Parse the lines in ``buf`` (whole lines; see the module docstring).

    Args:
        buf: Bytes of whole lines (the last one may lack its ``\\n``).
        select: ``select(line_indices) -> bool mask``: only these lines are parsed and counted (a trainer's
            share of a chunk); None = every line.
        examples: How many malformed line indices to keep in ``malformed_lines``.
        engine: One of :data:`ENGINES`; both give the same arrays.

    Returns:
        A :class:`ParsedChunk`; never raises for any content of ``buf``.

    Raises:
        ValueError: an unknown ``engine``.
    """
    if engine not in ENGINES:
        raise ValueError(f"parse_chunk: engine must be one of {ENGINES}, got {engine!r}")
    clean = parse_clean_chunk(buf) if engine == "auto" and available() else None
    if clean is not None:
        count = len(clean[3])
        rows = np.arange(count) if select is None else np.flatnonzero(np.asarray(select(np.arange(count)), bool))
        dense, values, present, labels = clean
        return ParsedChunk(dense[rows], values[rows], present[rows], labels[rows], rows, count)
    return _parse_strict(buf, select, examples)


def _parse_strict(buf: bytes, select: Callable[[np.ndarray], np.ndarray] | None, examples: int) -> ParsedChunk:
    a = np.frombuffer(buf, np.uint8)
    starts, ends = _line_bounds(a)
    count = len(starts)
    keep = np.ones(count, bool) if select is None else np.asarray(select(np.arange(count)), bool)
    maybe_blank = keep & ((ends == starts) | _WHITESPACE[a[np.minimum(starts, max(len(a) - 1, 0))]] if len(a) else keep)
    for i in np.flatnonzero(maybe_blank).tolist():
        keep[i] = bool(buf[starts[i]:ends[i]].strip())
    while len(a):  # drop trailing \r, as str.rstrip("\r\n")
        cr = (ends > starts) & (a[np.maximum(ends - 1, 0)] == 13)
        if not cr.any():
            break
        ends = ends - cr
    slow = keep & (_in_lines(np.flatnonzero(_SPECIAL[a]), starts, ends) > 0)
    tab_pos = np.flatnonzero(a == 9)
    ntabs = _in_lines(tab_pos, starts, ends)
    reason = np.full(count, -2, np.int64)  # -2 = not parsed
    reason[keep & ~slow & (ntabs != TABS)] = REASONS.index("field_count")
    fast = np.flatnonzero(keep & ~slow & (ntabs == TABS))
    dense = np.zeros((count, NUM_DENSE), np.float32)
    values = np.zeros((count, NUM_SPARSE), np.uint64)
    present = np.zeros((count, NUM_SPARSE), bool)
    labels = np.zeros(count, np.float32)
    if len(fast):
        r, d, v, p, y, redo = _parse_fast(a, starts[fast], ends[fast], tab_pos)
        reason[fast], dense[fast], values[fast], present[fast], labels[fast] = r, d, v, p, y
        slow[fast[redo]] = True
    for i in np.flatnonzero(slow).tolist():
        raw = buf[starts[i]:ends[i]]
        try:
            d, v, y = parse_fields(raw.decode("utf-8"))
        except UnicodeDecodeError:
            reason[i] = REASONS.index("encoding")
        except MalformedLine as err:
            reason[i] = REASONS.index(err.reason)
        else:
            reason[i] = -1
            dense[i], labels[i] = d, y
            present[i] = [x is not None for x in v]
            values[i] = [x or 0 for x in v]
    valid = np.flatnonzero(reason == -1)
    bad = np.flatnonzero(reason >= 0)
    codes = np.bincount(reason[bad], minlength=len(REASONS))
    malformed = Counter({REASONS[k]: int(c) for k, c in enumerate(codes) if c})
    return ParsedChunk(dense[valid], values[valid], present[valid], labels[valid], valid, count, malformed,
                       bad[:examples].tolist())
