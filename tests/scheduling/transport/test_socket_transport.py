"""The ``socket`` transport (scheduling/ps/transport/socket_transport.py) against a server in this process.

Differential: every endpoint answers over the socket exactly what the same request answers when called directly
(``in_trainers.call_local``, no transport) on a second server given the same requests; the wire keeps tensors
bit for bit whatever their size; the server's exceptions come back as themselves, transport failures as a
plain ``RuntimeError`` (``PSUnavailableError`` on the client); answers are matched by request id whatever
their order; and the step order of a group (scheduling/ps/ordering.py, rule 2) holds for two trainers sharing
one connection.
"""

from __future__ import annotations

import socket
import threading
import uuid

import pytest
import torch
from torchrec import EmbeddingBagConfig

from scheduling.ps import PSClient, PSUnavailableError
from scheduling.ps.endpoints import ServerEndpoints
from scheduling.ps.in_trainers import call_local
from scheduling.ps.server import PSServer
from scheduling.ps.transport import transport_of
from scheduling.ps.transport.socket_server import SocketServer
from scheduling.ps.transport.socket_transport import (
    SocketTransport,
    dumps,
    is_socket_server,
    parse_address,
    register_servers,
    unregister_servers,
)

from ..test_ps import _kjt, _tables
from ._peers import silent_server


class _Direct:
    """A transport calling a server's endpoints in this process (``in_trainers.call_local``): the reference."""

    name = "direct"

    def __init__(self, endpoints: ServerEndpoints) -> None:
        self.endpoints, self.names = endpoints, ["direct"]

    def call_async(self, server: int, method: str, args: tuple, timeout_s: float) -> torch.futures.Future:
        return call_local(self.endpoints, method, args)


@pytest.fixture()
def server(tmp_path):
    srv = SocketServer(ServerEndpoints(PSServer("sock0")), save_root=str(tmp_path)).start()
    yield srv
    srv.close()


def _pair(server, name: str, **kwargs):
    """``(client over the socket, client over direct calls of its own server)``, same tables and seed."""
    sock = PSClient(_tables(), [server.address], transport="socket", name=f"{name}_sock", seed=3, **kwargs)
    ref = PSClient(_tables(), ["direct"], name=f"{name}_ref", seed=3, configure=False, **kwargs)
    ref.transport = _Direct(ServerEndpoints(PSServer("sock0")))
    ref.configure()
    return sock, ref


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b


def test_every_endpoint_answers_over_the_socket_as_called_directly(server, tmp_path):
    sock, ref = _pair(server, "every")
    try:
        assert sock.transport.name == "socket"
        kjt, nxt = _kjt(), _kjt(weighted=True)
        for c in (sock, ref):
            c.weighted = False
        answers = {}
        for c in (sock, ref):
            out = [c.lookup(0, kjt)]
            with c.read_only():
                out.append(c.lookup(0, nxt))                                            # peek
            out.append(c.finish_push(c.push_grad_async(0, kjt, torch.full((2, 10), 0.5)), 0))
            both = c.push_grad_async(0, kjt, torch.full((2, 10), -0.25), next_kjt=nxt)  # push_lookup
            out += [both.wait(), c.lookup(0, nxt)]
            calls = [("push", (c.name, c._wire(kjt), torch.ones(2, 10))), ("lookup", (c.name, c._wire(nxt), None)),
                     ("lookup", ("no_such_client", c._wire(nxt), None))]
            answers_batch = c.transport.call_async(0, "batch", (calls,), 5.0).wait()
            out.append([a for a, _ in answers_batch[:2]])
            out.append(type(answers_batch[2][1]).__name__)                             # ValueError, per call
            out.append(c.state_dict())
            c.load_state_dict({k: v * 2 for k, v in c.state_dict().items()})
            out.append(c.state_dict())
            c.set_delays(0.0, 0.0)
            stats = c.stats()[0]
            out.append({k: stats[k] for k in ("lookups", "pushes", "requests", "rows", "bytes")})
            out.append(c.dynamic_stats())
            (tmp_path / c.name).mkdir()
            saved = c._call(0, "save", (str(tmp_path / c.name),), "save")
            out.append(sorted(k.partition("/")[2] for k in torch.load(saved, weights_only=False)))  # no namespace
            answers[c.name] = out
        _same(answers["every_sock"], answers["every_ref"])
        assert answers["every_sock"][6] == "ValueError" and answers["every_sock"][9]["lookups"] > 0
    finally:
        sock.close()
        ref.close()


