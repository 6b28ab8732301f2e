"""Attacks on a socket parameter server (``scheduling.ps.transport.socket_server``), all on 127.0.0.1: a pickle from
a peer without the key, a code-running pickle from a peer with it, a header declaring 4 GiB, idle and half-sent
connections beside a real client, too many connections, ``save`` outside the save root, and a client facing a
server that does not hold the key."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
import time

import pytest
import torch

from scheduling.ps import PSClient
from scheduling.ps.endpoints import ServerEndpoints
from scheduling.ps.server import PSServer
from scheduling.ps.transport import auth, socket_wire
from scheduling.ps.transport.socket_server import SocketServer
from scheduling.ps.transport.socket_transport import _METHOD_NUMBERS, SocketTransport, register_servers
from scheduling.ps.transport.socket_wire import ERROR, HEADER, REQUEST, FrameLimits

from ..test_ps import _kjt, _tables
from ._peers import raw_client


class _Call:
    """Pickles as a call of ``fn(*args)``: what a hostile message carries."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _frame(meta: bytes, method: str = "stats", rid: int = 1) -> bytes:
    """One request message with no buffers."""
    return HEADER.pack(REQUEST, _METHOD_NUMBERS[method], 0, len(meta), rid) + meta


def _closed(sock: socket.socket, within_s: float = 5.0) -> bool:
    """Whether the peer closed ``sock`` within ``within_s`` seconds (reading and dropping whatever comes first)."""
    sock.settimeout(within_s)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except OSError:
        return False


