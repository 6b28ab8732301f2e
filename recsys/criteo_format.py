"""The Criteo click-log format: one line's fields and checks, the id hash, opening and listing data files.

A Criteo (Kaggle DAC) line is 40 tab-separated fields: the click label (0/1), 13 integer features
``I1..I13`` (counts, may be empty or negative) and 26 categorical features ``C1..C26`` (8 hex digits,
may be empty). Each line becomes

- ``dense``: 13 floats, ``log(1 + max(x, 0))``, empty -> 0;
- ``sparse``: 26 ids, feature ``j``'s value (its hex digits read as a number) hashed into ``[1,
  table_size_j)`` with a 64-bit mix (splitmix64's finaliser, salted by ``j``: stable across processes and
  runs, unlike Python's ``hash``; :func:`mix64`, :func:`hash_ids`); empty -> id 0 ("missing"). Every reader
  of the project uses this hash: the job's, :func:`recsys.criteo.criteo_batches` and ``quant``'s
  ``load_criteo``. ``table_size`` is one size for all 26 tables or one per feature (``[model] table_sizes``);
  a size of :data:`RAW_IDS` (0) keeps feature ``j``'s mixed value unreduced (``mix64(v, j)``'s low 63 bits, a
  non-negative int64: no modulo, so no collisions beyond the 63-bit mix) for a dynamic table
  (``scheduling.ps.dynamic``, ``[model] table_sizes = "dynamic"``);
- ``label``: 0.0 or 1.0.

Lines that do not parse are counted by reason and skipped; they never stop a job. Each field is checked
strictly, so that no single bad value can raise anything else (:func:`parse_line`):

- ``field_count``: not 40 tab-separated fields; ``label``: a label other than ``0``/``1``;
- ``integer_feature``: an ``I`` field that is not a plain ASCII decimal integer (``1.5``, ``nan``,
  ``inf``, ``1_000``, ``+3``, spaces); ``integer_range``: an integer outside int64. Negative counts
  are clamped to 0 before the log transform, as in DLRM's preprocessing (Criteo Kaggle has -1 and -2 in
  ``I2``);
- ``categorical_feature``: a ``C`` field that is not 1 to 16 hex digits. Criteo ids are 8 hex digits
  (32-bit hashes); up to 16 (64-bit ids of other Criteo-format exports) are accepted (``0a`` and ``a`` are
  the same value), anything longer or non-hex means a corrupt or shifted line;
- ``nul_byte``: a NUL character anywhere; ``encoding``: bytes that are not UTF-8.

Files may be plain, gzip, bz2 or xz-compressed, recognised by their first bytes (not their suffix) and
read transparently (:func:`open_data`). :func:`check_data_file` runs the launcher's cheap checks before
a job starts (a directory, an empty or unreadable file, an unsupported compression, no valid line near
the start), raising :class:`DataError`.

Shapes: a :class:`Batch` holds ``dense (B, 13) float32``, ``sparse (B, 26) int64``, ``labels (B,) float32``.

Split and shards: with ``eval_fraction = 1/k``, every k-th line of each file (line index ``k-1, 2k-1, ...``,
blank and malformed lines counted) is held out for evaluation; the training lines go to ``world_size``
trainers by file when there are at least as many files, else round-robin within each file
(:func:`recsys.criteo_shard.line_owner`). :class:`recsys.criteo_shard.CriteoShard` parses them into memory
with the vectorised parser (:mod:`recsys.criteo_parse`); the job streams them (:mod:`recsys.criteo_stream`).

Source: Criteo Kaggle Display Advertising Challenge format; DLRM (Naumov et al. 2019) preprocessing
(log transform of counts, hashed categorical ids); splitmix64's finaliser (Steele et al., "Fast splittable
pseudorandom number generators", OOPSLA 2014) as the 64-bit id mix.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import lzma
import math
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple, TypedDict

import numpy as np
import torch

__all__ = [
    "NUM_DENSE",
    "NUM_SPARSE",
    "NUM_FIELDS",
    "Batch",
    "DataError",
    "MalformedLine",
    "ParseStats",
    "READ_ERRORS",
    "RAW_IDS",
    "mix64",
    "raw_id",
    "hash_ids",
    "right_aligned",
    "hex_values",
    "parse_line",
    "parse_fields",
    "table_size_list",
    "open_data",
    "data_files",
    "check_data_file",
]

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE


class Batch(NamedTuple):
    dense: torch.Tensor
    """(B, 13) float32, log-transformed integer features."""
    sparse: torch.Tensor
    """(B, 26) int64, hashed categorical ids; 0 = missing."""
    labels: torch.Tensor
    """(B,) float32 click labels."""


class MalformedLine(ValueError):
    """A Criteo line that cannot be parsed; ``reason`` is a short key used for counting.

    See docs/troubleshooting.md#malformedline.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class DataError(ValueError):
    """A data file the job cannot use (missing, a directory, empty, unreadable, corrupt, or without any
    valid line); the message names the file and what is wrong. Deterministic: retrying cannot help.

    See docs/troubleshooting.md#dataerror.
    """


