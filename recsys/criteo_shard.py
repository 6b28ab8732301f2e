"""Which lines a trainer reads, and reading them: chunks of whole lines, shards by file then by line, rows in
memory, the first pass.

A job's data is one file or many (a directory or a glob, :func:`recsys.criteo_format.data_files`: the ``day_0 ..
day_23`` layout), plain or compressed. Nothing holds a file in memory: each file is read in chunks of about
``CHUNK_BYTES`` cut at a newline (:func:`iter_chunks`) and each chunk is parsed at once
(:func:`recsys.criteo_parse.parse_chunk`).

Which trainer trains a line (:func:`line_owner`), with ``F`` files, ``W`` trainers, held-out every k-th line:

- line ``i`` of a file (0-based, blank and malformed lines included) is held out when ``i % k == k - 1``;
- with ``F >= W`` file ``f`` goes to trainer ``f % W`` (by file); otherwise the training lines of every file
  are dealt round-robin (``t % W`` with ``t`` the line's index among the file's training lines: by line).

:class:`CriteoShard` holds one trainer's training rows (or all held-out rows) in memory, in file order;
:class:`recsys.criteo_stream.CriteoStream` streams the same rows in the same order. :func:`read_file` reads all
the rows of one file and refuses a malformed line (the small readers :func:`recsys.criteo.criteo_batches` and
``quant``'s ``load_criteo``).

:func:`scan` is the launcher's first pass over all the data: lines, valid and malformed lines, training rows
per trainer, held-out rows, parse throughput, and optionally the distinct values per categorical feature
(the per-feature table sizes, ``jobs.table_sizes``).

Source: torchrec's Criteo pipelines (files by day, rows in file order).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypedDict

import numpy as np
import torch

from recsys.criteo_format import (
    NUM_DENSE,
    NUM_SPARSE,
    READ_ERRORS,
    Batch,
    DataError,
    MalformedLine,
    ParseCounts,
    ParseStats,
    data_files,
    hash_ids,
    open_data,
    parse_fields,
    table_size_list,
)
from recsys.criteo_parse import ParsedChunk, parse_chunk

__all__ = ["CHUNK_BYTES", "iter_chunks", "read_chunks", "line_owner", "own_files", "line_error", "count_chunk",
           "read_rows", "CriteoShard", "read_file", "DataPlan", "scan"]

CHUNK_BYTES = 4 << 20
"""Bytes read (and parsed) at a time, before the cut at the last newline: about 16k Criteo lines."""


def iter_chunks(path: Path, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[bytes, int]]:
    """``(bytes of whole lines, index of the first of them in the file)`` for the whole file.

    Raises:
        DataError: from :func:`recsys.criteo_format.open_data`, or the compressed stream is corrupt or truncated.
    """
    with open_data(path) as f:
        yield from read_chunks(f, path, 0, chunk_bytes, final=True)


def read_chunks(f: IO[bytes], path: Path, first: int, chunk_bytes: int = CHUNK_BYTES, *,
                final: bool) -> Iterator[tuple[bytes, int]]:
    """``(bytes of whole lines, index of the first of them)`` read from the open binary file ``f`` of ``path`` (its
    current position is line ``first``) to its end, cut at the last newline of each block; with ``final`` also the
    last line when it has no newline (without: a partial line the writer has not finished, left unread).

    Raises:
        DataError: the compressed stream is corrupt or truncated (the message names ``path`` and the line).
    """
    rest = b""
    while True:
        try:
            block = f.read(chunk_bytes)
        except READ_ERRORS as e:
            done = first + rest.count(b"\n")
            raise DataError(f"{path}: cannot be read after line {done}: {type(e).__name__}: {e}") from None
        if not block:
            break
        buf = rest + block
        cut = buf.rfind(b"\n") + 1
        if cut == 0:
            rest = buf
            continue
        chunk, rest = buf[:cut], buf[cut:]
        yield chunk, first
        first += chunk.count(b"\n")
    if final and rest:
        yield rest, first


def line_owner(file_index: int, files: int, world_size: int, every: int, lines: np.ndarray) -> np.ndarray:
    """The trainer of each line (-1: held out), see the module docstring.

    Shapes: ``lines (n,) int64`` (0-based line indices in file ``file_index`` of ``files``) -> ``(n,) int64``.
    """
    held = (lines % every == every - 1) if every else np.zeros(len(lines), bool)
    if files >= world_size:
        owner = np.full(len(lines), file_index % world_size, np.int64)
    else:
        train_index = lines - ((lines + 1) // every if every else 0)
        owner = train_index % world_size
    owner[held] = -1
    return owner


def line_error(raw: bytes) -> MalformedLine | None:
    """Why one line (its bytes, without the newline) is malformed, as :func:`recsys.criteo_format.parse_fields`
    says; None when it parses."""
    try:
        parse_fields(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return MalformedLine("encoding", f"not UTF-8 at byte {e.start}")
    except MalformedLine as e:
        return e
    return None


def count_chunk(stats: ParseStats, parsed: ParsedChunk, buf: bytes, first: int, name: str) -> None:
    """Count ``parsed``'s lines into ``stats`` and record its first malformed lines as examples."""
    stats.valid += len(parsed)
    stats.malformed.update(parsed.malformed)
    lines = buf.split(b"\n") if parsed.malformed_lines and len(stats.examples) < 5 else []
    for i in parsed.malformed_lines[: 5 - len(stats.examples)]:
        error = line_error(lines[i])
        if error is None:  # pragma: no cover - parse_chunk and parse_fields agree (tests/recsys/test_criteo_parse.py)
            continue
        stats.examples.append(f"{name + ' ' if name else ''}line {first + i + 1}: {error}")  # counted above


