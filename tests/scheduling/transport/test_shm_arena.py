"""The socket transport's shared-memory arena (scheduling/ps/transport/shm_arena.py, socket_transport.py, socket_server.py).

The ring allocator against a model of its blocks (hypothesis): live blocks never overlap, stay inside the range
and aligned, and freed space comes back once every older block is freed. The arena: an anonymous file whose size
is sealed, handed over as a descriptor; a server maps only such a file of the announced size (not a named file,
not an unsealed one), refuses an attach that names a file (or a symlink to one) and a descriptor whose size is not
sealed, and a client cannot shrink its arena under the server's mapping (no SIGBUS: the server answers on).
Differential: a client whose large buffers go through the arena gets, step after step, bit for bit the answers and
tables of a client whose messages all go over the socket, with the arena in use (counted) and messages that do not
fit going inline; answers kept alive hold their blocks until they are gone; a server that cannot map the arena
leaves the connection inline; a server in another process (spawned) maps it as well; and nothing is left behind
(no file anywhere, the descriptors and mappings of arenas not used closed).
"""

from __future__ import annotations

import fcntl
import gc
import io
import os
import pickle
import secrets
import subprocess
import sys
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
from scheduling.ps.transport.shm_arena import ALIGN, MEMFD_NAME, Arena, FdChannel, Ring, arena_bytes, send_fd
from scheduling.ps.transport.socket_server import SocketServer, spawn_servers
from scheduling.ps.transport.socket_transport import _CONNECTIONS, SocketTransport


def _sealable() -> bool:
    arena = Arena.create(1 << 20)
    if arena is not None:
        arena.close()
    return arena is not None


pytestmark = pytest.mark.skipif(not _sealable(), reason="no memfd_create with file seals here")

SHM_DIR = "/dev/shm"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

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
def _arena_handles() -> tuple[int, int]:
    """This process's open descriptors and mappings of arena files (``/proc/self/fd``, ``/proc/self/maps``)."""
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{MEMFD_NAME}")
        except OSError:   # the listing's own descriptor, closed meanwhile
            pass
    with open("/proc/self/maps") as maps:
        return fds, sum(f"/memfd:{MEMFD_NAME}" in line for line in maps)