class ParseCounts(TypedDict):
    """:meth:`ParseStats.as_dict`: the counts as plain types (JSON)."""

    valid: int
    malformed: dict[str, int]
    examples: list[str]


@dataclass
class ParseStats:
    """What a reader saw: valid lines and malformed lines by reason."""

    valid: int = 0
    malformed: Counter = field(default_factory=Counter)
    """reason -> count, e.g. {"field_count": 2, "label": 1}."""
    examples: list[str] = field(default_factory=list)
    """Up to 5 "line N: reason: detail" strings, for the report."""

    @property
    def malformed_total(self) -> int:
        return sum(self.malformed.values())

    def record(self, lineno: int, error: MalformedLine) -> None:
        self.malformed[error.reason] += 1
        if len(self.examples) < 5:
            self.examples.append(f"line {lineno}: {error}")

    def as_dict(self) -> ParseCounts:
        return {"valid": self.valid, "malformed": dict(self.malformed), "examples": list(self.examples)}




_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1
RAW_IDS = 0
"""The table size that asks :func:`hash_ids` for raw ids (a dynamic table's: no modulo, :func:`raw_id`)."""
_GOLDEN = 0x9E3779B97F4A7C15


def mix64(values: int, table: int) -> int:
    """The 64-bit mix of categorical value ``values`` of table ``table`` (pure Python; see :func:`hash_ids`)."""
    z = (values + (table + 1) * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def raw_id(value: int, table: int) -> int:
    """The raw id of a dynamic table (size :data:`RAW_IDS`): :func:`mix64`'s low 63 bits, a non-negative int64
    (the dynamic store marks free slots with -1, so ids are kept non-negative)."""
    return mix64(value, table) & _MASK63


def hash_ids(values: np.ndarray, present: np.ndarray, sizes: Sequence[int]) -> np.ndarray:
    """Ids of categorical values in their tables: ``1 + mix64(v, j) % (sizes[j] - 1)``, 0 where missing; for a
    size of :data:`RAW_IDS` (a dynamic table) the raw id :func:`raw_id` instead (no modulo), 0 where missing.

    Shapes: ``values (n, T) uint64``, ``present (n, T) bool``, ``len(sizes) == T`` -> ``(n, T) int64``.
    """
    salt = (np.arange(1, values.shape[1] + 1, dtype=np.uint64) * np.uint64(_GOLDEN))
    with np.errstate(over="ignore"):
        z = values + salt
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    raw = np.asarray(sizes, dtype=np.int64) == RAW_IDS
    buckets = np.where(raw, 2, np.asarray(sizes, dtype=np.int64)).astype(np.uint64) - np.uint64(1)
    ids = np.where(raw, z & np.uint64(_MASK63), z % buckets + np.uint64(1)).astype(np.int64)
    ids[~present] = 0
    return ids


def right_aligned(a: np.ndarray, end: np.ndarray, length: np.ndarray, width: int, fill: int) -> np.ndarray:
    """The bytes of fields ``a[end - length:end]`` right-aligned in a ``(m, width)`` uint8 matrix, ``fill``
    before them (every ``length <= width``): rows of a sliding-window view, one index per field."""
    padded = np.concatenate([np.full(width, fill, np.uint8), a])
    out = np.lib.stride_tricks.sliding_window_view(padded, width)[end]
    out[np.arange(width) < (width - length)[:, None]] = fill
    return out


def hex_values(digits: np.ndarray) -> np.ndarray:
    """Categorical values: the hex digits of each row read as a number.

    Shapes: ``digits (m, W)`` uint8, right-aligned and padded with ``"0"`` (:func:`right_aligned`), ``W`` even and
    at most 16 -> ``(m,)`` uint64. A byte that is not a hex digit gives an unspecified value (callers check them).
    """
    nib = (digits & np.uint8(15)) + np.uint8(9) * (digits >> np.uint8(6))  # "0"-"9" -> 0-9, "a"-"f"/"A"-"F" -> 10-15
    packed = (nib[:, 0::2] << np.uint8(4)) | nib[:, 1::2]  # two digits per byte, most significant first
    if packed.shape[1] not in (4, 8):
        packed = np.concatenate([np.zeros((len(packed), 8 - packed.shape[1]), np.uint8), packed], axis=1)
    return np.ascontiguousarray(packed).view(f">u{packed.shape[1]}")[:, 0].astype(np.uint64)


_INTEGER = re.compile(r"-?[0-9]+")
_HEX_ID = re.compile(r"[0-9a-fA-F]{1,16}")
_INT64 = 2**63


def _dense(j: int, raw: str) -> float:
    """``log(1 + max(x, 0))`` of integer feature ``I<j+1>`` (empty -> 0)."""
    if not raw:
        return 0.0
    if not _INTEGER.fullmatch(raw):
        raise MalformedLine("integer_feature", f"I{j + 1} is not an integer: {raw[:20]!r}")
    if len(raw) > 20 or not -_INT64 <= (x := int(raw)) < _INT64:
        raise MalformedLine("integer_range", f"I{j + 1} is outside int64: {raw[:20]!r}...")
    return math.log1p(x) if x > 0 else 0.0


def parse_fields(line: str) -> tuple[list[float], list[int | None], float]:
    """Parse one Criteo TSV line into (13 dense floats, 26 categorical values, label); a categorical value is
    its hex digits read as a number, None when empty (before hashing: see :func:`parse_line`).

    Raises:
        MalformedLine: as :func:`parse_line`.
    """
    if "\x00" in line:
        raise MalformedLine("nul_byte", "the line contains a NUL character")
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != NUM_FIELDS:
        raise MalformedLine("field_count", f"expected {NUM_FIELDS} tab-separated columns (label, I1..I13, "
                                           f"C1..C26), got {len(fields)}")
    if fields[0] not in ("0", "1"):
        raise MalformedLine("label", f"label must be 0 or 1, got {fields[0][:20]!r}")
    dense = [_dense(j, raw) for j, raw in enumerate(fields[1 : 1 + NUM_DENSE])]
    cats = fields[1 + NUM_DENSE :]
    for j, raw in enumerate(cats):
        if raw and not _HEX_ID.fullmatch(raw):
            raise MalformedLine("categorical_feature", f"C{j + 1} is not 1 to 16 hex digits: {raw[:20]!r}")
    return dense, [int(raw, 16) if raw else None for raw in cats], float(fields[0])


def table_size_list(table_size: int | Sequence[int]) -> list[int]:
    """One size per categorical feature: ``[table_size] * 26`` for an int, else the 26 sizes given
    (:data:`RAW_IDS` for a dynamic table's raw ids).

    Raises:
        ValueError: not 26 sizes, or a size below 2 other than :data:`RAW_IDS`.
    """
    sizes = [table_size] * NUM_SPARSE if isinstance(table_size, int) else [int(s) for s in table_size]
    if len(sizes) != NUM_SPARSE or any(s < 2 and s != RAW_IDS for s in sizes):
        raise ValueError(f"table sizes: need {NUM_SPARSE} sizes of at least 2 rows (or {RAW_IDS}: raw ids of a "
                         f"dynamic table), got {sizes!r}")
    return sizes


def parse_line(line: str, table_size: int | Sequence[int]) -> tuple[list[float], list[int], float]:
    """Parse one Criteo TSV line into (13 dense floats, 26 ids, label); ids by :func:`mix64`, as :func:`hash_ids`.

    Args:
        table_size: Rows per table: one for all 26, or one per feature.

    Raises:
        MalformedLine: with ``reason`` one of "nul_byte", "field_count", "label", "integer_feature",
            "integer_range", "categorical_feature" (see the module docstring); nothing else, for any
            ``line``.
    """
    dense, values, label = parse_fields(line)
    sizes = table_size_list(table_size)
    sparse = [0 if v is None else raw_id(v, j) if sizes[j] == RAW_IDS else 1 + mix64(v, j) % (sizes[j] - 1)
              for j, v in enumerate(values)]
    return dense, sparse, label


_MAGIC: list[tuple[bytes, str, Callable[..., Any] | None]] = [  # opener(path, "rb") -> IO[bytes]
    (b"\x1f\x8b", "gzip", gzip.open), (b"BZh", "bz2", bz2.open), (b"\xfd7zXZ\x00", "xz", lzma.open),
    (b"PK\x03\x04", "zip", None), (b"\x28\xb5\x2f\xfd", "zstd", None)]
READ_ERRORS = (OSError, EOFError, lzma.LZMAError)
"""What a truncated or corrupt compressed file raises while it is read (gzip.BadGzipFile is an OSError)."""


def open_data(path: str | Path) -> IO[bytes]:
    """Open a Criteo file for reading bytes, decompressing gzip, bz2 or xz (told by the first bytes).

    Raises:
        DataError: ``path`` is missing, a directory or unreadable, or zip/zstd-compressed (not supported:
            the message says how to convert it).
    """
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: is a directory, expected a Criteo TSV file")
    try:
        with path.open("rb") as f:
            head = f.read(8)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or e})") from None
    for magic, kind, opener in _MAGIC:
        if head.startswith(magic):
            if opener is None:
                raise DataError(f"{path}: is {kind}-compressed, which is not supported; decompress it, or "
                                "compress it with gzip, bz2 or xz")
            return opener(path, "rb")
    return path.open("rb")