def test_large_tensors_cross_bit_for_bit(server):
    big = torch.randn(120_000, 48, generator=torch.Generator().manual_seed(5))      # 23 MB each way
    tables = _tables() + [EmbeddingBagConfig(name="big", embedding_dim=48, num_embeddings=120_000, feature_names=["f3"])]
    client = PSClient(tables, [server.address], transport="socket", name="big", init_weights={"big": big})
    try:
        assert torch.equal(client.state_dict()["big.weight"], big)
        meta, buffers = dumps((big, torch.zeros(0, 3), torch.tensor(7), big[:, 1]))  # a strided view: copied
        assert len(buffers) == 4 and len(meta) < 1000
    finally:
        client.close()


def test_every_kind_of_tensor_crosses_the_wire_as_it_was():
    from scheduling.ps.transport.socket_transport import ANSWER, recv_message, send_message

    gen = torch.Generator().manual_seed(4)
    z = torch.randn(4, 5, dtype=torch.complex64, generator=gen)
    value = [torch.randn(3, 4, generator=gen).t(), torch.tensor(2.5), torch.zeros(0, 4), torch.arange(10)[2:7],
             torch.randn(3, generator=gen).to(torch.bfloat16), torch.randn(3, generator=gen, requires_grad=True),
             z.conj(), torch._neg_view(z), torch.tensor([True, False]), torch.nn.Parameter(torch.randn(2, generator=gen)),
             torch.randn(3, 3, generator=gen).to_sparse()]
    a, b = socket.socketpair()
    try:
        sender = threading.Thread(target=lambda: send_message(a, ANSWER, 4, 12, *dumps(value)))
        sender.start()
        got = recv_message(b, bytearray(16))[3]
        sender.join()
        for sent, came in zip(value, got, strict=True):
            sent = sent.detach().resolve_conj().resolve_neg()
            assert came.dtype == sent.dtype and came.shape == sent.shape and came.layout == sent.layout
            assert torch.equal(came.to_dense(), sent.to_dense())
            assert not came.is_conj() and not came.is_neg()
    finally:
        a.close()
        b.close()


def test_a_message_of_more_buffers_than_one_scatter_read_takes_arrives_whole():
    from scheduling.ps.transport.socket_transport import ANSWER, recv_message, send_message

    gen = torch.Generator().manual_seed(3)
    value = ([torch.randint(0, 9, (i % 7,), generator=gen) for i in range(700)],     # > 512 buffers, some empty
             torch.randn(3_000_000, generator=gen), "meta")                           # > the socket buffers
    a, b = socket.socketpair()
    try:
        sender = threading.Thread(target=lambda: send_message(a, ANSWER, 4, 11, *dumps(value)))
        sender.start()
        kind, method, rid, got = recv_message(b, bytearray(16))
        sender.join()
        assert (kind, method, rid, got[2]) == (ANSWER, 4, 11, "meta")
        assert all(torch.equal(x, y) for x, y in zip(got[0], value[0])) and len(got[0]) == 700
        assert torch.equal(got[1], value[1])
    finally:
        a.close()
        b.close()


def test_an_empty_tensor_received_saves_and_loads_like_one_never_sent():
    """A received empty tensor owns an empty storage: ``torch.save`` (a checkpoint of a server state holding one,
    e.g. a dynamic table's empty eviction list) refuses a tensor whose storage is larger than its data."""
    import io

    from scheduling.ps.transport.socket_transport import ANSWER, recv_message, send_message

    value = {"empty": torch.empty(0, 4), "ids": torch.empty(0, dtype=torch.int64), "rows": torch.ones(2, 4)}
    a, b = socket.socketpair()
    try:
        send_message(a, ANSWER, 1, 2, *dumps(value))
        got = recv_message(b, bytearray(16))[3]
    finally:
        a.close()
        b.close()
    assert got["empty"].shape == (0, 4) and got["ids"].dtype == torch.int64
    assert got["empty"].untyped_storage().nbytes() == 0
    out = io.BytesIO()
    torch.save(got, out)
    out.seek(0)
    back = torch.load(out, weights_only=True)
    assert back["empty"].shape == (0, 4) and torch.equal(back["rows"], value["rows"])


