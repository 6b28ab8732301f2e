"""Training from a stream (``[data] follow = true``): one trainer's batches from a folder or glob of Criteo files
read as the files appear, with no epochs.

How the stream is read (:func:`follow_chunks`):

- the files are the folder's (or the glob's) in natural order, as :func:`recsys.criteo_format.data_files` sorts
  them, listed again every time the reader has read all there is; it then waits ``poll_s`` seconds between looks;
- a file is read up to its last complete line; a partial last line (no ``\\n`` yet) is read once it is complete.
  A file is *finished* once a later file (in natural order) exists: then its last line counts even without a
  ``\\n``, and the reader moves on. So the writer appends to the last file only, and starts the next file once
  the previous one is complete;
- files must arrive in natural order: a new file that sorts before the file being read (or before one already
  read) is a :class:`recsys.criteo_format.DataError` (its rows could not be placed in the stream). Compressed
  files (gzip, bz2, xz) must appear whole: write them under a hidden name (``.day_3.gz.tmp``, which a folder's
  listing skips) or one the glob does not match, then rename;
- the files already read must stay: a restarted trainer reads the stream again from its first file to reach its
  row (see below).

Which trainer trains a line: every k-th line of each file is held out (``i % k == k - 1``, as without follow);
the training lines of every file are dealt round-robin to the ``W`` trainers (:func:`recsys.criteo_shard.line_owner`
"by line", whatever the number of files: files that appear later cannot be dealt whole, since their number is
not known), so every trainer reads every file and the trainers' rows differ by at most one per file.

A trainer's batches are its training rows in stream order, ``B`` consecutive rows each, never wrapping around.
Starting at batch ``s`` skips ``s * B`` rows, so a restarted trainer sees the batches of an uninterrupted run; the
job's two phases read one stream through :class:`recsys.criteo_stream.SharedBatches`. The reader runs in at most
one worker process: chunk boundaries depend on when the data arrived, so the chunks cannot be dealt to several
workers the same way on every run; the batches never depend on them.

Held-out rows (:func:`held_out_rows`): the held-out lines of the complete lines present when the reader starts
(up to ``max_rows``); :func:`scan_present` is the first pass over them; :func:`present_rows`, the rows of either
split of those lines, for the job's stages after training.

Source: ``tail -F`` semantics (read to the end, then poll) and log-rotation conventions (write, then rename);
torch.utils.data (IterableDataset, ``get_worker_info``).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recsys.criteo_format import Batch, DataError, ParseStats, data_files, hash_ids, open_data
from recsys.criteo_parse import parse_chunk
from recsys.criteo_shard import CHUNK_BYTES, DataPlan, count_chunk, line_owner, read_chunks
from recsys.criteo_stream import START_METHOD, CriteoStream, ReaderStats

__all__ = ["follow_files", "follow_chunks", "FollowStream", "HeldOut", "held_out_rows", "present_rows",
           "scan_present"]

Chunk = tuple[Path, bytes, int]
"""``(file, bytes of whole lines, index of the first of them in the file)``."""


def follow_files(path: str | Path) -> list[Path]:
    """The stream's files now, in natural order; ``[]`` before the first one arrives.

    Raises:
        DataError: ``path`` is neither a glob nor an existing folder.
    """
    text = str(path)
    if not any(c in text for c in "*?[") and not Path(path).expanduser().is_dir():
        raise DataError(f"{text}: with [data] follow, path must be a folder or a glob, and the folder must exist")
    return data_files(path, allow_empty=True)


def _read_lines(path: Path, pos: int, first: int, chunk_bytes: int, final: bool) -> Iterator[tuple[bytes, int]]:
    """``(bytes, first line index)`` of the complete lines of ``path`` from byte ``pos`` (line ``first``) to its end;
    with ``final`` also its last line without a ``\\n``."""
    with open_data(path) as f:
        f.seek(pos)
        yield from read_chunks(f, path, first, chunk_bytes, final=final)


def _out_of_order(files: list[Path], upto: int, done: set[Path]) -> None:
    """Raise when a file before index ``upto`` of ``files`` was not read (it arrived out of natural order)."""
    late = [f for f in files[:upto] if f not in done]
    if late:
        raise DataError(f"{late[0]}: arrived after a file that sorts after it had been read; with [data] follow, "
                        "files must arrive in natural order (day_0, day_1, ...)")


def follow_chunks(path: str | Path, *, chunk_bytes: int = CHUNK_BYTES, poll_s: float = 1.0, wait: bool = True,
                  sleep: Callable[[float], None] = time.sleep,
                  alive: Callable[[], bool] | None = None) -> Iterator[Chunk | None]:
    """The stream's complete lines in order, as chunks (see the module docstring), endless.

    Args:
        wait: When everything there is has been read: poll every ``poll_s`` seconds (True), or end (False: the
            lines present now, without a partial last line).
        sleep, alive: The wait (tests inject one); ``alive()`` False ends the stream (a reader whose trainer died).

    Yields:
        A :class:`Chunk`, or None once when the reader starts waiting (again once after new data came).

    Raises:
        DataError: ``path`` is not a folder or glob, a file arrived out of order or disappeared while it was
            read, or a file cannot be read.
    """
    done: set[Path] = set()
    cur: Path | None = None
    pos = line = 0
    waiting = False
    while True:
        files = follow_files(path)
        if cur is None:
            fresh = [f for f in files if f not in done]
            if fresh:
                _out_of_order(files, files.index(fresh[0]), done)
                cur, pos, line = fresh[0], 0, 0
        if cur is not None:
            if cur not in files:
                raise DataError(f"{cur}: disappeared while [data] follow read it")
            i = files.index(cur)
            _out_of_order(files, i, done)
            final, got = i + 1 < len(files), False  # listed before reading: all of cur was written by then
            for buf, first in _read_lines(cur, pos, line, chunk_bytes, final):
                got, waiting = True, False
                yield cur, buf, first
                pos, line = pos + len(buf), first + buf.count(b"\n")
            if final:
                done.add(cur)
                cur = None
                continue
            if got:
                continue  # more may have come while reading
        if not wait or (alive is not None and not alive()):
            return
        if not waiting:
            waiting = True
            yield None
        sleep(poll_s)


class _FollowChunks(torch.utils.data.IterableDataset):
    """The parsed chunks of one trainer's training lines of the stream (one DataLoader worker at most); a
    ``{"waiting": True}`` item when the reader starts waiting for data."""

    def __init__(self, path: str, sizes: Sequence[int], rank: int, world_size: int, every: int, chunk_bytes: int,
                 poll_s: float, stop: Any) -> None:
        self.path, self.sizes, self.rank, self.world_size = path, list(sizes), rank, world_size
        self.every, self.chunk_bytes, self.poll_s, self.stop = every, chunk_bytes, poll_s, stop

    def __iter__(self) -> Iterator[dict[str, Any]]:
        parent = os.getppid() if torch.utils.data.get_worker_info() is not None else None

        def alive() -> bool:  # the stream was closed, or (in a worker) the trainer is gone: stop polling
            return not self.stop.is_set() and (parent is None or os.getppid() == parent)

        for item in follow_chunks(self.path, chunk_bytes=self.chunk_bytes, poll_s=self.poll_s, alive=alive):
            if item is None:
                yield {"waiting": True}
            else:
                yield self._parse(*item)

    def _parse(self, path: Path, buf: bytes, first: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        mine = lambda idx: line_owner(0, 0, self.world_size, self.every, first + idx) == self.rank  # noqa: E731
        parsed = parse_chunk(buf, mine)
        stats = ParseStats()
        count_chunk(stats, parsed, buf, first, path.name)
        ids = hash_ids(parsed.values, parsed.present, self.sizes)
        return {"dense": torch.from_numpy(parsed.dense), "sparse": torch.from_numpy(ids),
                "labels": torch.from_numpy(parsed.labels), "lines": len(parsed) + stats.malformed_total,
                "malformed": dict(stats.malformed), "seconds": time.perf_counter() - t0, "epoch": 0}


class FollowStream(CriteoStream):
    """One trainer's batches from a stream of Criteo files (see the module docstring): endless while data keeps
    coming, blocking while it waits for more; never wrapping around. ``workers`` is capped at 1.

    Args:
        path: The folder or glob (``[data] path``); ``sizes``: rows of each of the 26 tables.
        rank, world_size, every: this trainer's share (:func:`recsys.criteo_shard.line_owner`, by line).
        poll_s: Seconds between looks for new data (``[data] follow_poll_s``).
        on_chunk: As :class:`recsys.criteo_stream.CriteoStream`'s.
        on_wait: ``on_wait(True)`` when the trainer needs a batch and the reader has read all there is (once, not
            per poll), ``on_wait(False)`` when data came again; or None.

    Attributes: ``waiting``: the trainer waits for data now; ``waits``: how many times it started waiting.
    """

    def __init__(self, path: str | Path, sizes: Sequence[int], *, rank: int = 0, world_size: int = 1, every: int = 0,
                 workers: int = 1, poll_s: float = 1.0, chunk_bytes: int = CHUNK_BYTES,
                 on_chunk: Callable[[ReaderStats], None] | None = None,
                 on_wait: Callable[[bool], None] | None = None) -> None:
        super().__init__([], sizes, rank=rank, world_size=world_size, every=every, workers=min(workers, 1),
                         chunk_bytes=chunk_bytes, on_chunk=on_chunk)
        self._stop = multiprocessing.get_context(START_METHOD).Event()  # a waiting worker ends when it is set
        self.dataset = _FollowChunks(str(path), sizes, rank, world_size, every, chunk_bytes, poll_s, self._stop)
        self.path, self.on_wait = str(path), on_wait
        self.waiting, self.waits = False, 0

    def __len__(self) -> int:
        """0: a stream has no epochs."""
        return 0

    def close(self) -> None:
        """Stop the worker process, at once even while it waits for data (within ``poll_s``); nothing is read
        after this."""
        self._stop.set()
        super().close()

    def _chunks(self) -> Iterator[dict[str, Any]]:
        # batches() asks for a chunk only when it lacks rows for the next batch: a marker met here means the
        # trainer waits, not just the reader ahead of it
        for item in super()._chunks():
            if item.get("waiting"):
                self.waiting, self.waits = True, self.waits + 1
                if self.on_wait is not None:
                    self.on_wait(True)
                continue
            if self.waiting:
                self.waiting = False
                if self.on_wait is not None:
                    self.on_wait(False)
            yield item


@dataclass
class HeldOut:
    """Held-out (or, from :func:`present_rows`, training) rows in memory: ``dense (n, 13) float32``, ``sparse (n, 26) int64``, ``labels (n,) float32``."""

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.labels.shape[0]

    def all_batches(self, batch_size: int) -> Iterator[Batch]:
        """Every row once, in batches of at most ``batch_size`` (the last one may be smaller)."""
        for i in range(0, len(self), batch_size):
            end = i + batch_size
            yield Batch(self.dense[i:end], self.sparse[i:end], self.labels[i:end])


def held_out_rows(path: str | Path, sizes: Sequence[int], every: int, max_rows: int, *,
                  chunk_bytes: int = CHUNK_BYTES) -> HeldOut | None:
    """The held-out rows (line ``i % every == every - 1`` of each file) of the complete lines of the stream now, the
    first ``max_rows`` of them; None when there is none (no file yet, or ``every = 0``).

    Raises:
        DataError: as :func:`follow_chunks`.
    """
    return present_rows(path, sizes, every, max_rows, split="eval", chunk_bytes=chunk_bytes) if every else None


def present_rows(path: str | Path, sizes: Sequence[int], every: int, max_rows: int, *, split: str = "eval",
                 chunk_bytes: int = CHUNK_BYTES) -> HeldOut | None:
    """The first ``max_rows`` rows of ``split`` among the complete lines of the stream now (a half-written last
    line is left out, as :func:`follow_chunks` with ``wait=False`` does): "eval", the held-out lines (``i % every ==
    every - 1`` of each file; none with ``every = 0``), or "train", all the others (every trainer's, in stream
    order). For the job's end stages (the int8 comparison's held-out and calibration batches, the export's sample
    input), which read the data once while a writer may still be appending. None when there is no such row.

    Raises:
        ValueError: ``split`` is neither "train" nor "eval".
        DataError: as :func:`follow_chunks`.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"present_rows: split must be 'train' or 'eval', got {split!r}")
    owner = -1 if split == "eval" else 0  # line_owner of 1 trainer: -1 held out, 0 training
    parts: list[tuple[np.ndarray, ...]] = []
    total = 0
    for item in follow_chunks(path, chunk_bytes=chunk_bytes, wait=False):
        _, buf, first = item  # type: ignore[misc]  # no None without waiting
        wanted = lambda idx: line_owner(0, 0, 1, every, first + idx) == owner  # noqa: E731, B023
        parsed = parse_chunk(buf, wanted)
        take = min(len(parsed), max_rows - total)
        parts.append((parsed.dense[:take], hash_ids(parsed.values[:take], parsed.present[:take], sizes),
                      parsed.labels[:take]))
        total += take
        if total >= max_rows:
            break
    if not total:
        return None
    return HeldOut(*(torch.from_numpy(np.concatenate(col)) for col in zip(*parts)))


