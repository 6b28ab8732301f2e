"""Socket parameter servers in their own processes (scheduling/ps/transport/socket_server.py).

Differential: a small model (tests/scheduling/_group.py's ``TinyModel``: lookups, pushes from backward hooks,
and with ``async_rpc_prefetch`` pushes carrying the next lookup) trains bit for bit as over ``torch_rpc``
(``LocalCluster``); faults: a killed server fails the requests in flight at once with a plain transport error
(``PSUnavailableError``), not after the timeout; ``stop`` ends a server's serving loop.
"""

from __future__ import annotations

import time
import uuid

import pytest
import torch
from torch import nn

import fxdist
from scheduling import lookahead
from scheduling.ps import LocalCluster, PSClient, PSUnavailableError
from scheduling.ps.shard_plan import TableSpec
from scheduling.ps.transport.socket_server import serve, spawn_servers
from scheduling.ps.transport.socket_transport import SocketTransport

from .._group import TABLES, TinyModel, batches
from ..test_ps import _kjt, _tables


def _train(servers: list[str], name: str, schedule: str, transport: str | None, steps: int = 5):
    """Losses and tables of ``TinyModel`` trained ``steps`` steps (``eager`` or ``async_rpc_prefetch``)."""
    client = PSClient([TableSpec(n, rows, dim, feats) for n, rows, dim, feats in TABLES], servers, name=name,
                      seed=7, sharding="row_wise", optimizer="rowwise_adagrad", optimizer_kwargs={"lr": 0.1},
                      transport=transport)
    try:
        torch.manual_seed(0)
        model = TinyModel(name)
        module = model if schedule == "eager" else fxdist.optimize(model, passes=("async_rpc_prefetch",))
        opt = torch.optim.SGD(module.parameters(), lr=0.05)
        losses = []
        for (dense, kjt, labels), nxt in lookahead(batches(0, steps)):
            kwargs = {"next_kjt": nxt[1]} if schedule != "eager" and nxt is not None else {}
            loss = nn.functional.binary_cross_entropy_with_logits(module(dense, kjt, **kwargs), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        client.flush()
        return losses, client.state_dict(), client.prefetch_hits
    finally:
        client.close()


def test_training_over_sockets_is_bit_identical_to_torch_rpc():
    procs, addresses = spawn_servers(["ps0", "ps1"])
    try:
        over_socket = {s: _train(addresses, f"sock_{s}", s, "socket") for s in ("eager", "prefetch")}
        SocketTransport(addresses).stop(5.0)
        for p in procs:
            p.join(20)
        assert all(p.exitcode == 0 for p in procs)          # stop ended the serving loops
    finally:
        for p in procs:
            p.kill()
    with LocalCluster(2, timeout_s=30) as cluster:
        over_rpc = {s: _train(cluster.server_names, f"rpc_{s}", s, None) for s in ("eager", "prefetch")}
    for s in ("eager", "prefetch"):
        (losses, tables, hits), (rpc_losses, rpc_tables, rpc_hits) = over_socket[s], over_rpc[s]
        assert losses == rpc_losses and hits == rpc_hits, s
        assert tables.keys() == rpc_tables.keys()
        assert all(torch.equal(tables[k], rpc_tables[k]) for k in tables), s
    assert over_socket["prefetch"][2] > 0 and over_socket["eager"][0] == over_socket["prefetch"][0]


def test_a_killed_server_fails_the_requests_in_flight_with_a_transport_error():
    procs, addresses = spawn_servers(["ps_kill"])
    client = PSClient(_tables(), addresses, transport="socket", name=f"kill_{uuid.uuid4().hex[:6]}", timeout_s=60)
    try:
        client.set_delays(fetch_delay_s=30.0)               # the lookup is in the server when it dies
        future = client.lookup_async(0, _kjt())
        procs[0].kill()
        procs[0].join()
        with pytest.raises(PSUnavailableError, match=r"connection to server 127\.0\.0\.1:\d+ lost"):
            client.finish_lookup(future, 0)                  # at once: not the 60 s timeout's message
        with pytest.raises(PSUnavailableError, match="cannot connect to server"):
            client.stats()                                   # a new connection is refused
    finally:
        client.close(flush=False)
        procs[0].kill()


def test_a_server_that_fails_to_start_is_reported(tmp_path):
    with pytest.raises(RuntimeError, match=r"socket server 'ps_bad' failed to start: FileNotFoundError"):
        spawn_servers(["ps_bad"], checkpoint=str(tmp_path / "missing.pt"))


def test_close_ends_the_servers_threads_so_the_process_exits_cleanly():
    """A reader thread left running while a server process finalizes aborted it (exit -6): close() joins them."""
    import threading

    server = serve("ps_join", block=False)
    mine = set(threading.enumerate())
    assert any(t.name == f"fxdist-socket-accept-{server.address}" for t in mine)
    client = PSClient([TableSpec("t", 20, 4, ("f0", "f1", "f2"))], [server.address],
                      name=f"join_{uuid.uuid4().hex[:6]}", transport="socket")
    try:
        assert client.lookup(0, _kjt()).shape == (2, 12)
    finally:
        client.close()
    readers = [t for t in threading.enumerate() if t.name == "fxdist-socket-peer" and t not in mine]
    assert readers, "the client's connection has a reader thread"
    server.close()
    alive = [t.name for t in threading.enumerate()
             if t in readers or t.name == f"fxdist-socket-accept-{server.address}"]
    assert alive == []


def test_a_server_keeps_only_its_live_connections():
    """A server actor outlives many worker groups, each connecting anew: connections that ended are dropped."""
    import socket

    server = serve("ps_peers", block=False)
    host, port = server.address.rsplit(":", 1)
    try:
        for _ in range(4):
            with socket.create_connection((host, int(port)), timeout=10):
                deadline = time.monotonic() + 10
                while len([p for p in server._peers if not p.closed]) != 1 and time.monotonic() < deadline:
                    time.sleep(0.01)   # accepted
            deadline = time.monotonic() + 10
            while not all(p.closed for p in server._peers) and time.monotonic() < deadline:
                time.sleep(0.01)   # its reader saw the EOF
            assert len(server._peers) == 1 and server._peers[0].closed   # the earlier ones went when it connected
    finally:
        server.close()