def test_server_exceptions_are_raised_as_themselves_and_the_connection_goes_on(server):
    client = PSClient(_tables(), [server.address], transport="socket", name="errors")
    try:
        bad = type(_kjt())(keys=["f0", "f1", "f2"], values=torch.tensor([99]), lengths=torch.tensor([1, 0, 0]))
        with pytest.raises(ValueError, match=r"server sock0: feature 'f0' has id 99 outside table 't0'"):
            client.lookup(0, bad)
        with pytest.raises(ValueError, match="no tables configured for client 'nobody'"):
            client._call(0, "push", ("nobody", client._wire(_kjt()), torch.zeros(2, 10)), "push")
        server.endpoints.server = None    # no server: a RuntimeError there, unavailable here (as over torch_rpc)
        with pytest.raises(PSUnavailableError, match="no parameter server runs in process"):
            client.stats()
    finally:
        client.close(flush=False)


def test_a_server_that_never_answers_is_unavailable_after_the_timeout():
    with silent_server() as address:                # authenticates, then the connection stays open, unanswered
        transport = SocketTransport([address])
        with pytest.raises(RuntimeError, match=rf"no answer from server {address} within 0.3 s") as info:
            transport.call_async(0, "stats", (), 0.3).wait()
        assert type(info.value) is RuntimeError


def test_a_short_timeout_sent_after_a_long_one_still_expires_first():
    with silent_server() as address:
        transport = SocketTransport([address])
        slow = transport.call_async(0, "stats", (), 60.0)
        fast = [transport.call_async(0, "stats", (), 0.3) for _ in range(3)]
        for future in fast:
            with pytest.raises(RuntimeError, match=rf"no answer from server {address} within 0.3 s"):
                future.wait()
        assert not slow.done()      # its own deadline is far: still waiting


def test_a_refused_connection_raises_when_sending():
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    with pytest.raises(RuntimeError, match="cannot connect to server"):
        SocketTransport([f"127.0.0.1:{port}"]).call_async(0, "stats", (), 2.0)


def test_answers_are_matched_by_id_when_they_come_out_of_order(server):
    client = PSClient(_tables(), [server.address], transport="socket", name="order", seed=1)
    try:
        key, kjt, arrived = f"k-{uuid.uuid4().hex}", _kjt(), []
        futures = {}
        for seq in reversed(range(12)):             # sent last-first: the server parks them until seq 0 comes
            futures[seq] = client.transport.call_async(0, "lookup", ("order", client._wire(kjt), None,
                                                                      (key, seq, 10.0)), 10.0)
            futures[seq].add_done_callback(lambda f, seq=seq: arrived.append(seq))
        expected = client.lookup(0, kjt)
        for fut in futures.values():
            assert torch.equal(fut.wait(), expected)
        # answered in turn order, the reverse of the sending order (seq 0's callback was attached last)
        assert sorted(arrived) == list(range(12)) and [s for s in arrived if s] == list(range(1, 12))
    finally:
        client.close()


def test_many_outstanding_requests_from_many_threads(server):
    sock, ref = _pair(server, "many", ordered=False)
    try:
        gen = torch.Generator().manual_seed(0)
        kjts = [type(_kjt())(keys=["f0", "f1", "f2"], values=torch.randint(0, 7, (12,), generator=gen),
                             lengths=torch.tensor([2, 2, 2, 2, 2, 2])) for _ in range(40)]
        expected = [ref.lookup(0, k) for k in kjts]
        results: dict[tuple[int, int], torch.Tensor] = {}

        def worker(t: int) -> None:
            futs = [(i, sock.lookup_async(0, k)) for i, k in enumerate(kjts)]   # all in flight, then waited
            for i, f in futs:
                results[(t, i)] = f.wait()

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert len(results) == 6 * 40
        assert all(torch.equal(v, expected[i]) for (_, i), v in results.items())
    finally:
        sock.close()
        ref.close()