def scan_present(path: str | Path, world_size: int, eval_fraction: float, *,
                 chunk_bytes: int = CHUNK_BYTES) -> DataPlan:
    """The first pass over the complete lines of the stream now (the launcher's record; a stream's rows per
    trainer grow as it runs): lines, training rows per trainer (by line), held-out rows, parse statistics.

    Raises:
        DataError: as :func:`follow_chunks`.
    """
    every = round(1 / eval_fraction) if eval_fraction > 0 else 0
    stats, files = ParseStats(), list[str]()
    rows = np.zeros(world_size + 1, np.int64)  # the last slot counts the held-out rows (owner -1)
    lines, t0 = 0, time.perf_counter()
    for item in follow_chunks(path, chunk_bytes=chunk_bytes, wait=False):
        file, buf, first = item  # type: ignore[misc]  # no None without waiting
        if not files or files[-1] != str(file):
            files.append(str(file))
        parsed = parse_chunk(buf)
        lines += parsed.line_count
        count_chunk(stats, parsed, buf, first, file.name)
        owner = line_owner(0, 0, world_size, every, first + parsed.lines)
        rows += np.bincount(np.where(owner < 0, world_size, owner), minlength=world_size + 1)
    return DataPlan(files, world_size, every, [int(r) for r in rows[:world_size]], int(rows[world_size]),
                    stats.as_dict(), lines, time.perf_counter() - t0, sharding="by line (follow)")
