"""The socket transport's sender thread (``FXDIST_SOCKET_SEND_THREAD``, scheduling/ps/transport/socket_transport.py).

With it on, a connection's pushes are pickled and sent by a thread of their own; every other request first sends
the pushes queued before it. Differential: a client that pushes and at once looks up, many times, over a connection
with the sender thread, ends with the rows and answers of the same requests called directly, in order (the client
is unordered, so only the transport keeps the push before the lookup). A push that does not pickle fails alone; a
lost connection fails the pushes still queued.
"""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from scheduling.ps import PSClient
from scheduling.ps.endpoints import ServerEndpoints
from scheduling.ps.server import PSServer
from scheduling.ps.transport import auth
from scheduling.ps.transport.socket_server import SocketServer
from scheduling.ps.transport.socket_transport import BACKGROUND_METHODS, SocketTransport, send_thread

from ..test_ps import _kjt, _tables
from .test_socket_transport import _Direct


@pytest.fixture()
def sender_thread(monkeypatch):
    monkeypatch.setenv("FXDIST_SOCKET_SEND_THREAD", "1")


@pytest.fixture()
def server():
    srv = SocketServer(ServerEndpoints(PSServer("send0"))).start()
    yield srv
    srv.close()


def test_the_setting_is_read_from_the_environment_and_auto_counts_the_cpus(monkeypatch):
    for value, expected in (("1", True), ("0", False), (" Auto ", None)):
        monkeypatch.setenv("FXDIST_SOCKET_SEND_THREAD", value)
        if expected is not None:
            assert send_thread() is expected
    monkeypatch.delenv("FXDIST_SOCKET_SEND_THREAD")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(2)))
    assert send_thread() is False                 # 2 cores shared by trainers and servers: no hand-over
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert send_thread() is True
    monkeypatch.setenv("FXDIST_SOCKET_SEND_THREAD", "yes")
    with pytest.raises(ValueError, match=r"FXDIST_SOCKET_SEND_THREAD='yes': expected 1, 0 or auto"):
        send_thread()
    assert {"push", "push_lookup", "batch"} == BACKGROUND_METHODS


def test_a_lookup_leaves_after_the_pushes_queued_before_it(server, sender_thread):
    sock = PSClient(_tables(), [server.address], transport="socket", name="sendorder", seed=4, ordered=False)
    ref = PSClient(_tables(), ["direct"], name="sendorder_ref", seed=4, configure=False, ordered=False)
    ref.transport = _Direct(ServerEndpoints(PSServer("send0")))
    ref.configure()
    try:
        from scheduling.ps.transport.socket_transport import _CONNECTIONS

        assert _CONNECTIONS[server.address].background
        assert any(t.name == f"fxdist-socket-send-{server.address}" for t in threading.enumerate())
        gen = torch.Generator().manual_seed(5)
        kjt = _kjt()
        answers: dict[str, list[torch.Tensor]] = {"sock": [], "ref": []}
        grads = [torch.randn(2, 10, generator=gen) for _ in range(60)]
        for name, client in (("sock", sock), ("ref", ref)):
            pushes = []
            for grad in grads:   # the push is queued for the sender thread; the lookup goes at once
                pushes.append(client.push_grad_async(0, kjt, grad))
                answers[name].append(client.lookup(0, kjt))
            assert all(client.finish_push(p, 0) > 0 for p in pushes)
        for got, expected in zip(answers["sock"], answers["ref"]):
            assert torch.equal(got, expected)
        assert not torch.equal(answers["sock"][0], answers["sock"][-1])   # the pushes moved the rows
        mine, theirs = sock.state_dict(), ref.state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    finally:
        sock.close()
        ref.close()


def test_a_push_that_does_not_pickle_fails_alone(server, sender_thread):
    transport = SocketTransport([server.address])
    bad = transport.call_async(0, "push", (lambda: None,), 5.0)
    with pytest.raises(RuntimeError, match=rf"push to server {server.address} could not be pickled"):
        bad.wait()
    assert isinstance(transport.call_async(0, "stats", (), 5.0).wait(), dict)   # the connection goes on


def test_a_lost_connection_fails_the_pushes_still_queued(sender_thread):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        accepted: list = []
        key = auth.require_key(create=True)

        def accept() -> None:   # authenticates, then never reads
            sock = listener.accept()[0]
            auth.server_handshake(sock, key)
            accepted.append(sock)

        threading.Thread(target=accept, daemon=True).start()
        transport = SocketTransport([address])
        # 50 pushes of 256 KiB, never read: the sender thread blocks once the socket buffers are full
        futures = [transport.call_async(0, "push", ("c", torch.zeros(1 << 16)), 30.0) for _ in range(50)]
        while not accepted:
            threading.Event().wait(0.01)
        accepted[0].close()   # unread bytes: the peer resets the connection
        for future in futures:
            with pytest.raises(RuntimeError, match=rf"transport 'socket': (connection to server {address} lost|"
                                                   rf"sending to server {address} failed)") as info:
                future.wait()
            assert type(info.value) is RuntimeError
