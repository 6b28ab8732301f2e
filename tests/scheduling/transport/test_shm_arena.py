"""The socket transport's shared-memory arena (scheduling/ps/transport/shm_arena.py, socket_transport.py, socket_server.py).

The ring allocator against a model of its blocks (hypothesis): live blocks never overlap, stay inside the range
and aligned, and freed space comes back once every older block is freed. The arena: a server maps only the
client's own file (token, size, directory). Differential: a client whose large buffers go through the arena
gets, step after step, bit for bit the answers and tables of a client whose messages all go over the socket,
with the arena in use (counted) and messages that do not fit going inline; answers kept alive hold their blocks
until they are gone; a server that cannot map the arena leaves the connection inline; and a server in another
process (spawned) maps it as well.
"""

from __future__ import annotations

import gc
import io
import os
import pickle
import time
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from scheduling.ps import PSClient
from scheduling.ps.endpoints import ServerEndpoints
from scheduling.ps.server import PSServer
from scheduling.ps.transport import shm_arena
from scheduling.ps.transport.shm_arena import ALIGN, Arena, Ring, arena_bytes
from scheduling.ps.transport.socket_server import SocketServer, spawn_servers
from scheduling.ps.transport.socket_transport import _CONNECTIONS, SocketTransport

pytestmark = pytest.mark.skipif(not os.path.isdir(shm_arena.SHM_DIR), reason="no /dev/shm on this machine")

FEATURES, DIM, ROWS = 4, 64, 1000


# ---- the ring -----------------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 700), st.integers(0, 10_000)), max_size=60))
def test_ring_blocks_never_overlap_and_come_back_once_older_ones_are_freed(ops):
    ring = Ring(ALIGN, 40 * ALIGN)
    live: dict[int, int] = {}   # first byte -> end
    for alloc, size, pick in ops:
        if alloc or not live:
            first = ring.alloc(size)
            if first is not None:
                end = first + -(-size // ALIGN) * ALIGN
                assert first % ALIGN == 0 and ALIGN <= first and end <= 40 * ALIGN
                assert all(end <= a or b <= first for a, b in live.items()), "overlap"
                live[first] = end
        else:
            first = sorted(live)[pick % len(live)]
            ring.free(first)
            del live[first]
        assert sorted(ring.live()) == sorted(live.items())
    for first in list(live):
        ring.free(first)
    assert ring.live() == [] and ring.alloc(39 * ALIGN) == ALIGN   # all of it again


def test_freed_space_comes_back_only_after_the_older_blocks():
    ring = Ring(0, 4 * ALIGN)
    a, b, c = ring.alloc(ALIGN), ring.alloc(ALIGN), ring.alloc(2 * ALIGN)
    assert (a, b, c) == (0, ALIGN, 2 * ALIGN) and ring.alloc(1) is None
    ring.free(b)
    assert ring.alloc(1) is None                 # a, older, still holds the start
    ring.free(a)
    assert ring.alloc(2 * ALIGN) == 0 and ring.alloc(1) is None   # wrapped: up to c
    with pytest.raises(KeyError):
        ring.free(b)


# ---- the arena ----------------------------------------------------------------------------------------------------
def test_a_server_maps_only_the_clients_own_arena():
    arena = Arena.create(1 << 20)
    assert arena is not None
    try:
        assert Arena.attach(arena.path, arena.size, bytes(16)) is None                 # another token
        assert Arena.attach(arena.path, arena.size + 4096, arena.token) is None        # another size
        assert Arena.attach("/tmp/" + os.path.basename(arena.path), arena.size, arena.token) is None  # not /dev/shm
        other = Arena.attach(arena.path, arena.size, arena.token)
        assert other is not None and other.ring is None
        arena.unlink()
        assert not os.path.exists(arena.path)       # the name is gone, both mappings stay
        first = arena.ring.alloc(3000)
        offsets = arena.put(first, [torch.arange(700, dtype=torch.int32).numpy(), b"xyz"])
        got = other.take(offsets, [2800, 3])
        assert torch.equal(got[0].view(torch.int32), torch.arange(700, dtype=torch.int32)) and bytes(got[1]) == b"xyz"
        with pytest.raises(ValueError, match="outside the arena"):
            other.take([arena.size - 8], [16])
    finally:
        arena.unlink()


def test_lent_buffers_unpickle_to_tensors_torch_save_takes():
    """Empty tensors beside others (a dynamic table's state, a checkpoint's) come back savable: no two lent
    tensors share an address."""
    from scheduling.ps.transport.shm_arena import block_bytes
    from scheduling.ps.transport.socket_wire import dumps

    arena = Arena.create(1 << 20)
    assert arena is not None
    try:
        value = (torch.zeros(0, dtype=torch.int64), torch.ones(70_000), torch.zeros(0), torch.arange(5))
        meta, buffers = dumps(value)
        lengths = [memoryview(b).nbytes for b in buffers]
        first = arena.ring.alloc(block_bytes(lengths))
        got = pickle.loads(meta, buffers=arena.lend(first, arena.put(first, buffers), lengths))
        torch.save(got, io.BytesIO())
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, value, strict=True))
        assert arena.ring.live() == [(first, first + block_bytes(lengths))]
        del got
        gc.collect()
        assert arena.ring.live() == []
    finally:
        arena.unlink()


