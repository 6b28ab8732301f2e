"""Fuzzing a socket parameter server's message parser (``socket_wire.recv_frame`` behind ``socket_server``) from an
authenticated peer, on 127.0.0.1: random and mutated messages never crash or hang the server, and a real client
training beside them ends with the very tables it ends with alone."""

from __future__ import annotations

import socket
import struct
import time

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduling.ps import PSClient
from scheduling.ps.endpoints import ServerEndpoints
from scheduling.ps.server import PSServer
from scheduling.ps.transport import auth
from scheduling.ps.transport.socket_server import SocketServer
from scheduling.ps.transport.socket_transport import _METHOD_NUMBERS
from scheduling.ps.transport.socket_wire import HEADER, REQUEST, SHM_DATA, SHM_REPLY, FrameLimits, dumps

from ..test_ps import _kjt, _tables
from ._peers import raw_client

DATA_METHODS = ("lookup", "peek", "push", "push_lookup", "batch", "stats", "dynamic_stats", "state_dict")
"""What a fuzzed header may name: every request but those that change the server as a whole (``stop``,
``configure``, ``load_state_dict``, ``set_delays``, ``save``: the job's owner may send them)."""


def _request(method: str, args: tuple) -> bytes:
    """A well-formed request message of ``method(*args)`` (the base the mutations start from)."""
    meta, buffers = dumps(args)
    lengths = [memoryview(b).nbytes for b in buffers]
    return (HEADER.pack(REQUEST, _METHOD_NUMBERS[method], len(buffers), len(meta), 1)
            + struct.pack(f"<{len(lengths)}Q", *lengths) + meta
            + b"".join(bytes(memoryview(b).cast("B")) for b in buffers))


BASES = [  # the fuzzing peer's own namespace "fuzz": nothing it sends names the real client's tables
    _request("lookup", ("fuzz", (torch.tensor([1, 2]), torch.tensor([0, 1, 2]), None), None, None)),
    _request("push", ("fuzz", (torch.tensor([1]), torch.tensor([0, 1]), None), torch.ones(1, 4), None)),
    _request("stats", ()),
    _request("batch", ([("lookup", ("fuzz", (torch.tensor([3]), torch.tensor([0, 1]), None)))],)),
]


@st.composite
def frames(draw) -> bytes:
    """Random bytes, or a base request with its header fields or bytes changed, cut short or extended."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=200))
    frame = bytearray(draw(st.sampled_from(BASES)))
    kind, method, count, meta_len, rid = HEADER.unpack_from(frame)
    field = draw(st.sampled_from(["kind", "method", "count", "meta", "bytes", "cut", "extend", "none"]))
    if field == "kind":
        kind = draw(st.sampled_from([REQUEST | SHM_DATA, REQUEST | SHM_REPLY, 1, 2, 7, 0x40, 0xFF]))
    elif field == "method":
        method = draw(st.sampled_from([_METHOD_NUMBERS[m] for m in DATA_METHODS] + [200, 255]))
    elif field == "count":
        count = draw(st.integers(0, 0xFFFF))
    elif field == "meta":
        meta_len = draw(st.integers(0, 0xFFFFFFFF))
    HEADER.pack_into(frame, 0, kind, method, count, meta_len, rid)
    if field == "bytes":   # past the header: lengths, metadata, buffers
        for _ in range(draw(st.integers(1, 8))):
            at = draw(st.integers(HEADER.size, len(frame) - 1))
            frame[at] = draw(st.integers(0, 255))
    elif field == "cut":
        del frame[draw(st.integers(0, len(frame) - 1)):]
    elif field == "extend":
        frame += draw(st.binary(min_size=1, max_size=64))
    return bytes(frame)


def _send(address: str, key: bytes, frame: bytes) -> None:
    """Send ``frame`` on a fresh authenticated connection, end the sending side, and read until the server has
    answered and closed (or 3 s passed: then the server hangs on it)."""
    sock = raw_client(address, key)
    try:
        sock.sendall(frame)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(3.0)
        while sock.recv(1 << 16):
            pass
    except TimeoutError:
        raise
    except OSError:   # the server closed first (reset, a broken pipe, not connected): what it does with junk
        pass
    finally:
        sock.close()


def _step(client: PSClient, step: int) -> None:
    client.lookup(0, _kjt())
    client.finish_push(client.push_grad_async(0, _kjt(), torch.full((2, 10), 0.01 * (step % 5 + 1))), 0)


def _train(steps: int, between=None, rejected: dict | None = None) -> dict[str, torch.Tensor]:
    """``steps`` training steps of a fresh client on a fresh server (``between(server, step)`` before each): its
    tables; ``rejected``: updated with the connections the server refused."""
    server = SocketServer(ServerEndpoints(PSServer("fuzzed")), limits=FrameLimits(max_frame_bytes=1 << 20,
                                                                                   read_timeout_s=1.0)).start()
    client = PSClient(_tables(), [server.address], transport="socket", name=f"fuzz_real_{time.time_ns()}", seed=5)
    try:
        PSClient(_tables()[:1], [server.address], transport="socket", name="fuzz", seed=1).close()
        for step in range(steps):
            if between is not None:
                between(server, step)
            _step(client, step)
        tables = client.state_dict()
        if rejected is not None:
            rejected.update(server.rejected)
        return tables
    finally:
        client.close()
        server.close()


def test_fuzzed_frames_neither_crash_nor_hang_the_server_nor_change_a_real_client_s_training():
    key = auth.require_key(create=True)
    sent: list[bytes] = []
    found: list[dict] = []

    def fuzz_peer(server: SocketServer, step: int) -> None:
        t0 = time.monotonic()
        _send(server.address, key, sent[step])
        assert time.monotonic() - t0 < 3.0, f"the server hung on {sent[step][:64]!r}"

    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(frame=frames())
    def collect(frame: bytes) -> None:
        sent.append(frame)

    collect()
    t0 = time.monotonic()
    rejected: dict = {}
    found.append(_train(len(sent), fuzz_peer, rejected))
    found.append(_train(len(sent)))
    assert len(sent) >= 30 and time.monotonic() - t0 < 30.0
    assert sum(rejected.values()) > 0 and set(rejected) <= {"bad_frame", "over_limit"}, rejected
    assert found[0].keys() == found[1].keys()
    assert all(torch.equal(found[0][k], found[1][k]) for k in found[0])
