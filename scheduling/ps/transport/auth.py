"""The ``socket`` transport's job key and its connection handshake: both ends prove they hold the key.

Every connection to a socket parameter server starts with a mutual challenge/response over HMAC-SHA256, before
the server reads a single message (the design of Python ``multiprocessing.connection``'s ``deliver_challenge`` /
``answer_challenge``, in both directions and in one and a half round trips):

1. server -> client: :data:`MAGIC` and a fresh 32-byte nonce ``s`` (``secrets.token_bytes``);
2. client -> server: its own nonce ``c`` and ``HMAC(key, "client" | MAGIC | s | c)``;
3. the server checks it (``hmac.compare_digest``; a wrong one: the connection is closed, nothing more is read)
   and answers ``HMAC(key, "server" | MAGIC | c | s)``, which the client checks in turn: a trainer also knows
   that its server holds the job's key.

The labels keep a proof from being replayed in the other direction, and each side's fresh nonce keeps a proof
from being replayed on another connection. A peer that does not finish within ``timeout_s`` (default
:data:`HANDSHAKE_TIMEOUT_S`, a deadline for the whole handshake, however the bytes trickle in) is dropped. The
handshake authenticates the peer at connection time only: the messages that follow are neither encrypted nor
signed (between hosts, :mod:`scheduling.ps.transport.tls` adds that).

The job key (:func:`job_key`): the launcher draws one per job (:func:`new_key`) and hands it to the server actors
and the trainers through Ray (constructor arguments, ``TrainerSpec``); a process sets it as its default with
:func:`set_job_key`. Started by hand, a process reads it from ``FXDIST_AUTH_KEY`` (hex) or from the file named by
``FXDIST_AUTH_KEY_FILE`` (hex, mode 0600 or stricter, owned by the user). When nothing provides one, the process
that starts servers (``spawn_servers``, ``LocalCluster``, ``serve``) draws one (``job_key(create=True)``), keeps it
as its default for its clients and puts it in its environment, so the processes it starts afterwards inherit it.

Source: Python ``hmac`` (``hmac.new``, ``compare_digest``), ``secrets`` (``token_bytes``) and
``multiprocessing.connection`` (``deliver_challenge``, ``answer_challenge``); RFC 2104 (HMAC).
"""

from __future__ import annotations

import hmac
import os
import secrets
import socket
import stat
import threading
import time

__all__ = ["KEY_ENV", "KEY_FILE_ENV", "KEY_BYTES", "MIN_KEY_BYTES", "HANDSHAKE_TIMEOUT_S", "MAGIC",
           "AuthenticationError", "new_key", "set_job_key", "job_key", "require_key", "parse_key", "read_key_file",
           "server_handshake", "client_handshake"]

KEY_ENV = "FXDIST_AUTH_KEY"
"""Environment variable holding the job key as hex text."""
KEY_FILE_ENV = "FXDIST_AUTH_KEY_FILE"
"""Environment variable naming a file that holds the job key as hex text (mode 0600 or stricter)."""
KEY_BYTES = 32
"""Bytes of a key drawn by :func:`new_key` (HMAC-SHA256's block-size recommendation: at least the digest's 32)."""
MIN_KEY_BYTES = 16
"""Shortest key accepted from the environment or a file."""
HANDSHAKE_TIMEOUT_S = 5.0
"""Seconds a peer has to complete the whole handshake (a silent or slow one is dropped)."""
MAGIC = b"fxdist-ps-auth/1"
"""The server's greeting (16 bytes): the protocol and its version."""
_NONCE = 32
_DIGEST = 32

_DEFAULT: list[bytes] = []
"""This process's job key (:func:`set_job_key`), or empty."""
_LOCK = threading.Lock()


class AuthenticationError(ConnectionError):
    """The peer did not prove it holds the job key (or is no fxdist parameter-server endpoint).

    See docs/troubleshooting.md#authenticationerror.
    """


def new_key() -> bytes:
    """A fresh random job key of :data:`KEY_BYTES` bytes (``secrets.token_bytes``)."""
    return secrets.token_bytes(KEY_BYTES)


def set_job_key(key: bytes | None) -> None:
    """Make ``key`` this process's job key (what :func:`job_key` returns first); None forgets it.

    Raises:
        ValueError: a key shorter than :data:`MIN_KEY_BYTES`.
    """
    with _LOCK:
        _DEFAULT.clear()
        if key is not None:
            _DEFAULT.append(_checked(bytes(key), "set_job_key"))


def job_key(*, create: bool = False) -> bytes | None:
    """This process's job key: the one :func:`set_job_key` gave, else ``FXDIST_AUTH_KEY``, else the file
    ``FXDIST_AUTH_KEY_FILE`` names; else, with ``create``, a new one (:func:`new_key`) kept as this process's
    default and exported to ``FXDIST_AUTH_KEY`` so that processes started from here on inherit it; else None.

    Raises:
        ValueError: ``FXDIST_AUTH_KEY`` (or the file) is not hex text of at least :data:`MIN_KEY_BYTES` bytes.
        PermissionError: the key file is readable by others than its owner, or not owned by this user.
        OSError: the key file cannot be read.
    """
    with _LOCK:
        if _DEFAULT:
            return _DEFAULT[0]
        text = os.environ.get(KEY_ENV, "").strip()
        if text:
            return parse_key(text, KEY_ENV)
        path = os.environ.get(KEY_FILE_ENV, "").strip()
        if path:
            return read_key_file(path)
        if not create:
            return None
        key = new_key()
        _DEFAULT.append(key)
        os.environ[KEY_ENV] = key.hex()
        return key