def test_the_arena_size_setting(monkeypatch):
    monkeypatch.delenv("FXDIST_SOCKET_SHM_BYTES", raising=False)
    assert arena_bytes() == shm_arena.DEFAULT_BYTES
    monkeypatch.setenv("FXDIST_SOCKET_SHM_BYTES", "0")
    assert arena_bytes() == 0 and Arena.create(0) is None
    monkeypatch.setenv("FXDIST_SOCKET_SHM_BYTES", "16M")
    with pytest.raises(ValueError, match="FXDIST_SOCKET_SHM_BYTES='16M'"):
        arena_bytes()


# ---- over a connection --------------------------------------------------------------------------------------------
def _tables() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
            for i in range(FEATURES)]


def _kjt(batch: int, seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (FEATURES * batch,), generator=g)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor(keys=[f"f{i}" for i in range(FEATURES)], values=values, lengths=lengths)


def _server():
    return SocketServer(ServerEndpoints(PSServer(f"shm_{uuid.uuid4().hex[:6]}"))).start()


def _steps(client: PSClient, batches: list[int], keep: list | None = None) -> list[torch.Tensor]:
    """Per step: a lookup (after the first, the one the step before prefetched), then a push with the next lookup
    (push_lookup); the rows looked up (kept alive in ``keep``) and the pushes' updated row counts."""
    out = []
    kjts = [_kjt(batch, k) for k, batch in enumerate(batches)]
    for k, batch in enumerate(batches):
        kjt, nxt = kjts[k], kjts[(k + 1) % len(kjts)]
        rows = client.lookup(0, kjt)
        grad = torch.randn(batch, FEATURES * DIM, generator=torch.Generator().manual_seed(100 + k))
        updated = client.push_grad_async(0, kjt, grad, next_kjt=nxt).wait()   # the next lookup: prefetched
        out += [rows.clone(), torch.tensor(updated)]
        if keep is not None:
            keep.append(rows)
    return out


def _client(address: str, name: str) -> PSClient:
    return PSClient(_tables(), [address], transport="socket", name=name, seed=11, optimizer="adagrad",
                    optimizer_kwargs={"lr": 0.05})


def test_answers_and_tables_through_the_arena_are_those_over_the_socket(monkeypatch):
    batches = [512, 16, 512, 1024, 128, 512, 512]   # pushes of 16 or 128 x 4 x 64 floats (< 512 KiB): inline
    servers = [_server(), _server()]
    results = {}
    try:
        for server, shm in zip(servers, ("", "0")):
            monkeypatch.setenv("FXDIST_SOCKET_SHM_BYTES", shm)   # read when the connection opens
            client = _client(server.address, f"shm{shm or 'on'}")
            try:
                results[shm] = (_steps(client, batches), client.state_dict(), _CONNECTIONS[server.address])
            finally:
                client.close()
    finally:
        for server in servers:
            server.close()
    (on, on_tables, on_conn), (off, off_tables, off_conn) = results[""], results["0"]
    assert len(on) == len(off) and all(torch.equal(a, b) for a, b in zip(on, off))
    assert on_tables.keys() == off_tables.keys() and all(torch.equal(on_tables[k], off_tables[k]) for k in on_tables)
    assert off_conn.arena is None and off_conn.shm_requests == off_conn.shm_answers == 0
    assert on_conn.arena is not None
    # every push but the 16- and 128-sample ones went through the arena; an answer where the method's last answer
    # was as large (the first of each method, a 512-sample answer after a 128-sample one, ... went over the socket)
    assert on_conn.shm_requests == len(batches) - 2 and 2 <= on_conn.shm_answers < len(batches)
    assert not os.path.exists(on_conn.arena.path)   # unlinked once mapped


def _arena_files(before: set[str]) -> set[str]:
    """The arena files in :data:`SHM_DIR` not in ``before`` (a listing taken earlier)."""
    return {f for f in set(os.listdir(shm_arena.SHM_DIR)) - before if f.startswith("fxdist-socket-")}


def _raw_lookups(client: PSClient, count: int, keep: list) -> list[torch.Tensor]:
    """``count`` lookups of 512-sample batches through the transport itself: its answers (kept in ``keep``: the
    client's own lookups pool them into new tensors at once) and their copies."""
    out = []
    for k in range(count):
        answer = client.transport.call_async(0, "lookup", (client.name, client._wire(_kjt(512, k)), None), 30.0).wait()
        keep.append(answer)
        out.append(answer.clone())
    return out


