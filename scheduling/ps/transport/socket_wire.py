"""The ``socket`` transport's wire format: one message = header, buffer lengths, metadata, raw buffers.

A message is

- a 16-byte header ``<BBHIQ``: kind (request, answer, error; with the shared-memory flags :data:`SHM_DATA`,
  :data:`SHM_REPLY`), method (index in ``socket_transport.WIRE_METHODS``), the number ``n`` of raw buffers, the
  length of the metadata, the request id;
- ``n`` buffer lengths (``<nQ``); with :data:`SHM_DATA`, ``n`` offsets into the connection's shared-memory arena
  (``<nQ``, the buffers are there and not on the stream); with :data:`SHM_REPLY`, the ``(offset, capacity)`` of
  the arena block the answer may go into (``<2Q``); then the metadata: the arguments (or the answer, or the
  server's exception) pickled with protocol 5, every dense CPU tensor replaced by an out-of-band buffer
  (:func:`dumps`);
- the ``n`` buffers (unless in the arena), each a tensor's bytes, sent with ``sendmsg`` from the tensor's own
  memory and received with ``recv_into`` fresh numpy-backed memory (``shm_arena.fresh_bytes``, which torch cannot
  resize; no per-element work, no copy beyond the kernel's).

A server reads requests under :class:`FrameLimits` (metadata bytes, buffers, bytes per message, checked against
the header before anything is allocated; a read timeout once a message has begun) and decodes them, as both
ends decode everything, with the restricted unpickler of :mod:`scheduling.ps.transport.safe_pickle` (no code runs
from the wire).

Used by both ends: the client connections (:mod:`scheduling.ps.transport.socket_transport`) and the server
(:mod:`scheduling.ps.transport.socket_server`).

Source: Python ``socket`` (``sendmsg``, ``recv_into``, ``TCP_NODELAY``); PEP 574 (pickle protocol 5,
out-of-band buffers).
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import socket
import ssl
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch

from .safe_pickle import allow, checked_rebuild
from .safe_pickle import loads as safe_loads
from .shm_arena import block_bytes, fresh_bytes

__all__ = ["REQUEST", "ANSWER", "ERROR", "SHM_DATA", "SHM_REPLY", "HEADER", "SOCKET_BUFFER_BYTES", "tune", "dumps",
           "send_message", "recv_frame", "recv_message", "Frame", "Undecodable", "FrameLimits", "FrameRejected",
           "MAX_META_BYTES", "MAX_BUFFERS", "MAX_FRAME_BYTES", "FRAME_TIMEOUT_S", "FRAME_BYTES_ENV"]

REQUEST, ANSWER, ERROR = 0, 1, 2
"""Message kinds: a request; its answer; the server's exception instead of an answer."""
SHM_DATA, SHM_REPLY = 0x10, 0x20
"""Flags on a header's kind: the buffers are in the client's shared-memory arena (their offsets follow the
lengths); the request carries the arena block its answer may be written into."""
_KIND_MASK = 0x0F
HEADER = struct.Struct("<BBHIQ")
"""A message's fixed header: kind (with flags), method, buffer count, metadata length, request id."""
_MAX_IOV = 512  # buffers per sendmsg call (the kernel's IOV_MAX is 1024)
SOCKET_BUFFER_BYTES = 4 << 20
"""Send and receive buffer of every connection (``SO_SNDBUF``/``SO_RCVBUF``): a few steps' messages, so that a
sender rarely waits in ``sendmsg`` for the other side to read (the kernel may cap it: ``net.core.wmem_max``)."""
MAX_META_BYTES = 64 << 20
"""Default cap on a message's pickled metadata (its tensors travel as buffers beside it)."""
MAX_BUFFERS = 4096
"""Default cap on a message's raw buffers (a coalesced batch or a state dict has hundreds at most)."""
MAX_FRAME_BYTES = 2 << 30
"""Default cap on a message's bytes, metadata and buffers (``FXDIST_SOCKET_MAX_FRAME_BYTES`` overrides it)."""
FRAME_TIMEOUT_S = 30.0
"""Default seconds a message that has begun may go without a byte arriving (idle between messages: no limit)."""
FRAME_BYTES_ENV = "FXDIST_SOCKET_MAX_FRAME_BYTES"
_FLAGS = _KIND_MASK | SHM_DATA | SHM_REPLY


