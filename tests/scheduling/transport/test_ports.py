"""scheduling.ps.transport.ports: free ports, and a server group that still assembles when its port is taken first
(another process can bind a port found free before the group does)."""

from __future__ import annotations

import socket

import pytest

from scheduling.ps import LocalCluster
from scheduling.ps.transport.ports import free_port, free_port_block, is_bind_failure


def test_free_port_is_bindable():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_free_port_block_is_free():
    base = free_port_block(3)
    socks = [socket.socket() for _ in range(3)]
    try:
        for i, s in enumerate(socks):
            s.bind(("127.0.0.1", base + i))
    finally:
        for s in socks:
            s.close()


def test_is_bind_failure_reads_the_cause():
    taken = RuntimeError("The server socket has failed to listen on any local network address. EADDRINUSE")
    try:
        raise ValueError("group did not assemble") from taken
    except ValueError as e:
        assert is_bind_failure(e)
    assert not is_bind_failure(RuntimeError("timed out"))


@pytest.mark.timeout(120)
def test_group_assembles_when_its_port_is_taken_before_the_bind():
    cluster = LocalCluster(num_servers=1, timeout_s=20)
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", cluster.port))  # taken between free_port() and the rendezvous's bind
    squatter.listen()
    taken = cluster.port
    try:
        with cluster:
            assert cluster.port != taken
            assert cluster.processes[0].is_alive()
    finally:
        squatter.close()


def test_a_reserved_port_is_refused_to_others_but_the_rendezvous_store_binds_it():
    from datetime import timedelta

    import torch.distributed as dist

    from scheduling.ps.transport.ports import reserve_port

    port, held = reserve_port()
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # another process choosing it explicitly is refused
        store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10))  # what init_rpc builds
        store.set("k", "v")
        assert store.get("k") == b"v"
        del store
    finally:
        held.close()
