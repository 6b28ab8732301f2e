"""Free TCP ports, and telling a rendezvous whose port was taken before it bound.

A port found free here may be taken by another process before the group binds it (the
rendezvous then fails with "The server socket has failed to listen on any local network address").
Callers that choose a port with :func:`free_port` retry with a new one when :func:`is_bind_failure` says the
bind failed (:meth:`scheduling.ps.lifecycle.TorchRPCServers.start` does, up to :data:`BIND_ATTEMPTS` times). A
job's rendezvous, which cannot simply retry (the other trainers and the servers already head for the port),
holds the port with :func:`reserve_port` until its store has bound it.

Source: POSIX ``bind(2)`` (port 0: the OS picks a free port; ``EADDRINUSE``); torch ``TCPStore`` error text.
"""

from __future__ import annotations

import socket

__all__ = ["free_port", "free_port_block", "reserve_port", "is_bind_failure", "BIND_ATTEMPTS"]

BIND_ATTEMPTS = 5
"""How many ports a rendezvous tries before giving up on a bind failure."""

_BIND_FAILURES = ("failed to listen", "EADDRINUSE", "address already in use")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (the OS picks it: bind to port 0).

    Another process may take it before the caller binds it: retry on :func:`is_bind_failure`.

    Raises:
        OSError: ``host`` is not an address of this machine.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_port_block(count: int, host: str = "127.0.0.1", *, start: int = 20000, stop: int = 60000) -> int:
    """The first port ``p`` in ``[start, stop)`` such that ``p .. p + count - 1`` are all free on ``host`` now.

    Raises:
        OSError: no such block.
    """
    port = start
    while port + count <= stop:
        for offset in range(count):
            with socket.socket() as s:
                try:
                    s.bind((host, port + offset))
                except OSError:
                    port += offset + 1
                    break
        else:
            return port
    raise OSError(f"no block of {count} free ports in [{start}, {stop}) on {host}")


def reserve_port(host: str = "127.0.0.1") -> tuple[int, socket.socket]:
    """A free TCP port of ``host`` and the socket holding it: bound with ``SO_REUSEADDR``, never listening, so
    a rendezvous store (torch's ``TCPStore`` binds with ``SO_REUSEADDR``) can still bind and listen on it, while
    no other process is handed it (the OS skips bound ports for port 0) or can bind it without
    ``SO_REUSEADDR``. Close the socket once the store listens.

    Raises:
        OSError: ``host`` is not an address of this machine.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
    except BaseException:
        sock.close()
        raise
    return sock.getsockname()[1], sock


def is_bind_failure(error: BaseException) -> bool:
    """Whether ``error`` (or an exception it was raised from) says a listening socket could not bind its port
    (taken by another process since it was chosen)."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == 98 or any(s in str(e) for s in _BIND_FAILURES):
            return True
        e = e.__cause__ or e.__context__
    return False
