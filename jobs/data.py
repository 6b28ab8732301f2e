"""Criteo click logs: parsing, hashing, sharding across trainers, and a synthetic generator.

A Criteo (Kaggle DAC) line is 40 tab-separated fields: the click label (0/1), 13 integer features
``I1..I13`` (counts, may be empty or negative) and 26 categorical features ``C1..C26`` (8 hex digits,
may be empty). Each line becomes

- ``dense``: 13 floats, ``log(1 + max(x, 0))``, empty -> 0;
- ``sparse``: 26 ids, feature ``j``'s value (its hex digits read as a number) hashed into ``[1,
  table_size_j)`` with a 64-bit mix (splitmix64's finaliser, salted by ``j``: stable across processes and
  runs, unlike Python's ``hash``); empty -> id 0 ("missing"). ``table_size`` is one size for all 26 tables or
  one per feature (``[model] table_sizes``);
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
(:func:`jobs.criteo_stream.line_owner`). :class:`CriteoShard` parses them into memory with the vectorised
parser (:mod:`jobs.criteo_parse`); the job streams them (:mod:`jobs.criteo_stream`).

Source: Criteo Kaggle Display Advertising Challenge format; DLRM (Naumov et al. 2019) preprocessing
(log transform of counts, hashed categorical ids).
"""

from __future__ import annotations

import bz2
import glob
import gzip
import lzma
import math
import random
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, NamedTuple

import torch

