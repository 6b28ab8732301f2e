"""Same-host shared memory for the ``socket`` transport: a client's arena that its server maps too.

On one host, a tensor sent over loopback TCP is copied into the kernel by ``sendmsg`` and out again by the reader,
with the TCP stack's per-segment work on both sides: per 852 KB message (26 tables x 128 ids x 64 floats, a
push's gradients or a lookup's answer) about 0.15 ms of CPU more than two ``memcpy`` (measured with
``benchmarks/server_request.py``). With an arena, a large message's buffers are copied into a shared file
mapped by both processes and only the header and the metadata go over the socket.

The arena belongs to the client's connection (:class:`Arena` ``create``): one file in ``/dev/shm`` of
``FXDIST_SOCKET_SHM_BYTES`` bytes (:func:`arena_bytes`), reserved with ``posix_fallocate`` so that a full tmpfs
refuses it at once instead of killing the process with ``SIGBUS`` on a later write. The server maps it when the
client asks (:meth:`Arena.attach`, which checks a random token the client wrote at its start: a server on
another host, or in another container, cannot map the same file and answers no), then the client unlinks the name
(nothing is left in ``/dev/shm`` once both have mapped it). The client does not wait for the answer: its messages go
inline until it comes (``socket_transport._Connection._attach_shm``); a process that exits normally before then
removes its file at exit. The client alone allocates in it (:class:`Ring`): per
request a block for the request's buffers and one the server writes the answer's into; both are freed when the
answer arrives, whenever that is, except a lookup's answer block, which the answer's tensors view and free when
they are gone (:meth:`Arena.lend`). A request that is never answered keeps its blocks, the ring then fills up, and
messages go inline over the socket again, as they do when a message does not fit.

Source: POSIX shared memory (``/dev/shm``, ``mmap``, ``posix_fallocate``); the idea of passing large payloads
beside a socket's control messages is TensorPipe's ``shm`` channel (``tensorpipe/channel``).
"""

from __future__ import annotations

import atexit
import collections
import mmap
import os
import secrets
import threading
import uuid
import weakref
from collections.abc import Sequence
from typing import Any, cast

import numpy
import torch

__all__ = ["Arena", "Ring", "arena_bytes", "block_bytes", "SHM_DIR", "ALIGN", "MIN_MESSAGE_BYTES", "DEFAULT_BYTES"]

SHM_DIR = "/dev/shm"
ALIGN = 64
"""Every block and every buffer in a block starts at a multiple of this (a cache line)."""
DEFAULT_BYTES = 16 << 20
"""An arena's size unless ``FXDIST_SOCKET_SHM_BYTES`` says otherwise: a few requests' worth of 852 KB messages in
flight, small beside ``/dev/shm`` (Docker's default is 64 MiB)."""
MIN_MESSAGE_BYTES = 512 << 10
"""Messages whose buffers hold fewer bytes go inline. Measured with ``benchmarks/server_request.py`` (a server's
CPU per push_lookup of 26 tables x 128 samples, the arena off / on, two runs each, 2-core AMD EPYC): 213 KB
answers 0.51, 0.46 / 0.46, 0.56 ms; 426 KB 0.52, 0.53 / 0.54, 0.58; 639 KB 0.62, 0.54 / 0.49, 0.50; 852 KB
0.65, 0.71 / 0.55, 0.54: loopback TCP is as cheap as the two copies below about half a megabyte."""
_TOKEN = 16   # bytes of the token at the arena's start; blocks start at ALIGN


