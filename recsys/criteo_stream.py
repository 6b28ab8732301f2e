"""Streaming Criteo input: one trainer's endless training batches, parsed by worker processes.

A trainer's batches are its training rows in file order (:func:`recsys.criteo_shard.line_owner`), ``B``
consecutive rows each, wrapping around at the end of the epoch (the rows and the order of
:class:`recsys.criteo_shard.CriteoShard`). :class:`CriteoStream` produces them off the training thread: a
``torch.utils.data.DataLoader`` over an ``IterableDataset`` whose ``K`` worker processes read the same files
(:func:`recsys.criteo_shard.iter_chunks`) and parse every K-th chunk (worker ``w`` parses chunks ``g % K == w``,
``g`` counted across epochs); the DataLoader returns them in chunk order (it takes from its workers round-robin),
so the batches do not depend on ``K``. Its prefetch (2 chunks per worker) bounds the memory. Starting at
batch ``s`` skips ``s * B`` rows modulo the epoch's rows, so a restarted trainer sees the batches of an
uninterrupted run. :class:`SharedBatches` lets both phases of the job read one stream.

Source: torch.utils.data (IterableDataset, worker sharding with ``get_worker_info``); torchrec's Criteo
pipelines (files by day, rows in file order).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypedDict

import torch

from recsys.criteo_format import Batch, ParseStats, hash_ids
from recsys.criteo_parse import parse_chunk
from recsys.criteo_shard import CHUNK_BYTES, count_chunk, iter_chunks, line_owner, own_files

__all__ = ["START_METHOD", "exit_without_static_destructors", "CriteoStream", "SharedBatches"]

START_METHOD = "spawn"
"""How the DataLoader starts its workers: a fresh interpreter (a trainer process has RPC and Ray threads)."""


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
        own = own_files(self.files, self.rank, self.world_size, "train")
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
        count_chunk(stats, parsed, buf, first, path.name if len(self.files) > 1 else "")
        ids = hash_ids(parsed.values, parsed.present, self.sizes)
        return {"dense": torch.from_numpy(parsed.dense), "sparse": torch.from_numpy(ids),
                "labels": torch.from_numpy(parsed.labels), "lines": len(parsed) + stats.malformed_total,
                "malformed": dict(stats.malformed), "seconds": time.perf_counter() - t0}


class ReaderStats(TypedDict):
    """:meth:`CriteoStream.stats`: a stream reader's parse throughput so far."""

    lines_per_s: float
    workers: int
    capacity_lines_per_s: float
    lines: int
    rows: int
    malformed: dict[str, int]
    parse_seconds: float


class CriteoStream:
    """One trainer's endless training batches, parsed by ``workers`` background processes (see the module
    docstring); ``workers=0`` parses in the calling thread (tests, debugging). Workers start with
    ``spawn`` (:data:`START_METHOD`), so a script that iterates a stream with workers at import time needs
    Python's ``if __name__ == "__main__":`` guard.

    Args:
        files: The data files (:func:`recsys.criteo_format.data_files`); ``sizes``: rows of each of the 26 tables.
        rank, world_size, every: this trainer's share (:func:`recsys.criteo_shard.line_owner`).
        rows_per_epoch: This trainer's training rows per epoch (:attr:`recsys.criteo_shard.DataPlan.rows`), so
            that a start at batch ``s`` skips ``s * B`` rows modulo an epoch; None: skip ``s * B`` rows.
        on_chunk: ``on_chunk(stats)`` after each chunk (e.g. a Prometheus gauge), or None.

    Attributes: ``lines``, ``rows``, ``parse_seconds``: what the workers parsed so far; ``malformed``: reason ->
    count of the malformed lines met in the first pass over the trainer's files.
    """

    def __init__(self, files: Sequence[str], sizes: Sequence[int], *, rank: int = 0, world_size: int = 1,
                 every: int = 0, workers: int = 1, rows_per_epoch: int | None = None,
                 chunk_bytes: int = CHUNK_BYTES, on_chunk: Callable[[ReaderStats], None] | None = None) -> None:
        self.dataset: torch.utils.data.IterableDataset = _TrainChunks(files, sizes, rank, world_size, every,
                                                                      chunk_bytes)
        self.workers, self.rows_per_epoch, self.on_chunk = workers, rows_per_epoch, on_chunk
        self.lines, self.rows, self.parse_seconds, self.malformed = 0, 0, 0.0, Counter[str]()
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

    def stats(self) -> ReaderStats:
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