def require_key(key: bytes | None = None, *, create: bool = False) -> bytes:
    """``key`` when given, else :func:`job_key` (``create``: drawn when nothing provides one).

    Raises:
        RuntimeError: no key anywhere (and not ``create``): the message says how to provide one.
        ValueError: a malformed key (too short, not hex).
        PermissionError: a key file readable by others.
    """
    if key is not None:
        return _checked(bytes(key), "auth_key")
    found = job_key(create=create)
    if found is None:
        raise RuntimeError(f"socket transport: no job key in this process; the launcher passes one, else set "
                           f"{KEY_ENV} (hex) or {KEY_FILE_ENV} (a file of mode 0600), or call "
                           "scheduling.ps.transport.auth.set_job_key()")
    return found


def parse_key(text: str, where: str) -> bytes:
    """The key written as hex ``text`` (``where``: what it came from, for the error).

    Raises:
        ValueError: not hex, or shorter than :data:`MIN_KEY_BYTES` bytes.
    """
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"{where}: the job key must be hex text (e.g. secrets.token_hex(32)); got "
                         f"{len(text)} characters that are not") from None
    return _checked(key, where)


def read_key_file(path: str) -> bytes:
    """The hex key in file ``path``, which only its owner (this user) may read: mode 0600 or stricter.

    Raises:
        PermissionError: group or others have any access to ``path``, or another user owns it.
        ValueError: the file does not hold a hex key of at least :data:`MIN_KEY_BYTES` bytes.
        OSError: ``path`` cannot be opened.
    """
    with open(path, "rb") as f:
        info = os.fstat(f.fileno())
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise PermissionError(f"{KEY_FILE_ENV}: the key file {path} has mode {mode:04o}; it must be readable by "
                                  f"its owner only (chmod 600 {path})")
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            raise PermissionError(f"{KEY_FILE_ENV}: the key file {path} belongs to uid {info.st_uid}, not to this "
                                  f"user (uid {os.getuid()})")
        data = f.read(4096)
    return parse_key(data.decode("ascii", "replace"), f"key file {path}")


def _checked(key: bytes, where: str) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{where}: a job key of {len(key)} bytes is too short (at least {MIN_KEY_BYTES})")
    return key


def _proof(key: bytes, label: bytes, mine: bytes, theirs: bytes) -> bytes:
    return hmac.new(key, label + MAGIC + mine + theirs, "sha256").digest()


def _recv_exactly(sock: socket.socket, n: int, deadline: float, who: str) -> bytes:
    """``n`` bytes from ``sock`` before ``deadline`` (``time.monotonic``).

    Raises:
        TimeoutError: the deadline passed; AuthenticationError: the peer closed the connection.
    """
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{who}: handshake not completed in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(out))
        except (socket.timeout, BlockingIOError):
            raise TimeoutError(f"{who}: handshake not completed in time") from None
        if not chunk:
            raise AuthenticationError(f"{who}: the peer closed the connection during the handshake")
        out += chunk
    return bytes(out)


def server_handshake(sock: socket.socket, key: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """The server's side of the handshake on a freshly accepted ``sock`` (left in blocking mode after it).

    Raises:
        AuthenticationError: the client's proof is wrong (it does not hold ``key``).
        TimeoutError: the client did not complete the handshake within ``timeout_s``.
        OSError: the connection failed.
    """
    deadline = time.monotonic() + timeout_s
    ours = secrets.token_bytes(_NONCE)
    sock.settimeout(timeout_s)
    sock.sendall(MAGIC + ours)
    answer = _recv_exactly(sock, _NONCE + _DIGEST, deadline, "server")
    theirs, proof = answer[:_NONCE], answer[_NONCE:]
    if not hmac.compare_digest(proof, _proof(key, b"client", ours, theirs)):
        raise AuthenticationError("the client's proof does not match this server's job key")
    sock.sendall(_proof(key, b"server", theirs, ours))
    sock.settimeout(None)


def client_handshake(sock: socket.socket, key: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S,
                     address: str = "") -> None:
    """The client's side of the handshake on a freshly connected ``sock`` (left in blocking mode after it):
    proves it holds ``key`` and checks that the server does too.

    Raises:
        AuthenticationError: the peer is no fxdist parameter server, refused this key, or does not hold it.
        TimeoutError: the server did not complete the handshake within ``timeout_s``.
        OSError: the connection failed.
    """
    who = f"server {address}" if address else "server"
    deadline = time.monotonic() + timeout_s
    greeting = _recv_exactly(sock, len(MAGIC) + _NONCE, deadline, who)
    if greeting[:len(MAGIC)] != MAGIC:
        raise AuthenticationError(f"{who} is no fxdist parameter server of this version (greeting "
                                  f"{greeting[:len(MAGIC)]!r}, expected {MAGIC!r})")
    theirs, ours = greeting[len(MAGIC):], secrets.token_bytes(_NONCE)
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(ours + _proof(key, b"client", theirs, ours))
    try:
        proof = _recv_exactly(sock, _DIGEST, deadline, who)
    except (AuthenticationError, ConnectionResetError):
        raise AuthenticationError(f"{who} closed the connection during the handshake: it refused this process's "
                                  f"job key (a key of another job? {KEY_ENV} / {KEY_FILE_ENV})") from None
    if not hmac.compare_digest(proof, _proof(key, b"server", ours, theirs)):
        raise AuthenticationError(f"{who} does not hold this process's job key (its proof does not match): "
                                  "refusing to send it anything")
    sock.settimeout(None)