def arena_bytes() -> int:
    """Bytes of a new connection's arena: ``FXDIST_SOCKET_SHM_BYTES`` (``0``: no arena, every message inline), by
    default :data:`DEFAULT_BYTES`.

    Raises:
        ValueError: ``FXDIST_SOCKET_SHM_BYTES`` is not a non-negative integer.
    """
    value = os.environ.get("FXDIST_SOCKET_SHM_BYTES", "").strip()
    if not value:
        return DEFAULT_BYTES
    if not value.isdigit():
        raise ValueError(f"FXDIST_SOCKET_SHM_BYTES={value!r}: expected a number of bytes (0: off)")
    return int(value)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Ring:
    """First-in first-out allocation of blocks in ``[start, end)`` that may be freed in any order: a block is
    taken right after the newest one (or from ``start`` again when the end is reached), and the space of freed
    blocks comes back once every older block is freed too. Thread-safe.

    Args:
        start, end: the byte range handed out (multiples of :data:`ALIGN`).
    """

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self._blocks: collections.deque[list[int]] = collections.deque()   # [first byte, end, freed], oldest first
        self._live: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> int | None:
        """The first byte of a fresh block of ``nbytes`` (rounded up to :data:`ALIGN`), None where no room is left."""
        n = _aligned(max(nbytes, 1))
        with self._lock:
            if not self._blocks:
                first: int | None = self.start if self.start + n <= self.end else None
            else:
                head, tail = self._blocks[-1][1], self._blocks[0][0]
                if head > tail:   # the live blocks in one run: room after it, or at the start before it
                    first = head if head + n <= self.end else self.start if self.start + n <= tail else None
                else:             # wrapped around: room between the newest block and the oldest
                    first = head if head + n <= tail else None
            if first is None:
                return None
            block = [first, first + n, False]
            self._blocks.append(block)
            self._live[first] = block
            return first

    def free(self, first: int) -> None:
        """Give back the block that starts at ``first``.

        Raises:
            KeyError: no live block starts there.
        """
        with self._lock:
            self._live.pop(first)[2] = True
            while self._blocks and self._blocks[0][2]:
                self._blocks.popleft()

    def live(self) -> list[tuple[int, int]]:
        """The blocks not freed, ``(first byte, end)``, oldest first."""
        with self._lock:
            return [(b[0], b[1]) for b in self._blocks if not b[2]]


