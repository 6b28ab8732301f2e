"""Streaming Criteo input: chunks of whole lines, shards by file then by line, a first pass, worker processes.

A job's data is one file or many (a directory or a glob, :func:`jobs.data.data_files`: the ``day_0 ..
day_23`` layout), plain or compressed. Nothing holds a file in memory: each file is read in chunks of about
``CHUNK_BYTES`` cut at a newline (:func:`iter_chunks`) and each chunk is parsed at once
(:func:`jobs.criteo_parse.parse_chunk`).

Which trainer trains a line (:func:`line_owner`), with ``F`` files, ``W`` trainers, held-out every k-th line:

- line ``i`` of a file (0-based, blank and malformed lines included) is held out when ``i % k == k - 1``;
- with ``F >= W`` file ``f`` goes to trainer ``f % W`` (by file); otherwise the training lines of every file
  are dealt round-robin (``t % W`` with ``t`` the line's index among the file's training lines: by line).

A trainer's batches are its training rows in file order, ``B`` consecutive rows each, wrapping around at the
end of the epoch (the rows and the order of :class:`jobs.data.CriteoShard`). :class:`CriteoStream` produces
them off the training thread: a ``torch.utils.data.DataLoader`` over an ``IterableDataset`` whose ``K`` worker
processes read the same files and parse every K-th chunk (worker ``w`` parses chunks ``g % K == w``, ``g``
counted across epochs); the DataLoader returns them in chunk order (it takes from its workers round-robin),
so the batches do not depend on ``K``. Its prefetch (2 chunks per worker) bounds the memory. Starting at
batch ``s`` skips ``s * B`` rows modulo the epoch's rows, so a restarted trainer sees the batches of an
uninterrupted run. :class:`SharedBatches` lets both phases of the job read one stream.

:func:`scan` is the launcher's first pass over all the data: lines, valid and malformed lines, training rows
per trainer, held-out rows, parse throughput, and optionally the distinct values per categorical feature
(the per-feature table sizes, :mod:`jobs.table_sizes`).

Source: torch.utils.data (IterableDataset, worker sharding with ``get_worker_info``); torchrec's Criteo
pipelines (files by day, rows in file order).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jobs.criteo_parse import NUM_SPARSE, ParsedChunk, hash_ids, parse_chunk
from jobs.data import _READ_ERRORS, Batch, DataError, MalformedLine, ParseStats, open_data, parse_fields

__all__ = ["CHUNK_BYTES", "iter_chunks", "line_owner", "read_rows", "DataPlan", "scan", "CriteoStream",
           "SharedBatches"]

CHUNK_BYTES = 4 << 20
"""Bytes read (and parsed) at a time, before the cut at the last newline: about 16k Criteo lines."""
START_METHOD = "spawn"
"""How the DataLoader starts its workers: a fresh interpreter (a trainer process has RPC and Ray threads)."""


def iter_chunks(path: Path, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[bytes, int]]:
    """``(bytes of whole lines, index of the first of them in the file)`` for the whole file.

    Raises:
        DataError: from :func:`jobs.data.open_data`, or the compressed stream is corrupt or truncated.
    """
    with open_data(path) as f:
        first, rest = 0, b""
        while True:
            try:
                block = f.read(chunk_bytes)
            except _READ_ERRORS as e:
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
        if rest:
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


def _examples(stats: ParseStats, parsed: ParsedChunk, buf: bytes, first: int, name: str) -> None:
    """Count ``parsed``'s lines into ``stats`` and record its first malformed lines as examples."""
    stats.valid += len(parsed)
    stats.malformed.update(parsed.malformed)
    lines = buf.split(b"\n") if parsed.malformed_lines and len(stats.examples) < 5 else []
    for i in parsed.malformed_lines[: 5 - len(stats.examples)]:
        try:
            parse_fields(lines[i].decode("utf-8"))
        except UnicodeDecodeError as e:
            error = MalformedLine("encoding", f"not UTF-8 at byte {e.start}")
        except MalformedLine as e:
            error = e
        else:  # pragma: no cover - parse_chunk and parse_fields agree (tests/jobs/test_criteo_stream.py)
            continue
        stats.examples.append(f"{name + ' ' if name else ''}line {first + i + 1}: {error}")  # counted above


