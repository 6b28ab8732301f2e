"""Hand-made peers of a socket server or client for the transport's tests: a server that authenticates and then
never answers, a raw client that does the handshake itself (then sends whatever a test wants)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

from scheduling.ps.transport import auth


@contextlib.contextmanager
def silent_server(key: bytes | None = None) -> Iterator[str]:
    """The address of a listener on 127.0.0.1 that completes the handshake with ``key`` (default: this process's
    job key, drawn if none) on every connection, then never answers; its connections stay open until the end."""
    key = auth.require_key(key, create=True)
    held: list[socket.socket] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def run() -> None:
            while True:
                try:
                    sock, _ = listener.accept()
                except OSError:
                    return
                held.append(sock)
                try:
                    auth.server_handshake(sock, key)
                except OSError:
                    pass

        threading.Thread(target=run, daemon=True).start()
        try:
            yield f"127.0.0.1:{listener.getsockname()[1]}"
        finally:
            for sock in held:
                sock.close()


def raw_client(address: str, key: bytes | None = None, timeout_s: float = 5.0) -> socket.socket:
    """A plain socket to ``address`` (``"127.0.0.1:port"``) that did the client's handshake with ``key`` (None:
    none done: an unauthenticated peer)."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    if key is not None:
        auth.client_handshake(sock, key, timeout_s, address)
    sock.settimeout(timeout_s)
    return sock