class Arena:
    """A shared file mapped in this process: the client's side (:meth:`create`, with its :class:`Ring`) or the
    server's (:meth:`attach`). ``path`` is the file's name until the client unlinks it."""

    def __init__(self, mapped: mmap.mmap, path: str, token: bytes, owner: bool) -> None:
        self._map = mapped
        self.view = memoryview(mapped)
        self.size = len(mapped)
        self.path, self.token = path, token
        self.ring = Ring(ALIGN, self.size // ALIGN * ALIGN) if owner else None

    @classmethod
    def create(cls, nbytes: int) -> "Arena | None":
        """A new arena of ``nbytes`` in :data:`SHM_DIR`, None where there is none, it is full or ``nbytes`` is too
        small to hold a message (the caller then sends everything inline)."""
        if nbytes < 2 * MIN_MESSAGE_BYTES or not os.path.isdir(SHM_DIR):
            return None
        path = os.path.join(SHM_DIR, f"fxdist-socket-{os.getpid()}-{uuid.uuid4().hex}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, nbytes)   # the pages now, or ENOSPC now (not SIGBUS on a later write)
            mapped = _map(fd, nbytes)
        except (OSError, ValueError):
            os.close(fd)
            _unlink(path)
            return None
        os.close(fd)
        token = secrets.token_bytes(_TOKEN)
        mapped[:_TOKEN] = token
        _NAMED.add(path)   # until unlinked; removed at this process's exit if still there
        return cls(mapped, path, token, owner=True)

    @classmethod
    def attach(cls, path: str, nbytes: int, token: bytes) -> "Arena | None":
        """The client's arena mapped here: None unless ``path`` in :data:`SHM_DIR` is a file of ``nbytes`` that
        starts with ``token`` (another host's or container's file is not this one)."""
        if os.path.dirname(path) != SHM_DIR or len(token) != _TOKEN:
            return None
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != nbytes:
                return None
            mapped = _map(fd, nbytes)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        if mapped[:_TOKEN] != token:
            mapped.close()
            return None
        return cls(mapped, path, token, owner=False)

    def unlink(self) -> None:
        """Remove the file's name (both sides keep their mappings)."""
        _unlink(self.path)

    def put(self, first: int, buffers: Sequence[Any]) -> list[int]:
        """Copy ``buffers`` (contiguous byte buffers) one after the other into the block at ``first``, each at an
        aligned offset; their offsets."""
        offsets, at = [], first
        for b in buffers:
            data = memoryview(b).cast("B")
            self.view[at:at + data.nbytes] = data
            offsets.append(at)
            at += _aligned(data.nbytes)
        return offsets

    def take(self, offsets: Sequence[int], lengths: Sequence[int]) -> list[torch.Tensor]:
        """Fresh uint8 tensors holding the buffers at ``offsets`` (a copy each: the block may be reused once its
        request is answered).

        Raises:
            ValueError: a buffer outside the arena.
        """
        out = []
        for at, n in zip(offsets, lengths):
            if at < ALIGN or at + n > self.size:
                raise ValueError(f"shared-memory buffer [{at}, {at + n}) outside the arena of {self.size} bytes")
            t = torch.empty(n, dtype=torch.uint8)
            if n:
                memoryview(cast(Any, t.numpy()))[:] = self.view[at:at + n]
            out.append(t)
        return out

    def lend(self, first: int, offsets: Sequence[int], lengths: Sequence[int]) -> list[torch.Tensor]:
        """uint8 tensors over the buffers at ``offsets`` in the block at ``first`` itself (no copy); the block is
        freed in the ring when the last of them is gone (a client's answers: only this process writes its blocks
        again, and only once freed).

        Raises:
            ValueError: a buffer outside the block's arena.
        """
        end = max((at + n for at, n in zip(offsets, lengths)), default=first)
        if first < ALIGN or end > self.size or any(at < first for at in offsets):
            raise ValueError(f"shared-memory buffers [{first}, {end}) outside the arena of {self.size} bytes")
        block = numpy.frombuffer(self._map, dtype=numpy.uint8, count=end - first, offset=first)
        weakref.finalize(block, cast(Ring, self.ring).free, first)   # its slices (and their tensors) hold it
        # an empty buffer shares its offset with the next one (``put`` lays it out in no bytes): a view there
        # would give two tensors of different dtypes one address, which ``torch.save`` refuses
        return [torch.from_numpy(block[at - first:at - first + n]) if n else torch.empty(0, dtype=torch.uint8)
                for at, n in zip(offsets, lengths)]

    def close(self) -> None:
        """Unmap (the views handed out by :meth:`take` are copies, unaffected)."""
        self.view.release()
        try:
            self._map.close()
        except BufferError:   # a slice of the view still exported somewhere: the map goes with it
            pass


def block_bytes(lengths: Sequence[int]) -> int:
    """Bytes of a block holding buffers of ``lengths`` as :meth:`Arena.put` lays them out."""
    return sum(_aligned(n) for n in lengths)


def _map(fd: int, nbytes: int) -> mmap.mmap:
    """``fd`` mapped shared, its page table filled at once where the OS can (``MAP_POPULATE``): the ring walks
    through the whole arena in its first steps, and a minor fault per 4 KiB page in each process would be paid
    then instead."""
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


_NAMED: set[str] = set()
"""The files this process created and has not unlinked yet (an arena whose server has not answered)."""


def _unlink(path: str) -> None:
    _NAMED.discard(path)
    try:
        os.unlink(path)
    except OSError:
        pass


@atexit.register
def _unlink_named() -> None:
    """At a normal exit, remove the files of arenas still waiting for their server's answer (a process killed
    leaves them, as any ``/dev/shm`` file)."""
    for path in list(_NAMED):
        _unlink(path)
