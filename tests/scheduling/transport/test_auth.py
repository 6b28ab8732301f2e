"""The job key and the connection handshake of the socket transport (``scheduling.ps.transport.auth``)."""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time

import pytest

from scheduling.ps.transport import auth


@pytest.fixture()
def no_key(monkeypatch):
    """This process with no job key anywhere (its default, the environment), restored afterwards."""
    monkeypatch.setattr(auth, "_DEFAULT", [])
    monkeypatch.delenv(auth.KEY_ENV, raising=False)
    monkeypatch.delenv(auth.KEY_FILE_ENV, raising=False)


def _both(server_key: bytes, client_key: bytes, **server_kw):
    """Run both sides of the handshake over a socket pair: ``(server's error, client's error)`` (None: passed)."""
    a, b = socket.socketpair()
    errors: dict[str, BaseException | None] = {"server": None, "client": None}

    def server() -> None:
        try:
            auth.server_handshake(a, server_key, **server_kw)
        except BaseException as e:  # noqa: BLE001
            errors["server"] = e
            a.close()

    thread = threading.Thread(target=server)
    thread.start()
    try:
        auth.client_handshake(b, client_key, 5.0)
    except BaseException as e:  # noqa: BLE001
        errors["client"] = e
    thread.join(10)
    a.close()
    b.close()
    return errors["server"], errors["client"]


def test_both_sides_pass_with_the_same_key():
    key = auth.new_key()
    assert len(key) == auth.KEY_BYTES
    assert _both(key, key) == (None, None)


def test_a_wrong_key_is_refused_by_the_server_and_the_client_is_told():
    server_error, client_error = _both(auth.new_key(), auth.new_key())
    assert isinstance(server_error, auth.AuthenticationError)
    assert isinstance(client_error, auth.AuthenticationError) and "refused this process's job key" in str(client_error)


def test_the_client_refuses_a_server_that_does_not_hold_the_key():
    """Mutual: an impostor that greets correctly but cannot prove the key gets nothing past the handshake."""
    a, b = socket.socketpair()
    got: list[bytes] = []

    def impostor() -> None:
        a.sendall(auth.MAGIC + secrets.token_bytes(32))
        got.append(a.recv(64, socket.MSG_WAITALL))
        a.sendall(secrets.token_bytes(32))              # a made-up proof
        a.settimeout(1.0)
        try:
            got.append(a.recv(100))                     # the client sends nothing more: EOF
        except OSError:
            got.append(b"")

    thread = threading.Thread(target=impostor)
    thread.start()
    with pytest.raises(auth.AuthenticationError, match="does not hold this process's job key"):
        auth.client_handshake(b, auth.new_key(), 5.0, "impostor:1")
    b.close()
    thread.join(5)
    a.close()
    assert len(got[0]) == 64 and got[1] == b""


def test_a_silent_peer_times_out_within_the_deadline_however_it_trickles():
    a, b = socket.socketpair()
    stop = threading.Event()

    def trickle() -> None:   # one byte every 0.1 s: never 64 in time
        b.recv(48)
        while not stop.is_set():
            try:
                b.send(b"x")
            except OSError:
                return
            time.sleep(0.1)

    threading.Thread(target=trickle, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        auth.server_handshake(a, auth.new_key(), 0.5)
    assert time.monotonic() - t0 < 2.0
    stop.set()
    a.close()
    b.close()


def test_a_peer_that_is_no_fxdist_server_is_named():
    a, b = socket.socketpair()
    a.sendall(b"HTTP/1.1 200 OK\r\n" + bytes(64))
    with pytest.raises(auth.AuthenticationError, match="no fxdist parameter server"):
        auth.client_handshake(b, auth.new_key(), 1.0)
    a.close()
    b.close()


def test_keys_come_from_the_environment_and_are_checked(no_key, monkeypatch):
    assert auth.job_key() is None
    with pytest.raises(RuntimeError, match=f"{auth.KEY_ENV}.*{auth.KEY_FILE_ENV}"):
        auth.require_key()
    key = auth.new_key()
    monkeypatch.setenv(auth.KEY_ENV, key.hex())
    assert auth.job_key() == key == auth.require_key()
    monkeypatch.setenv(auth.KEY_ENV, "abcd")
    with pytest.raises(ValueError, match="too short"):
        auth.job_key()
    monkeypatch.setenv(auth.KEY_ENV, "not hex at all, not hex at all")
    with pytest.raises(ValueError, match="must be hex"):
        auth.job_key()
    explicit = auth.new_key()
    assert auth.require_key(explicit) == explicit      # an explicit key wins over everything
    auth.set_job_key(explicit)
    assert auth.job_key() == explicit


def test_a_key_file_must_be_private(no_key, monkeypatch, tmp_path):
    key = auth.new_key()
    path = tmp_path / "job.key"
    path.write_text(key.hex() + "\n")
    monkeypatch.setenv(auth.KEY_FILE_ENV, str(path))
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match=rf"{path} has mode 0644"):
        auth.job_key()
    os.chmod(path, 0o600)
    assert auth.job_key() == key


def test_a_key_drawn_here_is_inherited_by_processes_started_afterwards(no_key):
    key = auth.job_key(create=True)
    assert key is not None and auth.job_key() == key and os.environ[auth.KEY_ENV] == key.hex()
    assert auth.job_key(create=True) == key              # drawn once
