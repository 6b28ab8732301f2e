"""Parameter servers inside the trainers' processes over the ``socket`` transport
(``scheduling.ps.in_trainers.serve_in_trainer_socket`` and ``share_addresses``).

The end-to-end test trains the same model with 2 DDP trainers (gloo) against 2 separate socket server processes
and against socket servers hosted by the trainers themselves (each trainer's own requests called directly,
inline or on one server thread; the other trainer's over its socket), eagerly and with ``async_rpc_prefetch``:
the losses and the final tables must be bit-identical. The unit tests drive a hosted server in this process.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from scheduling.ps import PSClient, stop_serving
from scheduling.ps.in_trainers import hosted_worker, local_endpoints, serve_in_trainer_socket, share_addresses
from scheduling.ps.shard_plan import TableSpec
from scheduling.ps.transport import auth
from scheduling.ps.transport import socket_transport as st
from scheduling.ps.transport.ports import free_port
from tests.scheduling import _group

from .test_ps_in_trainers import _kjt


@pytest.mark.parametrize("direct", [True, False])
def test_own_requests_skip_the_socket_unless_not_direct(direct):
    served = serve_in_trainer_socket("ps-me", direct=direct)
    try:
        assert hosted_worker() == "ps-me"
        assert (local_endpoints("ps-me") is not None) == direct == (served.address in st._LOCAL)
        st.register_servers({"ps-me": served.address})
        client = PSClient([TableSpec("t0", 10, 4, ("f0",))], ["ps-me"], name=f"own_{direct}", optimizer="sgd",
                          optimizer_kwargs={"lr": 0.5}, seed=3)
        assert client.transport.name == "socket"
        kjt = _kjt([1, 2, 2])
        before = client.state_dict()["t0.weight"].clone()
        out = client.lookup(0, kjt)
        assert torch.equal(out, before[[1, 2, 2]])
        out.sum().backward()
        assert client.push(0, kjt, out) == 2
        expected = before.clone()
        expected[1] -= 0.5
        expected[2] -= 1.0                      # two bags of id 2: their gradients summed
        assert torch.equal(client.state_dict()["t0.weight"], expected)
        assert (served.address in st._CONNECTIONS) != direct   # over the socket only when not direct
        with pytest.raises(ValueError, match="id 10 outside table 't0'"):   # the server's own error class
            client.lookup(0, _kjt([10]))
        client.close()
    finally:
        stop_serving()
        st.unregister_servers(["ps-me"])
    assert hosted_worker() is None and served.address not in st._LOCAL


def test_a_socket_server_that_cannot_bind_is_dropped_again():
    blocker = socket.socket()
    try:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen(1)
        with pytest.raises(OSError):
            serve_in_trainer_socket("ps-b", port=blocker.getsockname()[1])
        assert hosted_worker() is None
        serve_in_trainer_socket("ps-c")   # nothing left of the failed one
        assert hosted_worker() == "ps-c"
    finally:
        stop_serving()
        blocker.close()


def test_share_addresses_needs_a_server_per_name_and_no_more_names_than_ranks():
    with pytest.raises(RuntimeError, match=r"rank 0 \(ps0\) serves no socket server; call serve_in_trainer_socket"):
        share_addresses(["ps0"])
    served = serve_in_trainer_socket("ps0")
    try:
        assert share_addresses(["ps0"]) == {"ps0": served.address}   # alone: no process group needed
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        try:
            with pytest.raises(RuntimeError, match=r"2 names \['ps0', 'ps1'\] for a group of 1 trainers"):
                share_addresses(["ps0", "ps1"])
            assert share_addresses(["ps0"]) == {"ps0": served.address} and st._ADDRESSES["ps0"] == served.address
        finally:
            dist.destroy_process_group()
    finally:
        stop_serving()
        st.unregister_servers(["ps0"])


def _trainer(rank: int, world: int, pg_port: int, addresses: list[str], own: str | None, runs: list[tuple],
             steps: int, queue: Any) -> None:
    """Trainer ``rank``: servers ``ps<i>`` at ``addresses`` (separate processes), or with ``own`` (where its own
    requests run) hosted by the trainers, server ``i`` in trainer ``i``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank, world_size=world)
    names = [f"ps{i}" for i in range(world)]
    try:
        if own is None:
            st.register_servers(dict(zip(names, addresses)))
        else:
            serve_in_trainer_socket(f"ps{rank}", own_requests=own)
            share_addresses(names)
        box = [f"group-{time.time_ns()}"]
        dist.broadcast_object_list(box, src=0)
        results = {name: _group._train(name, rank, world, schedule, sync, jitter_s, steps, names, box[0])
                   for name, schedule, sync, jitter_s in runs}
        dist.barrier()   # no trainer still sends to a server that ends with its trainer
        if own is None and rank == 0:
            st.SocketTransport(addresses).stop(5.0)
        queue.put((rank, results))
    except BaseException as e:
        queue.put((rank, {"error": f"{type(e).__name__}: {e}"}))
        raise
    finally:
        stop_serving()
        dist.destroy_process_group()


@pytest.mark.timeout(400)
def test_socket_servers_in_trainers_train_exactly_as_separate_socket_servers():
    from scheduling.ps.transport.socket_server import spawn_servers

    world, steps = 2, 6
    auth.job_key(create=True)   # before spawning: every trainer (and server) inherits the job key
    runs = [("eager", "eager", True, 0.0), ("prefetch", "prefetch", True, 0.0),
            ("prefetch_jitter", "prefetch", True, 0.02)]
    ctx = mp.get_context("spawn")
    found = {}
    for own in (None, "inline", "thread"):
        queue = ctx.Queue()
        procs, addresses = spawn_servers(["ps0", "ps1"], ctx=ctx) if own is None else ([], [])
        pg_port = free_port()
        targets = [(_trainer, (r, world, pg_port, addresses, own, runs, steps, queue)) for r in range(world)]
        found[own] = _group.spawn_and_collect(ctx, targets, queue, world)
        for p in procs:
            p.join(20)
            assert p.exitcode == 0          # the trainers' stop ended the separate servers
        assert all("error" not in found[own][r] for r in range(world)), found[own]
    _group.assert_in_trainers_train_as_separate(found, runs, world, steps)