def _until(condition, timeout_s: float = 10.0) -> bool:
    """Wait for ``condition()`` (a Future's callbacks may still be running on another thread)."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_an_arena_is_an_anonymous_file_whose_size_is_sealed():
    before, names = _arena_handles(), set(os.listdir(SHM_DIR)) if os.path.isdir(SHM_DIR) else set()
    arena = Arena.create(1 << 20)
    assert arena is not None and arena.fd is not None
    try:
        info = os.fstat(arena.fd)
        assert info.st_nlink == 0 and info.st_size == arena.size == 1 << 20    # no name anywhere
        assert not os.path.isdir(SHM_DIR) or set(os.listdir(SHM_DIR)) == names
        fds, maps = _arena_handles()
        assert fds > before[0] and maps == before[1] + 1    # (Python's mmap holds a descriptor of its own)
        seals = fcntl.fcntl(arena.fd, fcntl.F_GET_SEALS)
        assert seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL) == (
            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        for size in (0, arena.size // 2, arena.size * 2):
            with pytest.raises(PermissionError):          # EPERM: the seals
                os.ftruncate(arena.fd, size)
    finally:
        arena.close()
    assert arena.fd is None and _arena_handles() == before   # closed: nothing left, by name or otherwise


def test_a_server_maps_only_an_unnamed_file_whose_size_is_sealed(tmp_path):
    arena = Arena.create(1 << 20)
    assert arena is not None
    unsealed = os.memfd_create("fxdist-test-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    grow_only = os.memfd_create("fxdist-test-grow", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    named = os.open(tmp_path / "arena", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for fd in (unsealed, grow_only, named):
            os.ftruncate(fd, arena.size)
        fcntl.fcntl(grow_only, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)
        with pytest.raises(ValueError, match="size is not sealed"):
            Arena.attach(unsealed, arena.size)
        with pytest.raises(ValueError, match="size is not sealed"):
            Arena.attach(grow_only, arena.size)             # shrinking still possible
        with pytest.raises(ValueError, match="cannot be sealed|not sealed"):
            Arena.attach(named, arena.size)                 # a file with a name
        try:
            huge = os.memfd_create("fxdist-test-huge", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
        except OSError:   # no huge pages here
            huge = None
        if huge is not None:
            fcntl.fcntl(huge, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            with pytest.raises(ValueError, match="huge pages"):
                Arena.attach(huge, 2 * ALIGN)     # refused before its size is looked at
            os.close(huge)
        with pytest.raises(ValueError, match="holds 1048576 bytes, not the 1052672"):
            Arena.attach(arena.fd, arena.size + 4096)
        other = Arena.attach(arena.fd, arena.size)
        assert other.ring is None and other.fd is None
        first = arena.ring.alloc(3000)
        offsets = arena.put(first, [torch.arange(700, dtype=torch.int32).numpy(), b"xyz"])
        got = other.take(offsets, [2800, 3])
        assert torch.equal(got[0].view(torch.int32), torch.arange(700, dtype=torch.int32)) and bytes(got[1]) == b"xyz"
        with pytest.raises(ValueError, match="outside the arena"):
            other.take([arena.size - 8], [16])
        other.close()
    finally:
        for fd in (unsealed, grow_only, named):
            os.close(fd)
        arena.close()


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
        arena.close()


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


def _client(address: str, name: str, attached: bool = True) -> PSClient:
    """A client of the server at ``address``; ``attached``: once its connection's arena, if it asked for one, is
    mapped (the hand-over does not hold up requests: the first ones would go inline, and the counts vary)."""
    client = PSClient(_tables(), [address], transport="socket", name=name, seed=11, optimizer="adagrad",
                      optimizer_kwargs={"lr": 0.05})
    conn = _CONNECTIONS.get(address)
    if attached and conn is not None and conn.attached is not None:
        assert conn.attached.wait() is True
    return client


def test_answers_and_tables_through_the_arena_are_those_over_the_socket(monkeypatch):
    batches = [512, 16, 512, 1024, 128, 512, 512]   # pushes of 16 or 128 x 4 x 64 floats (< 512 KiB): inline
    before = _arena_handles()
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
    assert on_conn.arena.fd is None   # the server has it: the client's descriptor closed, the mapping kept
    assert _until(lambda: _arena_handles()[1] == before[1] + 1)   # the server's side unmapped with its connection


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
    def refuse(cls, fd, nbytes):
        raise ValueError("refused for the test")

    monkeypatch.delenv("FXDIST_SOCKET_SHM_BYTES", raising=False)
    monkeypatch.setattr(Arena, "attach", classmethod(refuse))
    before = _arena_handles()
    server = _server()
    client = _client(server.address, "nomap", attached=False)
    try:
        conn = _CONNECTIONS[server.address]
        with pytest.raises(RuntimeError, match="the server refused the shared-memory arena: refused for the test"):
            conn.attached.wait()
        out = _steps(client, [512, 512])
        assert conn.arena is None and conn.shm_requests == conn.shm_answers == 0 and len(out) == 4
        assert _until(lambda: _arena_handles() == before)   # the arena closed: no descriptor, no mapping
    finally:
        client.close()
        server.close()


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
    the arena is closed (no descriptor, no mapping left) and the connection stays inline."""
    from scheduling.ps.transport import socket_transport

    from ._peers import silent_server

    monkeypatch.delenv("FXDIST_SOCKET_SHM_BYTES", raising=False)
    monkeypatch.setattr(socket_transport, "ATTACH_TIMEOUT_S", 0.2)
    before = _arena_handles()
    with silent_server() as address:   # authenticates, then never answers
        future = SocketTransport([address]).call_async(0, "stats", (), 30.0)
        conn = _CONNECTIONS[address]
        assert conn.attached is not None and not conn.attached.done()   # the request did not wait for it
        assert not future.done()
        with pytest.raises(RuntimeError, match="within 0.2 s"):
            conn.attached.wait()
        assert _until(lambda: _arena_handles() == before) and conn.arena is None
        conn._fail("test over")
        with pytest.raises(RuntimeError):
            future.wait()


@pytest.fixture
def victim(tmp_path):
    """A file in /dev/shm (or ``tmp_path`` where there is none) named like an arena and a symlink to it: their
    paths and the file's bytes (its first 16: what a server of the old design checked as the arena's token);
    removed after the test."""
    where = SHM_DIR if os.path.isdir(SHM_DIR) else str(tmp_path)
    path = os.path.join(where, f"fxdist-socket-{os.getpid()}-{uuid.uuid4().hex}")
    data = secrets.token_bytes(1 << 20)
    with open(path, "wb") as f:
        f.write(data)
    os.symlink(path, path + "-link")
    yield path, path + "-link", data
    for name in (path + "-link", path):
        os.unlink(name)


