"""Same-host shared memory for the ``socket`` transport: a client's arena that its server maps too.

On one host, a tensor sent over loopback TCP is copied into the kernel by ``sendmsg`` and out again by the reader,
with the TCP stack's per-segment work on both sides: per 852 KB message (26 tables x 128 ids x 64 floats, a
push's gradients or a lookup's answer) about 0.15 ms of CPU more than two ``memcpy`` (measured with
``benchmarks/server_request.py``). With an arena, a large message's buffers are copied into a shared file
mapped by both processes and only the header and the metadata go over the socket.

The arena belongs to the client's connection (:meth:`Arena.create`): an anonymous file (``memfd_create(2)``, no
name in any directory, so nothing to forge, guess or leave behind) of ``FXDIST_SOCKET_SHM_BYTES`` bytes
(:func:`arena_bytes`), reserved with ``posix_fallocate`` so that a full memory cgroup refuses it at once instead of
killing the process with ``SIGBUS`` on a later write, and its size sealed (``fcntl(2)`` file seals
``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``): no one can shrink it under the server's mapping, which would kill
the server with ``SIGBUS`` on its next access. The server gets the file itself, not a name: the client passes
its descriptor over a Unix-domain socket (``unix(7)`` ``SCM_RIGHTS``) to the server's :class:`FdChannel`, with a
one-time token the server gave it over their TCP connection; the server accepts only a peer of its own uid
(``SO_PEERCRED``) and only a regular, unnamed file of the expected size whose size is sealed
(:meth:`Arena.attach`), maps it and closes the descriptor. The client does not wait for any of it: its messages go
inline until the arena is mapped (``socket_transport._Connection._attach_shm``), and stay inline where it cannot
be (no ``memfd_create`` or seals, no Unix socket, another host). The client alone allocates in the arena
(:class:`Ring`): per request a block for the request's buffers and one the server writes the answer's into; both
are freed when the answer arrives, whenever that is, except a lookup's answer block, which the answer's tensors
view and free when they are gone (:meth:`Arena.lend`). A request that is never answered keeps its blocks, the ring
then fills up, and messages go inline over the socket again, as they do when a message does not fit.

Source: ``memfd_create(2)``; ``fcntl(2)`` (file seals); ``unix(7)`` (``SCM_RIGHTS``, ``SO_PEERCRED``, the
abstract namespace); ``mmap(2)``, ``posix_fallocate(3)``; the idea of passing large payloads beside a socket's
control messages is TensorPipe's ``shm`` channel (``tensorpipe/channel``).
"""

from __future__ import annotations

import array
import collections
import fcntl
import logging
import mmap
import os
import secrets
import socket
import stat
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy
import torch

__all__ = ["fresh_bytes", "Arena", "Ring", "FdChannel", "send_fd", "hand_over", "arena_bytes", "block_bytes", "ALIGN",
           "MIN_MESSAGE_BYTES", "DEFAULT_BYTES", "MEMFD_NAME", "TOKEN_BYTES", "HANDOVER_TIMEOUT_S"]

logger = logging.getLogger(__name__)

ALIGN = 64
"""Every block and every buffer in a block starts at a multiple of this (a cache line); the first ``ALIGN`` bytes
of an arena hold no block."""
DEFAULT_BYTES = 16 << 20
"""An arena's size unless ``FXDIST_SOCKET_SHM_BYTES`` says otherwise: a few requests' worth of 852 KB messages in
flight."""
MIN_MESSAGE_BYTES = 512 << 10
"""Messages whose buffers hold fewer bytes go inline. Measured with ``benchmarks/server_request.py`` (a server's
CPU per push_lookup of 26 tables x 128 samples, the arena off / on, two runs each, 2-core AMD EPYC): 213 KB
answers 0.51, 0.46 / 0.46, 0.56 ms; 426 KB 0.52, 0.53 / 0.54, 0.58; 639 KB 0.62, 0.54 / 0.49, 0.50; 852 KB
0.65, 0.71 / 0.55, 0.54: loopback TCP is as cheap as the two copies below about half a megabyte."""
MEMFD_NAME = "fxdist-socket-arena"
"""The name an arena's anonymous file shows in ``/proc/<pid>/maps`` and ``/proc/<pid>/fd`` (``/memfd:...``);
it names nothing anyone can open."""
TOKEN_BYTES = 16
"""Bytes of the one-time token that ties a descriptor sent to an :class:`FdChannel` to a TCP connection."""
HANDOVER_TIMEOUT_S = 5.0
"""Seconds a hand-over on an :class:`FdChannel` may take (connect, descriptor, answer), and a token stays valid."""
_SIZE_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)
_CREDENTIALS = struct.Struct("3i")   # struct ucred: pid, uid, gid (unix(7) SO_PEERCRED)


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