def _own_files(files: Sequence[Path], rank: int, world_size: int, split: str) -> list[tuple[int, Path]]:
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
    for f, path in _own_files(files, rank, world_size, split):
        for buf, first in iter_chunks(path, chunk_bytes):
            owner_of = lambda idx: line_owner(f, len(files), world_size, every, first + idx)  # noqa: E731
            parsed = parse_chunk(buf, None if count_all else (lambda idx: owner_of(idx) == want))
            _examples(stats, parsed, buf, first, path.name if name_files else "")
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
        return torch.zeros(0, 13), torch.zeros(0, NUM_SPARSE, dtype=torch.int64), torch.zeros(0)
    return tuple(torch.from_numpy(np.concatenate(col)) for col in zip(*parts))


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
    stats: dict[str, Any]
    """:meth:`jobs.data.ParseStats.as_dict` of every line."""
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

    def summary(self) -> dict[str, Any]:
        """What results.json records (``data.scan``)."""
        return {"files": len(self.files), "sharding": self.sharding, "lines": self.lines,
                "rows_per_trainer": self.rows, "eval_rows": self.eval_rows, "seconds": round(self.seconds, 3),
                "lines_per_s": round(self.lines_per_s, 1)}


def scan(path: str | Path, world_size: int, eval_fraction: float, *, distinct_cap: int | None = None,
         chunk_bytes: int = CHUNK_BYTES) -> DataPlan:
    """One pass over all the data (see the module docstring); with ``distinct_cap`` also count the distinct
    values of each categorical feature (exactly, up to the cap).

    Raises:
        DataError: a file cannot be read.
    """
    from jobs.data import data_files

    files = data_files(path)
    every = round(1 / eval_fraction) if eval_fraction > 0 else 0
    stats, distinct = ParseStats(), _Distinct(distinct_cap) if distinct_cap else None
    rows = np.zeros(world_size + 1, np.int64)  # the last slot counts the held-out rows (owner -1)
    lines, t0 = 0, time.perf_counter()
    for f, file in enumerate(files):
        for buf, first in iter_chunks(file, chunk_bytes):
            parsed = parse_chunk(buf)
            lines += parsed.line_count
            _examples(stats, parsed, buf, first, file.name if len(files) > 1 else "")
            owner = line_owner(f, len(files), world_size, every, first + parsed.lines)
            rows += np.bincount(np.where(owner < 0, world_size, owner), minlength=world_size + 1)
            if distinct is not None:
                distinct.add(parsed.values, parsed.present)
    counts, exact = distinct.counts() if distinct is not None else (None, None)
    return DataPlan([str(p) for p in files], world_size, every, [int(r) for r in rows[:world_size]],
                    int(rows[world_size]), stats.as_dict(), lines, time.perf_counter() - t0, counts, exact,
                    "by file" if len(files) >= world_size else "by line")


def exit_without_static_destructors(worker_id: int = 0) -> None:
    """``worker_init_fn`` of the reader's DataLoader: the worker process ends with ``os._exit(0)`` once Python has
    run its exit handlers and flushed its streams, skipping C++ static destruction.

    torch 2.13's DataLoader workers otherwise often abort there, printing "terminate called without an active
    exception" when the stream is closed: 6 of 15 shutdowns of a 2-worker stream here, and 1 of 10 with a
    dataset that yields only ``torch.rand`` tensors (so the abort is torch's, not the parser's). Nothing is lost:
    by then the worker has answered every request it will answer.
    """
    import atexit

    atexit.register(_exit_now)


def _exit_now() -> None:
    import logging
    import os
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing left to write
            pass
    os._exit(0)