def _until(check, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()


@pytest.fixture()
def server(tmp_path):
    srv = SocketServer(ServerEndpoints(PSServer("attacked")), save_root=str(tmp_path / "root"),
                       limits=FrameLimits(read_timeout_s=1.0), handshake_timeout_s=1.0).start()
    yield srv
    srv.close()


def _client(server, name: str) -> PSClient:
    return PSClient(_tables(), [server.address], transport="socket", name=name, seed=3)


def test_an_unauthenticated_pickle_is_refused_before_it_is_decoded(server, tmp_path, monkeypatch):
    decoded: list = []
    real = socket_wire.safe_loads
    monkeypatch.setattr(socket_wire, "safe_loads", lambda *a, **k: decoded.append(1) or real(*a, **k))
    marker = tmp_path / "pwned-open"
    sock = raw_client(server.address, key=None)
    sock.sendall(_frame(pickle.dumps(_Call(open, str(marker), "w"), protocol=5)))
    assert _closed(sock)
    sock.close()
    assert _until(lambda: server.rejected["bad_auth"] == 1)
    assert not marker.exists() and not decoded
    assert server.endpoints.server.stats.snapshot()["rejected"]["bad_auth"] == 1


def test_an_authenticated_peer_naming_os_system_runs_nothing(server, tmp_path):
    marker = tmp_path / "pwned-system"
    sock = raw_client(server.address, auth.require_key())
    sock.sendall(_frame(pickle.dumps(_Call(os.system, f"touch {marker}"), protocol=5), rid=7))
    kind, _, rid, value = socket_wire.recv_message(sock, bytearray(HEADER.size))
    assert kind == ERROR and rid == 7 and "refused global posix.system" in str(value)
    assert _closed(sock)                            # and it is read no further
    sock.close()
    assert not marker.exists() and server.rejected["bad_frame"] == 1
    client = _client(server, "after_system")        # the server goes on serving
    try:
        assert client.lookup(0, _kjt()).shape == (2, 10)
    finally:
        client.close()


@pytest.mark.parametrize("count, meta_len, lengths", [
    (0, (4 << 30) - 1, ()),                         # 4 GiB of metadata
    (2, 16, (2 << 30, 2 << 30)),                    # 4 GiB of buffers
    (1 << 15, 16, ()),                              # more buffers than allowed
])
def test_a_header_declaring_gigabytes_allocates_nothing(server, monkeypatch, count, meta_len, lengths):
    import psutil

    sizes: list[int] = []
    real_fresh = socket_wire.fresh_bytes

    def fresh(n: int) -> torch.Tensor:
        sizes.append(n)
        return real_fresh(min(n, 1 << 20))

    def counted(n: int = 0) -> bytearray:
        sizes.append(n)
        return bytearray(min(n, 1 << 20))

    monkeypatch.setattr(socket_wire, "fresh_bytes", fresh)
    monkeypatch.setattr(socket_wire, "bytearray", counted, raising=False)
    rss = psutil.Process().memory_info().rss
    sock = raw_client(server.address, auth.require_key())
    head = HEADER.pack(REQUEST, _METHOD_NUMBERS["stats"], count, meta_len, 1)
    sock.sendall(head + (struct.pack(f"<{len(lengths)}Q", *lengths) + bytes(16) if lengths else b""))
    assert _closed(sock)
    sock.close()
    assert _until(lambda: server.rejected["over_limit"] == 1)
    assert all(n <= server.limits.max_frame_bytes for n in sizes) and sum(sizes) < 1 << 20, sizes
    assert psutil.Process().memory_info().rss - rss < 256 << 20


def test_idle_and_half_sent_connections_do_not_hold_up_a_real_client(server):
    idle = [socket.create_connection(("127.0.0.1", int(server.address.rpartition(":")[2]))) for _ in range(200)]
    half = raw_client(server.address, auth.require_key())
    half.sendall(HEADER.pack(REQUEST, _METHOD_NUMBERS["stats"], 0, 100, 1) + b"\x80\x05")   # 98 bytes never come
    client = _client(server, "beside_idle")
    try:
        t0 = time.monotonic()
        for _ in range(5):
            client.lookup(0, _kjt())
        assert time.monotonic() - t0 < 3.0
        assert _until(lambda: server.rejected["handshake_timeout"] == 200, 10.0), server.rejected
        assert _until(lambda: server.rejected["frame_timeout"] == 1, 5.0), server.rejected
        assert all(_closed(s, 1.0) for s in [*idle, half])
        t0 = time.monotonic()
        client.lookup(0, _kjt())                # the real client's connection, idle meanwhile, stays
        assert time.monotonic() - t0 < 1.0
    finally:
        client.close()
        for s in [*idle, half]:
            s.close()


def test_connections_beyond_the_cap_are_refused():
    srv = SocketServer(ServerEndpoints(PSServer("capped")), max_connections=3).start()
    port = int(srv.address.rpartition(":")[2])
    try:
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        assert all(s.recv(len(auth.MAGIC)) == auth.MAGIC for s in held)
        extra = socket.create_connection(("127.0.0.1", port))
        assert _closed(extra, 5.0)
        assert _until(lambda: srv.rejected["too_many_connections"] == 1)
        for s in [*held, extra]:
            s.close()
    finally:
        srv.close()


def test_save_writes_only_under_the_save_root(server, tmp_path):
    root = tmp_path / "root"
    (root / "ok").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", root / "escape")
    client = _client(server, "saver")
    try:
        assert client.checkpoint(root / "ok") == [str(root / "ok" / "attacked.pt")]
        for target in (tmp_path / "outside", root / "escape", root / ".." / "outside"):
            with pytest.raises(PermissionError, match=rf"outside the save root {root}") as info:
                client.checkpoint(target)
            assert str(tmp_path / "outside") in str(info.value)
        assert not os.listdir(tmp_path / "outside")
    finally:
        client.close()


def test_the_client_refuses_a_server_that_does_not_hold_the_key(tmp_path):
    """A server of another job: the client never sends it a request (the server closes on the client's proof);
    an impostor that greets and makes up its proof: the client refuses it and sends nothing more."""
    other = SocketServer(ServerEndpoints(PSServer("other_job")), auth_key=auth.new_key()).start()
    try:
        with pytest.raises(RuntimeError, match="refused this process's job key"):
            SocketTransport([other.address]).call_async(0, "stats", (), 5.0).wait()
        assert _until(lambda: other.rejected["bad_auth"] == 1)
    finally:
        other.close()
    got: list[bytes] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def impostor() -> None:
            sock = listener.accept()[0]
            sock.sendall(auth.MAGIC + os.urandom(32))
            got.append(sock.recv(64, socket.MSG_WAITALL))
            sock.sendall(os.urandom(32))
            sock.settimeout(2.0)
            try:
                got.append(sock.recv(1 << 16))
            except OSError:
                got.append(b"")
            sock.close()

        thread = threading.Thread(target=impostor, daemon=True)
        thread.start()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        register_servers({"impostor_ps": address})
        with pytest.raises(RuntimeError, match="does not hold this process's job key"):
            SocketTransport(["impostor_ps"]).call_async(0, "stats", (), 5.0).wait()
        thread.join(5)
    assert len(got[0]) == 64 and got[1] == b""      # no request left the client