class FrameRejected(ValueError):
    """A message refused from its header alone (``reason``: ``"bad_frame"`` or ``"over_limit"``): the connection
    cannot be read on.

    See docs/troubleshooting.md#framerejected.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class FrameLimits:
    """What one received message may declare, checked against its header before anything is allocated
    (:func:`recv_frame`), and how long it may stall once begun.

    Args:
        max_meta_bytes: pickled metadata bytes (:data:`MAX_META_BYTES`).
        max_buffers: raw buffers (:data:`MAX_BUFFERS`).
        max_frame_bytes: metadata and buffers together (:data:`MAX_FRAME_BYTES`).
        read_timeout_s: seconds without a byte once a message has begun (:data:`FRAME_TIMEOUT_S`); a server sets
            it as the connection's ``SO_RCVTIMEO`` and ``SO_SNDTIMEO``.
    """

    max_meta_bytes: int = MAX_META_BYTES
    max_buffers: int = MAX_BUFFERS
    max_frame_bytes: int = MAX_FRAME_BYTES
    read_timeout_s: float = FRAME_TIMEOUT_S

    @classmethod
    def from_env(cls) -> "FrameLimits":
        """The defaults, with ``FXDIST_SOCKET_MAX_FRAME_BYTES`` (bytes) as ``max_frame_bytes`` when set.

        Raises:
            ValueError: ``FXDIST_SOCKET_MAX_FRAME_BYTES`` is not a positive integer.
        """
        text = os.environ.get(FRAME_BYTES_ENV, "").strip()
        if not text:
            return cls()
        if not text.isdigit() or int(text) <= 0:
            raise ValueError(f"{FRAME_BYTES_ENV}={text!r}: expected a positive number of bytes")
        return cls(max_frame_bytes=int(text))

    def check_header(self, flagged: int, count: int, meta_len: int) -> None:
        """A header's kind, flags, buffer count and metadata length.

        Raises:
            FrameRejected: an unknown kind or flag (``bad_frame``), or more than a limit allows (``over_limit``).
        """
        if flagged & ~_FLAGS or (flagged & _KIND_MASK) > ERROR:
            raise FrameRejected("bad_frame", f"unknown message kind/flags 0x{flagged:02x}")
        if count > self.max_buffers:
            raise FrameRejected("over_limit", f"a message of {count} buffers (at most {self.max_buffers})")
        if meta_len > min(self.max_meta_bytes, self.max_frame_bytes):
            raise FrameRejected("over_limit", f"a message of {meta_len} metadata bytes (at most "
                                              f"{min(self.max_meta_bytes, self.max_frame_bytes)})")

    def check_size(self, meta_len: int, lengths: Sequence[int]) -> None:
        """A message's total bytes: ``meta_len`` and the buffers' ``lengths``.

        Raises:
            FrameRejected: more than ``max_frame_bytes`` (``over_limit``).
        """
        total = meta_len + sum(lengths)
        if total > self.max_frame_bytes:
            raise FrameRejected("over_limit", f"a message of {total} bytes (at most {self.max_frame_bytes}, "
                                              f"{FRAME_BYTES_ENV})")


def tune(sock: socket.socket) -> None:
    """``TCP_NODELAY`` and :data:`SOCKET_BUFFER_BYTES` buffers on ``sock`` (a listener: before ``listen``)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