def fresh_bytes(n: int) -> torch.Tensor:
    """``n`` uninitialised bytes as a uint8 tensor over memory torch cannot resize (numpy's): a message applying
    torch's legacy ``Tensor.__setstate__`` (``set_`` with any size) to a tensor over it cannot grow it
    (:mod:`scheduling.ps.transport.safe_pickle`). An empty one is given stride 1 (``view`` to another dtype needs
    it; numpy gives 0) over an empty storage: a slice of a 1-byte one would not save (``torch.save`` checks that a
    storage's size is its tensors')."""
    t = torch.from_numpy(numpy.empty(n, numpy.uint8))
    return t if n else t.as_strided((0,), (1,))


class Arena:
    """A shared anonymous file mapped in this process: the client's side (:meth:`create`, with its :class:`Ring`
    and, until the server has it, the file's descriptor ``fd``) or the server's (:meth:`attach`)."""

    def __init__(self, mapped: mmap.mmap, owner: bool, fd: int | None = None) -> None:
        self._map = mapped
        self.view = memoryview(mapped)
        self.size = len(mapped)
        self.fd = fd
        """The file's descriptor: the client's until :meth:`close_fd` (the mapping keeps the file), else None."""
        self.ring = Ring(ALIGN, self.size // ALIGN * ALIGN) if owner else None

    @classmethod
    def create(cls, nbytes: int) -> "Arena | None":
        """A new arena of ``nbytes`` in an anonymous file whose size is sealed (``memfd_create(2)``, ``fcntl(2)``
        ``F_ADD_SEALS``), its descriptor open; None where there is none (no ``memfd_create`` or file seals here,
        no memory left) or ``nbytes`` is too small to hold a message (the caller then sends everything inline)."""
        if (nbytes < 2 * MIN_MESSAGE_BYTES or not hasattr(os, "memfd_create") or not _SIZE_SEALS
                or not hasattr(fcntl, "F_ADD_SEALS")):
            return None
        try:
            fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, nbytes)   # the pages now, or ENOSPC now (not SIGBUS on a later write)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS | fcntl.F_SEAL_SEAL)   # its size fixed for good
            mapped = _map(fd, nbytes)
        except (OSError, ValueError):
            os.close(fd)
            return None
        return cls(mapped, owner=True, fd=fd)

    @classmethod
    def attach(cls, fd: int, nbytes: int) -> "Arena":
        """The client's arena mapped here from the descriptor ``fd`` it sent (left open: the caller closes it).

        Only a file whose size cannot change is mapped: shrunk under the mapping, the next access to a page past
        its end would kill this process with ``SIGBUS``. So ``fd`` must carry the seals ``F_SEAL_SHRINK`` and
        ``F_SEAL_GROW`` (``fcntl(2)``; only a ``memfd_create(2)`` file can: a file opened by name in ``/dev/shm``
        or anywhere else cannot be sealed), be a regular file with no name (``st_nlink == 0``) of ordinary pages
        (not ``MFD_HUGETLB``'s, where a fault finding no huge page free is a ``SIGBUS`` too) and hold ``nbytes``.

        Raises:
            ValueError: ``fd`` is not such a file (the message says what it lacks).
            OSError: it cannot be mapped (e.g. a file sealed against writing).
        """
        if not isinstance(nbytes, int) or nbytes <= ALIGN:
            raise ValueError(f"shared-memory arena of {nbytes!r} bytes: expected more than {ALIGN}")
        get_seals = getattr(fcntl, "F_GET_SEALS", None)
        if get_seals is None or not _SIZE_SEALS:
            raise ValueError("no file seals on this platform: a shared-memory arena cannot be mapped safely")
        try:
            seals = fcntl.fcntl(fd, get_seals)
        except OSError as e:   # EINVAL: a file that cannot carry seals (not memfd_create's)
            raise ValueError(f"the arena's file cannot be sealed (not a memfd_create file): {e}") from e
        if seals & _SIZE_SEALS != _SIZE_SEALS:
            raise ValueError("the arena's size is not sealed (F_SEAL_SHRINK and F_SEAL_GROW): it could be shrunk "
                             "under the mapping")
        info = os.fstat(fd)   # after the seals: the size cannot change any more
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 0:
            raise ValueError("the arena's file is not an anonymous regular file (memfd_create)")
        if info.st_blksize != mmap.PAGESIZE:
            raise ValueError(f"the arena's file has pages of {info.st_blksize} bytes, not {mmap.PAGESIZE} (huge pages)")
        if info.st_size != nbytes:
            raise ValueError(f"the arena's file holds {info.st_size} bytes, not the {nbytes} announced")
        return cls(_map(fd, nbytes), owner=False)

    def close_fd(self) -> None:
        """Close the file's descriptor (once the server has it: the mappings keep the file)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

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
            t = fresh_bytes(n)
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
        """Unmap and close the descriptor (the views handed out by :meth:`take` are copies, unaffected); the
        file is gone once neither side maps it."""
        self.close_fd()
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


# ---- handing an arena's descriptor to the server ----------------------------------------------------------------
class FdChannel:
    """Where the clients of a server process hand over their arenas: a Unix-domain stream socket in the abstract
    namespace (``unix(7)``: no file, gone with the process, reachable from this host's network namespace only)
    served by a daemon thread; :attr:`name` is its address.

    A hand-over: the server gives a client connection a one-time token over their TCP connection (:meth:`expect`,
    valid :data:`HANDOVER_TIMEOUT_S`); the client connects here and sends the token with its arena's descriptor
    (``SCM_RIGHTS``, :func:`send_fd`). This side answers a peer of another uid (``SO_PEERCRED``), an unknown, used
    or expired token, anything but one descriptor, and a file :meth:`Arena.attach` refuses with the reason, and
    otherwise maps the arena, keeps it for the token's connection and answers ``ok``; that connection then takes
    it on its own reader thread (:meth:`claim`). A descriptor is closed once mapped or refused.

    Raises:
        OSError: the socket cannot be bound (no abstract namespace: not Linux).
    """

    def __init__(self) -> None:
        self.name = f"\0fxdist-socket-{os.getpid()}-{secrets.token_hex(8)}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(self.name)
            self._listener.listen(16)
        except BaseException:
            self._listener.close()
            raise
        self._lock = threading.Lock()
        self._expected: dict[bytes, tuple[object, int, float]] = {}   # token -> (owner, bytes, deadline)
        self._mapped: dict[bytes, tuple[object, Arena, float]] = {}   # token -> (owner, arena, deadline)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="fxdist-socket-fd-channel", daemon=True)
        self._thread.start()

    def expect(self, owner: object, nbytes: int) -> bytes:
        """A fresh token for ``owner`` (a connection) to send with an arena of ``nbytes``; ``owner``'s earlier
        tokens and arenas not claimed are dropped, and so are the expired ones."""
        token, now = secrets.token_bytes(TOKEN_BYTES), time.monotonic()
        with self._lock:
            self._drop(lambda who, deadline: who is owner or deadline < now)
            self._expected[token] = (owner, nbytes, now + HANDOVER_TIMEOUT_S)
        return token

    def claim(self, owner: object, token: bytes) -> Arena | None:
        """The arena handed over with ``token`` for ``owner``, None where there is none (never sent, refused,
        expired, or another connection's)."""
        with self._lock:
            entry = self._mapped.get(token) if isinstance(token, bytes) else None
            if entry is None or entry[0] is not owner:
                return None
            del self._mapped[token]
        return entry[1]

    def _drop(self, which: Any) -> None:
        """Forget the tokens and unmap the arenas not claimed for which ``which(owner, deadline)`` (under the lock)."""
        for token, (owner, _, deadline) in list(self._expected.items()):
            if which(owner, deadline):
                del self._expected[token]
        for token, (owner, arena, deadline) in list(self._mapped.items()):
            if which(owner, deadline):
                del self._mapped[token]
                arena.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:   # closed
                return
            with conn:
                try:
                    conn.settimeout(HANDOVER_TIMEOUT_S)
                    answer = self._receive(conn)
                    if answer != "ok":
                        logger.warning("shared-memory arena hand-over refused: %s", answer)
                    conn.sendall(answer.encode())
                except OSError:
                    pass

    def _receive(self, conn: socket.socket) -> str:
        """One hand-over on the accepted ``conn``: ``ok`` or why it was refused."""
        uid = _CREDENTIALS.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))[1]
        if uid != os.geteuid():
            return f"peer uid {uid} is not the server's ({os.geteuid()})"
        token, ancillary, flags, _ = conn.recvmsg(TOKEN_BYTES, socket.CMSG_SPACE(4),
                                                  getattr(socket, "MSG_CMSG_CLOEXEC", 0))
        fds = array.array("i")
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        try:
            now = time.monotonic()
            with self._lock:
                expected = self._expected.pop(token, None)   # one time, whatever follows
            if expected is None or expected[2] < now:
                return "unknown, used or expired token"
            if len(fds) != 1 or flags & socket.MSG_CTRUNC:
                return f"expected one descriptor, got {len(fds)}{' and more' if flags & socket.MSG_CTRUNC else ''}"
            try:
                arena = Arena.attach(fds[0], expected[1])
            except (OSError, ValueError) as e:
                return str(e)
            with self._lock:
                if self._closed:
                    arena.close()
                    return "the server is closing"
                self._mapped[token] = (expected[0], arena, now + HANDOVER_TIMEOUT_S)
            return "ok"
        finally:
            for fd in fds:
                os.close(fd)

    def close(self, join_s: float = 5.0) -> None:
        """Stop accepting hand-overs and unmap the arenas not claimed (those claimed are their connections')."""
        with self._lock:
            self._closed = True
            self._drop(lambda who, deadline: True)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)   # wakes the accept thread
        except OSError:
            pass
        self._listener.close()
        if self._thread is not threading.current_thread():
            self._thread.join(join_s)