def own_files(files: Sequence[Path], rank: int, world_size: int, split: str) -> list[tuple[int, Path]]:
    """(file index, path) of the files that hold lines of ``rank`` (``split`` "eval": every file)."""
    if split == "train" and len(files) >= world_size:
        return [(f, p) for f, p in enumerate(files) if f % world_size == rank]
    return list(enumerate(files))


def read_rows(files: Sequence[Path], sizes: Sequence[int], stats: ParseStats, *, rank: int = 0,
              world_size: int = 1, every: int = 0, split: str = "train", max_rows: int | None = None,
              count_all: bool = True, chunk_bytes: int = CHUNK_BYTES) -> tuple[torch.Tensor, ...]:
    """The rows of ``rank`` (``split`` "train") or the held-out rows ("eval"), in memory, up to ``max_rows``.

    Args:
        stats: Receives the counts of the lines parsed: every line of the files read (``count_all``), or only
            the lines selected.

    Returns:
        ``dense (n, 13) float32, sparse (n, 26) int64, labels (n,) float32``.
    """
    want = -1 if split == "eval" else rank
    parts: list[tuple[np.ndarray, ...]] = []
    total = 0
    name_files = len(files) > 1
    for f, path in own_files(files, rank, world_size, split):
        for buf, first in iter_chunks(path, chunk_bytes):  # B023: each lambda is used in its own iteration only
            owner_of = lambda idx: line_owner(f, len(files), world_size, every, first + idx)  # noqa: E731, B023
            parsed = parse_chunk(buf, None if count_all else (lambda idx: owner_of(idx) == want))  # noqa: B023
            count_chunk(stats, parsed, buf, first, path.name if name_files else "")
            take = owner_of(parsed.lines) == want
            if max_rows is not None:
                take &= np.cumsum(take) <= max_rows - total
            total += int(take.sum())
            parts.append((parsed.dense[take], hash_ids(parsed.values[take], parsed.present[take], sizes),
                           parsed.labels[take]))
            if max_rows is not None and total >= max_rows:
                return _stack(parts)
    return _stack(parts)