def _records(
    path: Path, table_size: int | Sequence[int]
) -> Iterator[tuple[int, tuple[list[float], list[int], float] | MalformedLine]]:
    """``(line number, parsed line or MalformedLine)`` for every non-blank line of ``path``.

    Raises:
        DataError: from :func:`open_data`, or the compressed stream is corrupt or truncated.
    """
    with open_data(path) as f:
        lineno = 0
        try:
            for lineno, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield lineno, MalformedLine("encoding", f"not UTF-8 at byte {e.start}")
                    continue
                try:
                    yield lineno, parse_line(line, table_size)
                except MalformedLine as e:
                    yield lineno, e
        except READ_ERRORS as e:
            raise DataError(f"{path}: cannot be read after line {lineno}: {type(e).__name__}: {e}") from None


def _natural_key(path: Path) -> list:
    """``day_2`` before ``day_10``: digit runs compare as numbers."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def data_files(path: str | Path, *, allow_empty: bool = False) -> list[Path]:
    """The Criteo files ``path`` names: a file; a directory (its files, not hidden ones, in natural order:
    ``day_0, day_1, ..., day_23``); or a glob (``data/day_*.gz``), in natural order. ``allow_empty``: a directory
    or glob without files gives ``[]`` (a stream whose files have not arrived yet, :mod:`recsys.criteo_follow`).

    Raises:
        DataError: no such file, or a directory or glob without files (unless ``allow_empty``).
    """
    text = str(path)
    path = Path(path).expanduser()
    if any(c in text for c in "*?["):
        files = [p for p in map(Path, glob.glob(str(path))) if p.is_file()]
        if not files and not allow_empty:
            raise DataError(f"{text}: the pattern matches no file")
    elif path.is_dir():
        files = [p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")]
        if not files and not allow_empty:
            raise DataError(f"{path}: the directory holds no data file")
    else:
        return [path]
    return sorted(files, key=lambda p: (_natural_key(p), str(p)))


def check_data_file(path: str | Path, table_size: int | Sequence[int] = 20000, *, where: str = "", scan_lines: int = 1000) -> ParseStats:
    """The launcher's cheap checks of a data file, before a job starts: it can be opened and decompressed,
    is not empty, and at least one of its first ``scan_lines`` non-blank lines is a valid Criteo line.

    Args:
        where: How the message names the file (default: the path), e.g. ``"[data] path = 'x.tsv'"``.

    Returns:
        The parse statistics of the lines scanned.

    Raises:
        DataError: naming ``where`` and the reason (no such file, a directory, unreadable, empty,
            unsupported compression, corrupt, or no valid line among the lines scanned, with their reasons).
    """
    where = where or str(path)
    stats = ParseStats()
    seen = 0
    try:
        for lineno, parsed in _records(Path(path), table_size):
            seen += 1
            if isinstance(parsed, MalformedLine):
                stats.record(lineno, parsed)
            else:
                stats.valid += 1
                break
            if seen >= scan_lines:
                break
    except DataError as e:
        raise DataError(f"{where}: {str(e).removeprefix(str(path) + ': ')}") from None
    if seen == 0:
        raise DataError(f"{where}: the file is empty (no non-blank line)")
    if stats.valid == 0:
        raise DataError(f"{where}: none of the first {seen} non-blank lines is a valid Criteo line "
                        f"(malformed: {dict(stats.malformed)}; first: {stats.examples[0]})")
    return stats