def send_fd(name: str, token: bytes, fd: int, timeout_s: float = HANDOVER_TIMEOUT_S) -> None:
    """Hand the descriptor ``fd`` over to the :class:`FdChannel` at ``name`` (an abstract Unix-socket address)
    with ``token``, and wait for its answer (``unix(7)`` ``SCM_RIGHTS``).

    Raises:
        ValueError: ``name`` is not an fxdist channel's address or ``token`` not a token (nothing was sent), or the
            channel refused the descriptor (its reason).
        PermissionError: the channel's process runs under another uid (nothing was sent).
        OSError: the channel cannot be reached, or did not answer within ``timeout_s`` seconds.
    """
    if not (isinstance(name, str) and name.startswith("\0fxdist-socket-")
            and isinstance(token, bytes) and len(token) == TOKEN_BYTES):
        raise ValueError(f"not an arena hand-over address and token: {name!r}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(name)
        uid = _CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))[1]
        if uid != os.geteuid():
            raise PermissionError(f"the arena hand-over socket belongs to uid {uid}, not this process's "
                                  f"({os.geteuid()}): descriptor not sent")
        socket.send_fds(sock, [token], [fd])
        answer = b""
        while len(answer) < 1024:
            chunk = sock.recv(1024)
            if not chunk:
                break
            answer += chunk
    if answer != b"ok":
        raise ValueError(f"the server refused the shared-memory arena: {answer.decode(errors='replace') or 'no answer'}")