class _TrainChunks(torch.utils.data.IterableDataset):
    """Endless parsed chunks of one trainer's training lines; DataLoader worker ``w`` of ``K`` parses the
    chunks ``g % K == w`` (``g`` counted across epochs) and yields one item per chunk, so the DataLoader's
    round-robin returns them in chunk order."""

    def __init__(self, files: Sequence[str], sizes: Sequence[int], rank: int, world_size: int, every: int,
                 chunk_bytes: int) -> None:
        self.files, self.sizes = [Path(f) for f in files], list(sizes)
        self.rank, self.world_size, self.every, self.chunk_bytes = rank, world_size, every, chunk_bytes

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        own = _own_files(self.files, self.rank, self.world_size, "train")
        g, epoch = 0, 0
        while True:
            for f, path in own:
                for buf, first in iter_chunks(path, self.chunk_bytes):
                    if g % workers == worker:
                        yield {**self._parse(f, path, buf, first), "epoch": epoch}
                    g += 1
            epoch += 1

    def _parse(self, f: int, path: Path, buf: bytes, first: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        mine = lambda idx: line_owner(f, len(self.files), self.world_size, self.every, first + idx) == self.rank  # noqa: E731
        parsed = parse_chunk(buf, mine)
        stats = ParseStats()
        _examples(stats, parsed, buf, first, path.name if len(self.files) > 1 else "")
        ids = hash_ids(parsed.values, parsed.present, self.sizes)
        return {"dense": torch.from_numpy(parsed.dense), "sparse": torch.from_numpy(ids),
                "labels": torch.from_numpy(parsed.labels), "lines": len(parsed) + stats.malformed_total,
                "malformed": dict(stats.malformed), "seconds": time.perf_counter() - t0}


class CriteoStream:
    """One trainer's endless training batches, parsed by ``workers`` background processes (see the module
    docstring); ``workers=0`` parses in the calling thread (tests, debugging). Workers start with
    ``spawn`` (:data:`START_METHOD`), so a script that iterates a stream with workers at import time needs
    Python's ``if __name__ == "__main__":`` guard.

    Args:
        files: The data files (:func:`jobs.data.data_files`); ``sizes``: rows of each of the 26 tables.
        rank, world_size, every: this trainer's share (:func:`line_owner`).
        rows_per_epoch: This trainer's training rows per epoch (:attr:`DataPlan.rows`), so that a start at
            batch ``s`` skips ``s * B`` rows modulo an epoch; None: skip ``s * B`` rows.
        on_chunk: ``on_chunk(stats)`` after each chunk (e.g. a Prometheus gauge), or None.

    Attributes: ``lines``, ``rows``, ``parse_seconds``: what the workers parsed so far; ``malformed``: reason ->
    count of the malformed lines met in the first pass over the trainer's files.
    """

    def __init__(self, files: Sequence[str], sizes: Sequence[int], *, rank: int = 0, world_size: int = 1,
                 every: int = 0, workers: int = 1, rows_per_epoch: int | None = None,
                 chunk_bytes: int = CHUNK_BYTES, on_chunk: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.dataset = _TrainChunks(files, sizes, rank, world_size, every, chunk_bytes)
        self.workers, self.rows_per_epoch, self.on_chunk = workers, rows_per_epoch, on_chunk
        self.lines, self.rows, self.parse_seconds, self.malformed = 0, 0, 0.0, Counter()
        self._loaders: list[Any] = []
        self._started = time.perf_counter()

    def __len__(self) -> int:
        return self.rows_per_epoch or 0

    def _chunks(self) -> Iterator[dict[str, Any]]:
        if self.workers == 0:
            return iter(self.dataset)
        loader = torch.utils.data.DataLoader(self.dataset, batch_size=None, num_workers=self.workers,
                                             prefetch_factor=2, multiprocessing_context=START_METHOD,
                                             worker_init_fn=exit_without_static_destructors)
        it = iter(loader)
        self._loaders.append(it)
        return it

    def batches(self, batch_size: int, *, start: int = 0) -> Iterator[Batch]:
        """Endless batches of ``batch_size`` consecutive training rows from batch ``start`` on."""
        skip = start * batch_size
        if self.rows_per_epoch:
            skip %= self.rows_per_epoch
        pending: deque[list[torch.Tensor]] = deque()
        have = 0
        for item in self._chunks():
            self._count(item)
            cols = [item["dense"], item["sparse"], item["labels"]]
            n = cols[2].shape[0]
            if skip:
                drop = min(skip, n)
                cols, n, skip = [c[drop:] for c in cols], n - drop, skip - drop
            if n:
                pending.append(cols)
                have += n
            while have >= batch_size:
                yield _take(pending, batch_size)
                have -= batch_size

    def _count(self, item: dict[str, Any]) -> None:
        self.lines += item["lines"]
        self.rows += item["labels"].shape[0]
        self.parse_seconds += item["seconds"]
        if item["epoch"] == 0:  # each malformed line once, not once per pass
            self.malformed.update(item["malformed"])
        if self.on_chunk is not None:
            self.on_chunk(self.stats())

    def stats(self) -> dict[str, Any]:
        """Parse throughput so far: ``lines_per_s`` (lines per second of parse time in one worker; the
        workers together parse ``workers`` times that), ``workers``, ``lines``, ``rows``, ``malformed``."""
        rate = self.lines / self.parse_seconds if self.parse_seconds > 0 else 0.0
        return {"lines_per_s": rate, "workers": self.workers, "capacity_lines_per_s": rate * max(1, self.workers),
                "lines": self.lines, "rows": self.rows, "malformed": dict(self.malformed),
                "parse_seconds": self.parse_seconds}

    def close(self) -> None:
        """Stop the worker processes. A worker that dies while it exits (seen once here as a C++ ``terminate``
        in a spawned worker stopped mid-chunk) is not an error any more: nothing is read after this."""
        for it in self._loaders:
            try:
                it._shutdown_workers()
            except RuntimeError:  # the DataLoader's SIGCHLD check of a worker that died while stopping
                pass
        self._loaders.clear()


def _take(pending: deque[list[torch.Tensor]], size: int) -> Batch:
    """The first ``size`` rows of the pending chunks (removed from them), as a :class:`Batch`."""
    parts, need = [], size
    while need:
        cols = pending[0]
        n = cols[2].shape[0]
        if n <= need:
            parts.append(pending.popleft())
            need -= n
        else:
            parts.append([c[:need] for c in cols])
            pending[0] = [c[need:] for c in cols]
            need = 0
    if len(parts) == 1:
        return Batch(*parts[0])
    return Batch(*(torch.cat(col) for col in zip(*parts)))


class SharedBatches:
    """One batch iterator read by ``readers`` consumers in step (the job's phases train the same batches,
    alternating blocks of steps): each batch is kept until every reader has read it, so the buffer holds
    at most the lead of the fastest reader (a block of steps).

    >>> shared = SharedBatches(iter(range(100)), readers=2)
    >>> a, b = shared.reader(), shared.reader()
    >>> [next(a) for _ in range(3)], [next(b) for _ in range(2)], len(shared.buffer)
    ([0, 1, 2], [0, 1], 1)
    """

    def __init__(self, source: Iterator[Any], readers: int, start: int = 0) -> None:
        self.source, self.readers, self.start = source, readers, start  # start: the source's first batch index
        self.buffer: deque[Any] = deque()
        self.reads: deque[int] = deque()
        self.base = 0
        self.made = 0

    def reader(self) -> Iterator[Any]:
        """A new consumer from the first batch (at most ``readers`` of them).

        Raises:
            RuntimeError: more than ``readers`` consumers.
        """
        if self.made >= self.readers:
            raise RuntimeError(f"SharedBatches: only {self.readers} readers were planned")
        self.made += 1
        return self._read()

    def _read(self) -> Iterator[Any]:
        pos = self.base
        while True:
            if pos - self.base == len(self.buffer):
                self.buffer.append(next(self.source))
                self.reads.append(0)
            item = self.buffer[pos - self.base]
            self.reads[pos - self.base] += 1
            while self.reads and self.reads[0] == self.readers:
                self.buffer.popleft()
                self.reads.popleft()
                self.base += 1
            pos += 1
            yield item