def _stack(parts: list[tuple[np.ndarray, ...]]) -> tuple[torch.Tensor, ...]:
    if not parts:
        return torch.zeros(0, NUM_DENSE), torch.zeros(0, NUM_SPARSE, dtype=torch.int64), torch.zeros(0)
    return tuple(torch.from_numpy(np.concatenate(col)) for col in zip(*parts))


class CriteoShard:
    """One trainer's share of Criteo data, parsed into memory (vectorised, :mod:`recsys.criteo_parse`), served
    as endless batches. For data that fits in memory (tests, the sample, the held-out rows); a job streams
    its training rows instead (:class:`recsys.criteo_stream.CriteoStream`, the same rows in the same order).

    Args:
        path: A Criteo TSV file (plain or compressed, see :func:`recsys.criteo_format.open_data`), a directory or a
            glob of them (:func:`recsys.criteo_format.data_files`).
        table_size: Hash buckets per categorical feature: one for all 26, or one per feature.
        rank: This trainer's index in ``[0, world_size)``.
        world_size: Number of trainers sharing the training lines (by file, then by line:
            :func:`line_owner`).
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


def read_file(path: str | Path, table_size: int | Sequence[int], *, limit: int | None = None,
              chunk_bytes: int = CHUNK_BYTES) -> tuple[torch.Tensor, ...]:
    """The rows of one Criteo file in file order, up to ``limit`` of them, with the job's parser and ids, for
    readers that take a file whole and refuse a malformed line instead of skipping it
    (:func:`recsys.criteo.criteo_batches`, ``quant``'s ``load_criteo``). Blank lines are skipped.

    Returns:
        ``dense (n, 13) float32, sparse (n, 26) int64`` (0 = missing), ``labels (n,) float32``.

    Raises:
        DataError: the file cannot be read (:func:`recsys.criteo_format.open_data`), or a line before the
            ``limit``-th row is malformed: ``"<path>:<line>: <what is wrong>"``, e.g. ``"x.tsv:2: expected 40
            tab-separated columns (label, I1..I13, C1..C26), got 3"``.
    """
    path, sizes = Path(path), table_size_list(table_size)
    parts: list[tuple[np.ndarray, ...]] = []
    total = 0
    for buf, first in iter_chunks(path, chunk_bytes):
        parsed = parse_chunk(buf, examples=1)
        take = len(parsed) if limit is None else min(len(parsed), limit - total)
        done = limit is not None and total + take >= limit
        end = (parsed.lines[take - 1] + 1 if take else 0) if done else parsed.line_count  # lines before the limit
        if parsed.malformed_lines and parsed.malformed_lines[0] < end:
            i = parsed.malformed_lines[0]
            error = line_error(buf.split(b"\n")[i])
            raise DataError(f"{path}:{first + i + 1}: {error.detail if error else 'malformed'}")
        parts.append((parsed.dense[:take], hash_ids(parsed.values[:take], parsed.present[:take], sizes),
                      parsed.labels[:take]))
        total += take
        if done:
            break
    return _stack(parts)


class _Distinct:
    """Distinct values per categorical feature, exact up to ``cap`` (a feature past it stops being tracked:
    its table is capped anyway). Memory: at most about ``cap`` uint64 values per feature."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.base = [np.zeros(0, np.uint64) for _ in range(NUM_SPARSE)]
        self.parts: list[list[np.ndarray]] = [[] for _ in range(NUM_SPARSE)]
        self.pending = [0] * NUM_SPARSE
        self.over: list[int | None] = [None] * NUM_SPARSE

    def add(self, values: np.ndarray, present: np.ndarray) -> None:
        for j in range(NUM_SPARSE):
            if self.over[j] is None:
                col = values[present[:, j], j]
                self.parts[j].append(col)
                self.pending[j] += len(col)
                if self.pending[j] > max(len(self.base[j]), 1 << 20):
                    self._merge(j)

    def _merge(self, j: int) -> None:
        self.base[j] = np.unique(np.concatenate([self.base[j], *self.parts[j]]))
        self.parts[j], self.pending[j] = [], 0
        if len(self.base[j]) > self.cap:
            self.over[j], self.base[j] = len(self.base[j]), np.zeros(0, np.uint64)

    def counts(self) -> tuple[list[int], list[bool]]:
        """(distinct values per feature, whether each count is exact: False = more than ``cap``, at least that)."""
        for j in range(NUM_SPARSE):
            if self.over[j] is None:
                self._merge(j)
        return ([len(b) if o is None else o for b, o in zip(self.base, self.over)],
                [o is None for o in self.over])



class ScanSummary(TypedDict):
    """:meth:`DataPlan.summary`: what results.json records of the first pass (``data.scan``)."""

    files: int
    sharding: str
    lines: int
    rows_per_trainer: list[int]
    eval_rows: int
    seconds: float
    lines_per_s: float

@dataclass
class DataPlan:
    """What the first pass (:func:`scan`) found: the trainers' shares and the parse statistics."""

    files: list[str]
    """The data files, in the order they are read."""
    world_size: int
    every: int
    """Every k-th line is held out (0: none)."""
    rows: list[int]
    """Valid training rows per trainer per epoch."""
    eval_rows: int
    """Valid held-out rows."""
    stats: ParseCounts
    """:meth:`recsys.criteo_format.ParseStats.as_dict` of every line."""
    lines: int = 0
    """Lines read, blank ones included."""
    seconds: float = 0.0
    """Wall seconds of the pass (reading, decompressing and parsing)."""
    distinct: list[int] | None = None
    """Distinct values per categorical feature (None: not counted)."""
    distinct_exact: list[bool] | None = None
    """Per feature: the count is exact (False: more than the cap, at least ``distinct``)."""
    sharding: str = field(default="by line")
    """"by file" (files >= trainers) or "by line"."""

    @property
    def lines_per_s(self) -> float:
        return self.lines / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> ScanSummary:
        """What results.json records (``data.scan``)."""
        return {"files": len(self.files), "sharding": self.sharding, "lines": self.lines,
                "rows_per_trainer": self.rows, "eval_rows": self.eval_rows, "seconds": round(self.seconds, 3),
                "lines_per_s": round(self.lines_per_s, 1)}


def scan(path: str | Path, world_size: int, eval_fraction: float, *, distinct_cap: int | None = None,
         chunk_bytes: int = CHUNK_BYTES, engine: str = "auto") -> DataPlan:
    """One pass over all the data (see the module docstring); with ``distinct_cap`` also count the distinct
    values of each categorical feature (exactly, up to the cap). ``engine``: the chunk parser's
    (:func:`recsys.criteo_parse.parse_chunk`).

    Raises:
        DataError: a file cannot be read.
    """
    files = data_files(path)
    every = round(1 / eval_fraction) if eval_fraction > 0 else 0
    stats, distinct = ParseStats(), _Distinct(distinct_cap) if distinct_cap else None
    rows = np.zeros(world_size + 1, np.int64)  # the last slot counts the held-out rows (owner -1)
    lines, t0 = 0, time.perf_counter()
    for f, file in enumerate(files):
        for buf, first in iter_chunks(file, chunk_bytes):
            parsed = parse_chunk(buf, engine=engine)
            lines += parsed.line_count
            count_chunk(stats, parsed, buf, first, file.name if len(files) > 1 else "")
            owner = line_owner(f, len(files), world_size, every, first + parsed.lines)
            rows += np.bincount(np.where(owner < 0, world_size, owner), minlength=world_size + 1)
            if distinct is not None:
                distinct.add(parsed.values, parsed.present)
    counts, exact = distinct.counts() if distinct is not None else (None, None)
    return DataPlan([str(p) for p in files], world_size, every, [int(r) for r in rows[:world_size]],
                    int(rows[world_size]), stats.as_dict(), lines, time.perf_counter() - t0, counts, exact,
                    "by file" if len(files) >= world_size else "by line")