def hand_over(arena: Arena, call: Callable[[str, tuple, float], torch.futures.Future],
              timeout_s: float) -> torch.futures.Future:
    """Hand this client's ``arena`` to the server of a connection whose requests ``call(method, args, timeout_s)``
    sends, without waiting: ``attach_shm("channel", size)`` answers the server's :class:`FdChannel` and a one-time
    token; a short-lived thread sends the descriptor there with the token (:func:`send_fd`), then
    ``attach_shm("install", token)``, which the server answers once the arena is that connection's. Each step
    within ``timeout_s`` seconds.

    Returns:
        A Future of True once the server mapped it (completed on the connection's reader thread, as it reads that
        answer; the descriptor closed, the mapping stays), of False where the server has no channel or did not
        install it, or of the exception of the step that failed.
    """
    result: torch.futures.Future = torch.futures.Future()

    def installed(future: torch.futures.Future) -> None:
        try:
            mapped = future.value() is True
        except Exception as e:  # noqa: BLE001  (timed out, or the connection failed)
            result.set_exception(e)
            return
        if mapped:
            arena.close_fd()
        result.set_result(mapped)

    def send(channel: Any) -> None:   # a thread of its own: the blocking Unix-socket exchange, then a request
        try:
            name, token = channel
            send_fd(name, token, cast(int, arena.fd), timeout_s)
            call("attach_shm", ("install", token), timeout_s).add_done_callback(installed)
        except Exception as e:  # noqa: BLE001  (refused, unreachable, the connection failed)
            result.set_exception(e)

    def offered(future: torch.futures.Future) -> None:
        try:
            channel = future.value()
        except Exception as e:  # noqa: BLE001  (timed out, or the connection failed)
            result.set_exception(e)
            return
        if channel is None:   # the server has no channel
            result.set_result(False)
        else:
            threading.Thread(target=send, args=(channel,), name="fxdist-socket-arena-hand-over", daemon=True).start()

    try:
        call("attach_shm", ("channel", arena.size), timeout_s).add_done_callback(offered)
    except Exception as e:  # noqa: BLE001  (the connection failed at once)
        result.set_exception(e)
    return result