def _direct_client(name: str, **kwargs) -> PSClient:
    client = PSClient(_tables(), ["direct"], name=name, seed=2, configure=False, **kwargs)
    client.transport = _Direct(ServerEndpoints(PSServer("sock0")))
    client.configure()
    return client


def test_two_trainers_on_one_connection_keep_the_step_order(server):
    """Rank 1 pushes and looks up first (raw requests, numbered as its client would); the server holds both
    until rank 0's push of the same count, applies the pushes in rank order, then serves the lookup: as pushing
    rank 0's gradient, then rank 1's, directly. (A process holds one client per name: rank 1 is sent by hand.)"""
    group, kjt = f"g-{uuid.uuid4().hex}", _kjt()
    grads = [torch.linspace(-1, 1, 20).reshape(2, 10), torch.linspace(2, -3, 20).reshape(2, 10)]
    rank0 = PSClient(_tables(), [server.address], transport="socket", name="pair", seed=2, rank=0, world_size=2,
                     group=group, grad_reduction="sum")
    ref, swapped = _direct_client("pair_ref"), _direct_client("pair_swapped")
    try:
        wire, key1, sync = rank0._wire(kjt), f"rank1-{uuid.uuid4().hex}", (f"{group}/pair", 1, 2)
        push1 = rank0.transport.call_async(0, "push", ("pair", wire, grads[1], (key1, 0, 10.0, (*sync, 0, None))), 10)
        look1 = rank0.transport.call_async(0, "lookup", ("pair", wire, None, (key1, 1, 10.0, (*sync, 1, 0))), 10)
        assert rank0.finish_push(rank0.push_grad_async(0, kjt, grads[0]), 0) > 0
        assert push1.wait() > 0
        for g in grads:
            ref.finish_push(ref.push_grad_async(0, kjt, g), 0)
        assert torch.equal(look1.wait(), ref.lookup(0, kjt))
        for g in reversed(grads):                   # the other order gives other rows: the test can fail
            swapped.finish_push(swapped.push_grad_async(0, kjt, g), 0)
        assert not torch.equal(swapped.lookup(0, kjt), ref.lookup(0, kjt))
    finally:
        for c in (rank0, ref, swapped):
            c.close()


def test_a_lookup_waits_for_the_other_trainers_push(server):
    """Rule 2 over the socket: rank 1's lookup after its first push is not answered while rank 0's first push
    has not arrived (it is parked, holding no reader thread: rank 0's requests still get through)."""
    group, kjt = f"g-{uuid.uuid4().hex}", _kjt()
    rank0 = PSClient(_tables(), [server.address], transport="socket", name="wait", seed=2, rank=0, world_size=2,
                     group=group, grad_reduction="sum")
    try:
        wire, key1, sync = rank0._wire(kjt), f"rank1-{uuid.uuid4().hex}", (f"{group}/wait", 1, 2)
        rank0.transport.call_async(0, "push", ("wait", wire, torch.ones(2, 10), (key1, 0, 10.0, (*sync, 0, None))), 10)
        look1 = rank0.transport.call_async(0, "lookup", ("wait", wire, None, (key1, 1, 10.0, (*sync, 1, 0))), 10)
        before = rank0.lookup(0, kjt)                # rank 0's own lookup of count 0 is served meanwhile
        assert not look1.done()
        rank0.finish_push(rank0.push_grad_async(0, kjt, torch.ones(2, 10)), 0)
        assert not torch.equal(look1.wait(), before)
    finally:
        rank0.close()


def test_registered_names_pick_the_socket_transport_and_bad_addresses_are_clear(server):
    register_servers({"sock_a": server.address})
    try:
        assert is_socket_server("sock_a") and transport_of(["sock_a"]) == "socket"
        assert SocketTransport(["sock_a"]).addresses == [server.address]
        assert transport_of(["sock_a", "elsewhere"]) == "torch_rpc"
    finally:
        unregister_servers(["sock_a"])
    assert parse_address("10.0.0.1:5") == ("10.0.0.1", 5)
    with pytest.raises(ValueError, match="server address 'ps9' is not 'host:port'"):
        SocketTransport(["ps9"])