def test_an_attach_that_names_a_file_maps_nothing(monkeypatch, victim):
    """A forged ``attach_shm`` naming a /dev/shm file, or a symlink to one (with the right size and token, as the
    old design wanted), is refused: the server maps nothing, the file is untouched, the connection works on."""
    monkeypatch.setenv("FXDIST_SOCKET_SHM_BYTES", "0")   # this connection hands over no arena of its own
    path, link, data = victim
    stamp = os.stat(path)
    server = _server()
    client = _client(server.address, "forged")
    try:
        conn = _CONNECTIONS[server.address]
        for name in (path, link):
            with pytest.raises(ValueError, match="handed over as a descriptor, never by name"):
                conn.call("attach_shm", (name, len(data), data[:16]), 5.0).wait()
            assert conn.call("attach_shm", ("install", data[:16]), 5.0).wait() is False   # no such token
        assert all(peer.arena is None for peer in server._peers)
        with open("/proc/self/maps") as maps:
            assert not any(path in line for line in maps)
        out = _steps(client, [512, 512])
        assert len(out) == 4 and conn.dead is None and conn.shm_requests == conn.shm_answers == 0
    finally:
        client.close()
        server.close()
    after = os.stat(path)
    with open(path, "rb") as f:
        assert f.read() == data
    assert (after.st_size, after.st_mtime_ns) == (stamp.st_size, stamp.st_mtime_ns)


def test_a_descriptor_whose_size_is_not_sealed_is_refused(monkeypatch, victim):
    """Over the server's own hand-over socket, with a valid token: an unsealed memfd, one sealed against growing
    only, and a named file's descriptor are refused (the token is spent), and the connection stays inline."""
    monkeypatch.setenv("FXDIST_SOCKET_SHM_BYTES", "0")
    path = victim[0]
    server = _server()
    client = _client(server.address, "unsealed")
    fds = [os.memfd_create("fxdist-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING) for _ in range(2)]
    fds.append(os.open(path, os.O_RDWR))
    try:
        os.ftruncate(fds[0], 1 << 20)
        os.ftruncate(fds[1], 1 << 20)
        fcntl.fcntl(fds[1], fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)
        conn = _CONNECTIONS[server.address]
        for fd in fds:
            name, token = conn.call("attach_shm", ("channel", 1 << 20), 5.0).wait()
            with pytest.raises(ValueError, match="server refused the shared-memory arena: .*(not sealed|cannot be)"):
                send_fd(name, token, fd)
            assert conn.call("attach_shm", ("install", token), 5.0).wait() is False
            with pytest.raises(ValueError, match="unknown, used or expired token"):   # one time only
                send_fd(name, token, fd)
        assert all(peer.arena is None for peer in server._peers)
        assert len(_steps(client, [512])) == 2 and conn.shm_requests == 0
    finally:
        for fd in fds:
            os.close(fd)
        client.close()
        server.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_a_peer_of_another_uid_hands_over_nothing():
    channel = FdChannel()
    token = channel.expect("owner", 1 << 20)
    code = ("import os, socket\n"
            "os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
            f"s.connect({channel.name!r})\n"
            "print(s.recv(200).decode())\n")   # refused before it reads anything
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        assert out.stdout.startswith("peer uid 65534 is not the server's (0)"), out
        assert channel.claim("owner", token) is None
    finally:
        channel.close()


def test_a_client_cannot_shrink_its_arena_under_the_server(monkeypatch):
    """The client keeps its arena's descriptor (for the test) and tries to shrink the file once the server (in
    another process) mapped it: the seals refuse (EPERM), and the server answers on through the arena (on a
    file shrunk under its mapping, its next write there would kill it with SIGBUS)."""
    monkeypatch.delenv("FXDIST_SOCKET_SHM_BYTES", raising=False)
    monkeypatch.setattr(Arena, "close_fd", lambda self: None)   # the descriptor stays open (closed below)
    procs, addresses = spawn_servers([f"shm_shrink_{uuid.uuid4().hex[:6]}"])
    fd = None
    try:
        client = _client(addresses[0], "shrink")
        try:
            conn = _CONNECTIONS[addresses[0]]
            fd = conn.arena.fd
            for size in (0, ALIGN, conn.arena.size - 4096):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, size)
            assert os.fstat(fd).st_size == conn.arena.size
            got = _steps(client, [512, 1024, 512, 512])
            assert len(got) == 8 and conn.shm_requests >= 3 and conn.shm_answers >= 3 and procs[0].is_alive()
        finally:
            client.close()
        SocketTransport(addresses).stop(5.0)
    finally:
        if fd is not None:
            os.close(fd)
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
    assert procs[0].exitcode == 0