__all__ = [
    "NUM_DENSE",
    "NUM_SPARSE",
    "Batch",
    "DataError",
    "MalformedLine",
    "ParseStats",
    "parse_line",
    "parse_fields",
    "table_size_list",
    "data_files",
    "CriteoShard",
    "open_data",
    "check_data_file",
    "locate_data",
    "default_criteo_path",
    "resolve_data_path",
    "write_synthetic_criteo",
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
    """A Criteo line that cannot be parsed; ``reason`` is a short key used for counting."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class DataError(ValueError):
    """A data file the job cannot use (missing, a directory, empty, unreadable, corrupt, or without any
    valid line); the message names the file and what is wrong. Deterministic: retrying cannot help."""


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

    def as_dict(self) -> dict:
        return {"valid": self.valid, "malformed": dict(self.malformed), "examples": list(self.examples)}


def _hash_id(table: int, value: str, table_size: int) -> int:
    """Id of categorical ``value`` (1 to 16 hex digits, or "" = missing -> 0) in table ``table`` of
    ``table_size`` rows; the same hash as the vectorised reader (:func:`jobs.criteo_parse.hash_ids`)."""
    if not value:
        return 0
    from jobs.criteo_parse import mix64

    return 1 + mix64(int(value, 16), table) % (table_size - 1)


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
        raise MalformedLine("field_count", f"expected {NUM_FIELDS} tab-separated fields, got {len(fields)}")
    if fields[0] not in ("0", "1"):
        raise MalformedLine("label", f"label must be 0 or 1, got {fields[0][:20]!r}")
    dense = [_dense(j, raw) for j, raw in enumerate(fields[1 : 1 + NUM_DENSE])]
    cats = fields[1 + NUM_DENSE :]
    for j, raw in enumerate(cats):
        if raw and not _HEX_ID.fullmatch(raw):
            raise MalformedLine("categorical_feature", f"C{j + 1} is not 1 to 16 hex digits: {raw[:20]!r}")
    return dense, [int(raw, 16) if raw else None for raw in cats], float(fields[0])


def table_size_list(table_size: int | Sequence[int]) -> list[int]:
    """One size per categorical feature: ``[table_size] * 26`` for an int, else the 26 sizes given.

    Raises:
        ValueError: not 26 sizes, or a size below 2.
    """
    sizes = [table_size] * NUM_SPARSE if isinstance(table_size, int) else [int(s) for s in table_size]
    if len(sizes) != NUM_SPARSE or min(sizes) < 2:
        raise ValueError(f"table sizes: need {NUM_SPARSE} sizes of at least 2 rows, got {sizes!r}")
    return sizes


def parse_line(line: str, table_size: int | Sequence[int]) -> tuple[list[float], list[int], float]:
    """Parse one Criteo TSV line into (13 dense floats, 26 ids, label).

    Args:
        table_size: Rows per table: one for all 26, or one per feature.

    Raises:
        MalformedLine: with ``reason`` one of "nul_byte", "field_count", "label", "integer_feature",
            "integer_range", "categorical_feature" (see the module docstring); nothing else, for any
            ``line``.
    """
    from jobs.criteo_parse import mix64

    dense, values, label = parse_fields(line)
    sizes = table_size_list(table_size)
    sparse = [0 if v is None else 1 + mix64(v, j) % (sizes[j] - 1) for j, v in enumerate(values)]
    return dense, sparse, label


_MAGIC = [(b"\x1f\x8b", "gzip", gzip.open), (b"BZh", "bz2", bz2.open), (b"\xfd7zXZ\x00", "xz", lzma.open),
          (b"PK\x03\x04", "zip", None), (b"\x28\xb5\x2f\xfd", "zstd", None)]
_READ_ERRORS = (OSError, EOFError, lzma.LZMAError)
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


def _records(path: Path, table_size: int) -> Iterator[tuple[int, tuple[list[float], list[int], float] | MalformedLine]]:
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
        except _READ_ERRORS as e:
            raise DataError(f"{path}: cannot be read after line {lineno}: {type(e).__name__}: {e}") from None


class CriteoShard:
    """One trainer's share of Criteo data, parsed into memory (vectorised, :mod:`jobs.criteo_parse`), served
    as endless batches. For data that fits in memory (tests, the sample, the held-out rows); a job streams
    its training rows instead (:class:`jobs.criteo_stream.CriteoStream`, the same rows in the same order).

    Args:
        path: A Criteo TSV file (plain or compressed, see :func:`open_data`), a directory or a glob of them
            (:func:`data_files`).
        table_size: Hash buckets per categorical feature: one for all 26, or one per feature.
        rank: This trainer's index in ``[0, world_size)``.
        world_size: Number of trainers sharing the training lines (by file, then by line:
            :func:`jobs.criteo_stream.line_owner`).
        eval_fraction: Fraction of lines held out (see module docstring); ``rank`` and ``world_size``
            do not apply to the held-out lines.
        split: "train" (this rank's training lines) or "eval" (all held-out lines).
        max_rows: Keep at most this many rows (reading stops there); None = all.
        count_all: ``stats`` counts every line of the files read (True), or only the lines of this shard.

    Raises:
        ValueError: bad ``rank``/``world_size``/``split``.
        DataError: the file is missing, unreadable or corrupt, or the shard has no valid line.
    """

    def __init__(
        self,
        path: str | Path,
        table_size: int | Sequence[int],
        *,
        rank: int = 0,
        world_size: int = 1,
        eval_fraction: float = 0.1,
        split: str = "train",
        max_rows: int | None = None,
        count_all: bool = True,
    ) -> None:
        from jobs.criteo_stream import read_rows

        if not 0 <= rank < world_size:
            raise ValueError(f"CriteoShard: rank {rank} is not in [0, world_size={world_size})")
        if split not in ("train", "eval"):
            raise ValueError(f"CriteoShard: split must be 'train' or 'eval', got {split!r}")
        self.path = Path(path)
        self.stats = ParseStats()
        every = round(1 / eval_fraction) if eval_fraction > 0 else 0
        self.dense, self.sparse, self.labels = read_rows(data_files(path), table_size_list(table_size), self.stats,
                                                         rank=rank, world_size=world_size, every=every, split=split,
                                                         max_rows=max_rows, count_all=count_all)
        if not len(self.labels):
            raise DataError(
                f"CriteoShard: {self.path} has no valid {split} line for rank {rank} of {world_size} "
                f"({self.stats.valid} valid, {self.stats.malformed_total} malformed)"
            )

    def __len__(self) -> int:
        return self.labels.shape[0]

    def batches(self, batch_size: int, *, start: int = 0) -> Iterator[Batch]:
        """Endless batches of ``batch_size`` consecutive rows, wrapping around the shard.

        Args:
            batch_size: B.
            start: Index of the first batch (so a restarted trainer resumes where it stopped).
        """
        n = len(self)
        offset = (start * batch_size) % n
        while True:
            idx = (torch.arange(batch_size) + offset) % n
            offset = (offset + batch_size) % n
            yield Batch(self.dense[idx], self.sparse[idx], self.labels[idx])

    def all_batches(self, batch_size: int) -> Iterator[Batch]:
        """Every row once, in batches of at most ``batch_size`` (the last one may be smaller)."""
        for i in range(0, len(self), batch_size):
            yield Batch(self.dense[i : i + batch_size], self.sparse[i : i + batch_size], self.labels[i : i + batch_size])


def _natural_key(path: Path) -> list:
    """``day_2`` before ``day_10``: digit runs compare as numbers."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def data_files(path: str | Path) -> list[Path]:
    """The Criteo files ``path`` names: a file; a directory (its files, not hidden ones, in natural order:
    ``day_0, day_1, ..., day_23``); or a glob (``data/day_*.gz``), in natural order.

    Raises:
        DataError: no such file, or a directory or glob without files.
    """
    text = str(path)
    path = Path(path).expanduser()
    if any(c in text for c in "*?["):
        files = [p for p in map(Path, glob.glob(str(path))) if p.is_file()]
        if not files:
            raise DataError(f"{text}: the pattern matches no file")
    elif path.is_dir():
        files = [p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")]
        if not files:
            raise DataError(f"{path}: the directory holds no data file")
    else:
        return [path]
    return sorted(files, key=lambda p: (_natural_key(p), str(p)))


def default_criteo_path() -> Path:
    """``<repo>/../shared/data/criteo/train_examples.txt`` (it may be absent outside CI)."""
    return Path(__file__).resolve().parents[1].parent / "shared" / "data" / "criteo" / "train_examples.txt"


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


def locate_data(configured: str, table_size: int | Sequence[int] = 20000) -> Path | None:
    """The job's data, checked (:func:`check_data_file`, on each file of a directory or glob): the configured
    path, else the shared Criteo sample when present; None when synthetic data has to be generated.

    Raises:
        DataError: the configured data (or the shared sample) cannot be used; the message names the key.
    """
    if configured:
        where = f"[data] path = {configured!r}"
        path = Path(configured).expanduser()
        try:
            files = data_files(configured)
        except DataError as e:
            reason = str(e).removeprefix(f"{path}: ").removeprefix(f"{configured}: ")
            raise DataError(f"{where}: {reason}") from None
        for file in files:
            check_data_file(file, table_size, where=where if files == [path] else f"{where}: {file}")
        return path
    shared = default_criteo_path()
    if shared.is_file():
        check_data_file(shared, table_size, where=f"the shared Criteo sample {shared}")
        return shared
    return None


def resolve_data_path(configured: str, run_dir: Path, synthetic_rows: int, *, seed: int = 0,
                      table_size: int = 20000) -> tuple[Path, str]:
    """Find the job's data: the configured path, else the shared Criteo sample, else synthetic data
    (written into ``run_dir``).

    Returns:
        (path, note): ``note`` says where the data came from, for the log and the report.

    Raises:
        DataError: ``configured`` is set but cannot be used (see :func:`locate_data`).
    """
    path = locate_data(configured, table_size)
    if path is not None:
        return path, (f"Criteo data from {path}" if configured else f"Criteo sample from {path}")
    shared = default_criteo_path()
    path = run_dir / "synthetic_criteo.tsv"
    write_synthetic_criteo(path, synthetic_rows, seed=seed)
    return path, (
        f"no Criteo data found (looked for {shared}; set [data] path to use your own); "
        f"generated {synthetic_rows} rows of synthetic Criteo-format data at {path}"
    )


def write_synthetic_criteo(path: str | Path, rows: int, *, seed: int = 0, missing_rate: float = 0.05) -> Path:
    """Write ``rows`` lines of Criteo-format TSV whose labels depend on the features (AUC > 0.5 is learnable).

    Integer features are geometric counts; categorical values are Zipf-like draws from per-feature
    vocabularies of 8-hex-digit ids; the click probability is a logistic function of a few features.
    About ``missing_rate`` of the feature values are left empty, as in the real logs.
    """
    rng = random.Random(seed)
    vocab = [[f"{rng.getrandbits(32):08x}" for _ in range(50 + 40 * j)] for j in range(NUM_SPARSE)]
    effect = [[rng.gauss(0.0, 0.8) for _ in v] for v in vocab]
    dense_w = [rng.gauss(0.0, 0.4) for _ in range(NUM_DENSE)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(rows):
            ints = [int(rng.expovariate(1 / (2 + 10 * j))) for j in range(NUM_DENSE)]
            cats = [min(int(rng.paretovariate(1.2)) - 1, len(v) - 1) for v in vocab]
            logit = -1.0 + sum(w * (math.log1p(x) - math.log1p(2 + 10 * j))
                               for j, (w, x) in enumerate(zip(dense_w, ints))) / 2
            logit += sum(effect[j][c] for j, c in enumerate(cats[:6]))
            label = 1 if rng.random() < 1 / (1 + math.exp(-logit)) else 0
            int_fields = ["" if rng.random() < missing_rate else str(x) for x in ints]
            cat_fields = ["" if rng.random() < missing_rate else vocab[j][c] for j, c in enumerate(cats)]
            f.write("\t".join([str(label), *int_fields, *cat_fields]) + "\n")
    return path