# ---- the wire: pickle protocol 5 with tensors out of band -----------------------------------------------------
def _rebuild(buffer: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over the received bytes ``buffer`` (uint8: its own memory, or a lookup's answer block in the
    shared-memory arena, ``Arena.lend``): no copy."""
    return buffer.view(dtype).view(shape)


allow(__name__, "_rebuild", checked_rebuild)   # what a message naming it decodes as (arguments checked)


def _reduce_tensor(t: torch.Tensor) -> Any:
    if type(t) is torch.Tensor:   # the usual case, a plain dense CPU tensor: its memory through numpy, no view ops
        try:
            array = t.detach().numpy()   # refuses other devices and layouts, quantized, conj/neg views, bfloat16
        except (RuntimeError, TypeError):
            array = None
        if array is not None and array.flags.c_contiguous:
            return _rebuild, (pickle.PickleBuffer(cast(Any, array)), t.dtype, tuple(t.shape))
    if t.layout is not torch.strided or t.is_quantized or t.device.type == "meta":
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)  # rare: torch's own (in-band) pickling
    flat = t.detach()
    if flat.device.type != "cpu" or flat.is_conj() or flat.is_neg() or not flat.is_contiguous():  # else: no copy
        flat = flat.cpu().resolve_conj().resolve_neg().contiguous()
    flat = flat.view(-1).view(torch.uint8)
    return _rebuild, (pickle.PickleBuffer(cast(Any, flat.numpy())), t.dtype, tuple(t.shape))


class _Pickler(pickle.Pickler):
    dispatch_table = {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}


def dumps(obj: Any) -> tuple[bytes, list[Any]]:
    """``(metadata, buffers)``: ``obj`` pickled (protocol 5), each plain ``torch.Tensor`` in it as one raw buffer
    (its bytes, a view of the tensor's memory when it is contiguous on the CPU)."""
    buffers: list[Any] = []
    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=lambda b: buffers.append(b.raw())).dump(obj)
    return out.getvalue(), buffers


def send_message(sock: socket.socket, kind: int, method: int, rid: int, meta: bytes, buffers: Sequence[Any], *,
                 placed: Sequence[int] | None = None, reply: tuple[int, int] | None = None) -> None:
    """Send one message (header, buffer lengths, metadata, buffers) with ``sendmsg``, however many calls it takes.

    ``placed``: the buffers were copied into the connection's shared-memory arena at these offsets
    (:mod:`scheduling.ps.transport.shm_arena`): only their lengths and offsets are sent. ``reply`` (a request's): the
    ``(offset, capacity)`` of the arena block the server may write the answer's buffers into.

    Raises:
        OSError: the connection failed.
    """
    lengths = [memoryview(b).nbytes for b in buffers]
    flags = (SHM_DATA if placed is not None else 0) | (SHM_REPLY if reply is not None else 0)
    head = HEADER.pack(kind | flags, method, len(buffers), len(meta), rid) + struct.pack(f"<{len(buffers)}Q", *lengths)
    if placed is not None:
        head += struct.pack(f"<{len(placed)}Q", *placed)
    if reply is not None:
        head += struct.pack("<2Q", *reply)
    parts = [memoryview(head + meta)]
    if placed is None:
        parts += [memoryview(b).cast("B") for b, n in zip(buffers, lengths) if n]
    if isinstance(sock, ssl.SSLSocket):   # TLS (tls.py): no sendmsg; each part through the TLS layer
        for part in parts:
            sock.sendall(part)
        return
    while parts:
        sent = sock.sendmsg(parts[:_MAX_IOV])
        while parts and sent >= parts[0].nbytes:
            sent -= parts[0].nbytes
            parts.pop(0)
        if sent:
            parts[0] = parts[0][sent:]


_IDLE = (BlockingIOError, InterruptedError, TimeoutError, ssl.SSLWantReadError)
"""What a read raises when the connection's read timeout (``SO_RCVTIMEO``) passed with no byte."""


def _recv_header(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` (a header) from the stream: before its first byte the connection may be idle for any time
    (a read timeout then only means "nothing yet"); once it has begun, as :func:`_recv_into`."""
    while True:
        try:
            got = sock.recv_into(view)
            break
        except _IDLE:
            continue
    if got == 0:
        raise ConnectionError("connection closed by the peer")
    if got < view.nbytes:
        _recv_into(sock, view[got:])


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, size = 0, view.nbytes
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("connection closed by the peer")
        got += n


def _recv_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view of ``views`` from the stream, in order: one ``recvmsg_into`` call when the bytes are there
    (a scatter read), else as many as it takes."""
    if isinstance(sock, ssl.SSLSocket):   # TLS (tls.py): no recvmsg_into
        for view in views:
            _recv_into(sock, view)
        return
    i = 0
    while i < len(views):
        n = sock.recvmsg_into(views[i:i + _MAX_IOV])[0]
        if n == 0:
            raise ConnectionError("connection closed by the peer")
        while i < len(views) and n >= views[i].nbytes:
            n -= views[i].nbytes
            i += 1
        if n:
            views[i] = views[i][n:]


class Frame(NamedTuple):
    """One received message: its kind (:data:`REQUEST`, :data:`ANSWER`, :data:`ERROR`), method number, request id,
    the unpickled object (or :class:`Undecodable`), the ``(offset, capacity)`` of the arena block a request's
    answer may go into (None), the bytes its buffers take in an arena block (``shm_arena.block_bytes``) and
    whether they came through the arena."""

    kind: int
    method: int
    rid: int
    value: Any
    reply: tuple[int, int] | None
    nbytes: int
    shared: bool


def recv_frame(sock: socket.socket, header: bytearray, arena: Any = None,
               lent: Callable[[int, int], int | None] | None = None, limits: FrameLimits | None = None) -> Frame:
    """Receive one message; tensors land in fresh memory (a numpy-backed tensor each, all filled by one scatter read,
    or copied out of ``arena``, the connection's :class:`~scheduling.ps.transport.shm_arena.Arena`, where the sender placed
    them there). ``lent(rid, method)``: the arena block this side gave request ``rid`` for its answer to keep, or
    None; an answer placed there is not copied: its tensors view the block, freed once they are gone
    (``Arena.lend``).
    ``header``: a reusable ``bytearray`` of the header's size. A message whose metadata does not
    unpickle (:mod:`scheduling.ps.transport.safe_pickle`: a refused global too), or whose buffers are in an arena
    this side does not have, comes as :class:`Undecodable` (the stream goes on). ``limits``: what the header may
    declare, checked before anything is allocated (None: no limit, a client reading its server's answers).

    Raises:
        FrameRejected: the header breaks ``limits`` (the stream cannot be read on).
        ConnectionError: the peer closed the connection; OSError: it failed (or stalled past the read timeout).
    """
    _recv_header(sock, memoryview(header))
    flagged, method, count, meta_len, rid = HEADER.unpack(header)
    if limits is not None:
        limits.check_header(flagged, count, meta_len)
    placed, replied = flagged & SHM_DATA, flagged & SHM_REPLY
    head = bytearray(8 * count * (2 if placed else 1) + (16 if replied else 0) + meta_len)
    _recv_into(sock, memoryview(head))
    lengths = struct.unpack_from(f"<{count}Q", head)
    if limits is not None:
        limits.check_size(meta_len, lengths)
    at = 8 * count
    offsets = struct.unpack_from(f"<{count}Q", head, at) if placed else ()
    at += 8 * count if placed else 0
    reply = cast(tuple[int, int], struct.unpack_from("<2Q", head, at)) if replied else None
    at += 16 if replied else 0
    value: Any = None
    if placed and arena is None:
        value, buffers = Undecodable("its buffers are in a shared-memory arena this side has not mapped"), []
    elif placed:
        block = lent(rid, method) if lent is not None and offsets else None
        try:
            buffers = arena.take(offsets, lengths) if block is None else arena.lend(block, offsets, lengths)
        except ValueError as e:   # a buffer outside the arena: the answer's block (if lent) is free again
            if block is not None:
                arena.ring.free(block)
            value, buffers = Undecodable(str(e)), []
    else:
        buffers = [fresh_bytes(n) for n in lengths]
        _recv_all(sock, [memoryview(cast(Any, b.numpy())) for b, n in zip(buffers, lengths) if n])
    if value is None:
        try:
            value = safe_loads(memoryview(head)[at:], buffers=buffers)
        except Exception as e:  # noqa: BLE001  (the message was read whole: the connection goes on)
            value = Undecodable(f"{type(e).__name__}: {e}")
    return Frame(flagged & _KIND_MASK, method, rid, value, reply, block_bytes(lengths), bool(placed))


def recv_message(sock: socket.socket, header: bytearray) -> tuple[int, int, int, Any]:
    """``(kind, method, request id, the unpickled object)`` of one message without an arena (:func:`recv_frame`).

    Raises:
        ConnectionError: the peer closed the connection; OSError: it failed.
    """
    frame = recv_frame(sock, header)
    return frame.kind, frame.method, frame.rid, frame.value


class Undecodable:
    """What :func:`recv_message` returns for a message whose metadata did not unpickle (``why`` says why)."""

    def __init__(self, why: str) -> None:
        self.why = why