def test_answers_kept_alive_hold_their_blocks_and_the_rest_goes_inline(monkeypatch):
    monkeypatch.setenv("FXDIST_SOCKET_SHM_BYTES", str(2 << 20))   # room for three 512 KB answers
    server = _server()
    client = _client(server.address, "keep")
    try:
        keep: list = []
        first = _raw_lookups(client, 4, keep)            # the first inline (its size unknown), three in the arena
        conn = _CONNECTIONS[server.address]
        assert conn.arena is not None and conn.shm_answers == 3 and len(conn.arena.ring.live()) == 3
        second = _raw_lookups(client, 3, keep)
        assert conn.shm_answers == 3                     # no room while the three are alive: over the socket
        keep.clear()
        gc.collect()
        assert conn.arena.ring.live() == []              # the answers gone, their blocks free
        third = _raw_lookups(client, 3, keep)
        assert conn.shm_answers == 6
        keep.clear()
        gc.collect()
        states = [client.state_dict() for _ in range(3)]   # 1 MB: the first inline, then through the arena
        assert conn.shm_answers == 8 and conn.arena.ring.live() == []   # copied out: held states hold no block
        assert all(torch.equal(states[0][k], s[k]) for s in states[1:] for k in states[0])
    finally:
        client.close()
        server.close()
    monkeypatch.setenv("FXDIST_SOCKET_SHM_BYTES", "0")
    server = _server()
    reference = _client(server.address, "keep_ref")
    try:
        want = _raw_lookups(reference, 4, []) + _raw_lookups(reference, 3, []) + _raw_lookups(reference, 3, [])
    finally:
        reference.close()
        server.close()
    assert all(torch.equal(a, b) for a, b in zip(first + second + third, want, strict=True))


def test_a_server_that_cannot_map_the_arena_leaves_the_connection_inline(monkeypatch):
    monkeypatch.delenv("FXDIST_SOCKET_SHM_BYTES", raising=False)
    monkeypatch.setattr(Arena, "attach", classmethod(lambda cls, *a: None))   # as on another host
    before = set(os.listdir(shm_arena.SHM_DIR))
    server = _server()
    client = _client(server.address, "nomap")
    try:
        out = _steps(client, [512, 512])
        conn = _CONNECTIONS[server.address]
        assert conn.arena is None and conn.shm_requests == conn.shm_answers == 0 and len(out) == 4
    finally:
        client.close()
        server.close()
    assert not _arena_files(before)


def test_a_server_in_another_process_maps_the_arena(monkeypatch):
    monkeypatch.delenv("FXDIST_SOCKET_SHM_BYTES", raising=False)
    procs, addresses = spawn_servers([f"shm_proc_{uuid.uuid4().hex[:6]}"])
    try:
        client = _client(addresses[0], "proc")
        try:
            got = _steps(client, [512, 1024, 512, 512])
            conn = _CONNECTIONS[addresses[0]]
            assert conn.arena is not None and conn.shm_requests >= 3 and conn.shm_answers >= 3
        finally:
            client.close()
        SocketTransport(addresses).stop(5.0)
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
    server = _server()
    monkeypatch.setenv("FXDIST_SOCKET_SHM_BYTES", "0")
    reference = _client(server.address, "proc_ref")
    try:
        want = _steps(reference, [512, 1024, 512, 512])
    finally:
        reference.close()
        server.close()
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_server_slow_to_map_the_arena_holds_up_no_request(monkeypatch):
    """The connection asks the server to map its arena without waiting: against a server that accepts and never
    answers, the first request is sent at once (the attach still pending), and once the attach's own time is up
    the file is gone and the connection stays inline."""
    import socket
    import threading

    from scheduling.ps.transport import socket_transport

    monkeypatch.delenv("FXDIST_SOCKET_SHM_BYTES", raising=False)
    monkeypatch.setattr(socket_transport, "ATTACH_TIMEOUT_S", 0.2)
    before = set(os.listdir(shm_arena.SHM_DIR))
    with socket.create_server(("127.0.0.1", 0)) as silent:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        held: list = []
        threading.Thread(target=lambda: held.append(silent.accept()), daemon=True).start()
        future = SocketTransport([address]).call_async(0, "stats", (), 30.0)
        conn = _CONNECTIONS[address]
        assert conn.attached is not None and not conn.attached.done()   # the request did not wait for it
        assert not future.done()
        with pytest.raises(RuntimeError, match="within 0.2 s"):
            conn.attached.wait()
        deadline = time.monotonic() + 10.0   # the Future's callbacks (unlink, close) may still be running
        while _arena_files(before) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _arena_files(before) and conn.arena is None
        conn._fail("test over")
        with pytest.raises(RuntimeError):
            future.wait()


def test_a_process_that_exits_before_its_server_answers_leaves_no_file():
    """An arena not yet unlinked (its server has not answered) is removed when the process exits normally."""
    import subprocess
    import sys

    code = ("from scheduling.ps.transport.shm_arena import Arena\n"
            "arena = Arena.create(1 << 20)\n"
            "print(arena.path)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    path = out.stdout.strip()
    assert path.startswith(os.path.join(shm_arena.SHM_DIR, "fxdist-socket-")), out
    assert not os.path.exists(path)
