"""TLS for the socket transport (scheduling/ps/transport/tls.py): the wire's messages through a mutual-TLS
connection on loopback, and a peer whose certificate another authority signed refused."""

from __future__ import annotations

import socket
import ssl
import threading
import time

import pytest
import torch

pytest.importorskip("cryptography")

from scheduling.ps.transport import tls  # noqa: E402
from scheduling.ps.transport.socket_wire import HEADER, REQUEST, dumps, recv_frame, send_message  # noqa: E402


def _pair(server_creds: tls.TLSCredentials, client_creds: tls.TLSCredentials):
    """A listening loopback socket and a TLS client connected to it; the server side accepted in a thread."""
    listener = socket.create_server(("127.0.0.1", 0))
    result: dict = {}

    def accept() -> None:
        conn, _ = listener.accept()
        try:
            result["server"] = tls.wrap_server(conn, tls.server_context(server_creds), 5.0)
        except (ssl.SSLError, OSError) as e:
            result["error"] = e
            conn.close()

    t = threading.Thread(target=accept)
    t.start()
    raw = socket.create_connection(listener.getsockname(), timeout=5.0)
    try:
        client = tls.wrap_client(raw, tls.client_context(client_creds), 5.0)
    except (ssl.SSLError, OSError) as e:
        client, result["client_error"] = None, e
    t.join(10)
    listener.close()
    return client, result


def test_a_message_with_tensors_crosses_a_tls_connection_unchanged() -> None:
    creds = tls.job_credentials()
    client, result = _pair(creds, creds)
    assert client is not None and "server" in result, result
    server = result["server"]
    assert client.version() == "TLSv1.3"
    tensors = {"rows": torch.randn(300, 64), "ids": torch.arange(1000)}
    meta, buffers = dumps(tensors)
    send_message(client, REQUEST, 3, 7, meta, buffers)
    frame = recv_frame(server, bytearray(HEADER.size))
    assert (frame.kind, frame.method, frame.rid) == (REQUEST, 3, 7)
    assert torch.equal(frame.value["rows"], tensors["rows"]) and torch.equal(frame.value["ids"], tensors["ids"])
    client.close()
    server.close()


def test_a_certificate_of_another_authority_is_refused() -> None:
    job, stranger = tls.job_credentials(), tls.job_credentials()
    client, result = _pair(job, stranger)
    assert "server" not in result   # the server refused the stranger's certificate
    assert isinstance(result.get("error"), (ssl.SSLError, OSError))
    if client is not None:   # TLS 1.3: the client learns of the refusal at its first read
        with pytest.raises((ssl.SSLError, OSError)):
            client.sendall(b"x" * 16)
            client.recv(1)
        client.close()


def test_the_authority_key_is_not_kept() -> None:
    creds = tls.job_credentials()
    # the member key is the only private key handed out; the certificate it signs is not an authority
    assert creds.key_pem.count(b"PRIVATE KEY-----") == 2
    from cryptography import x509

    leaf = x509.load_pem_x509_certificate(creds.cert_pem)
    assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert x509.load_pem_x509_certificate(creds.ca_pem).subject != leaf.subject


def test_a_parameter_server_over_tls_answers_a_tls_client_and_refuses_a_plain_one(monkeypatch) -> None:
    """A SocketServer with the job's credentials: a client process holding them trains through TLS; one without
    (plain TCP, the right key) is refused and counted as ``bad_tls``; the wire inside is the same."""
    from scheduling.ps import PSClient
    from scheduling.ps.endpoints import ServerEndpoints
    from scheduling.ps.server import PSServer
    from scheduling.ps.transport.socket_server import SocketServer

    from ..test_ps import _kjt, _tables
    from ._peers import raw_client

    creds = tls.job_credentials()
    server = SocketServer(ServerEndpoints(PSServer("tls0")), tls_credentials=creds, handshake_timeout_s=2.0).start()
    try:
        monkeypatch.setattr(tls, "_JOB_TLS", creds)
        client = PSClient(_tables(), [server.address], transport="socket", name="tls_client", seed=3)
        assert client.lookup(0, _kjt()).shape == (2, 10)
        assert not +server.rejected
        with pytest.raises(OSError):   # plain TCP, the right key: the server waits for TLS, the client for a greeting
            raw_client(server.address, server.key, timeout_s=3.0)
        host, _, port = server.address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=3.0) as plain:   # a plain request, no TLS
            plain.sendall(HEADER.pack(REQUEST, 0, 0, 4, 1) + b"meta")
            deadline = time.monotonic() + 5
            while sum(server.rejected.values()) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
        assert server.rejected == {"handshake_timeout": 1, "bad_tls": 1}
    finally:
        server.close()
