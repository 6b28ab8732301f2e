"""Parameter servers inside the trainers' processes (``scheduling.ps.in_trainers``).

The end-to-end test trains the same model with 2 DDP trainers (gloo) against 2 separate server processes and
against servers hosted by the trainers themselves (each trainer's own requests called directly, inline or on
one server thread; the other's by RPC), eagerly and with ``async_rpc_prefetch``: the losses and the final tables must be bit-identical. The
unit tests drive a directly called server in this process (no RPC group needed).
"""

from __future__ import annotations

import pytest
import torch

from scheduling.ps import PSClient, get_client, serve_in_trainer, stop_serving, trainer_servers
from scheduling.ps.in_trainers import call_local, hosted_worker, local_endpoints
from scheduling.ps.shard_plan import TableSpec
from scheduling.ps.transport.ports import free_port
from tests.scheduling import _group


@pytest.fixture(params=["inline", "thread"])
def hosted(request):
    server = serve_in_trainer("me", name="ps-me", own_requests=request.param)
    try:
        yield server
    finally:
        stop_serving()


def _kjt(ids: list[int]):
    from torchrec import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=["f0"], values=torch.tensor(ids), lengths=torch.ones(len(ids), dtype=torch.long))


def test_trainer_servers_names_the_trainers_and_rejects_an_empty_group():
    assert trainer_servers(3) == ["trainer0", "trainer1", "trainer2"]
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        trainer_servers(0)


def test_a_second_server_in_one_process_is_refused(hosted):
    assert hosted_worker() == "me" and local_endpoints("me") is not None and local_endpoints("other") is None
    with pytest.raises(RuntimeError, match="'ps-me' already runs in this process"):
        serve_in_trainer("me2")


def test_an_unknown_place_for_own_requests_is_refused():
    with pytest.raises(ValueError, match=r"own_requests='pool'; use one of \('inline', 'thread'\)"):
        serve_in_trainer("me", own_requests="pool")
    assert hosted_worker() is None


def test_a_client_of_its_own_process_server_trains_without_rpc(hosted):
    tables = [TableSpec("t0", 10, 4, ("f0",))]
    client = PSClient(tables, ["me"], name="own", optimizer="sgd", optimizer_kwargs={"lr": 0.5}, seed=3)
    try:
        kjt = _kjt([1, 2, 2])
        before = client.state_dict()["t0.weight"].clone()
        out = client.lookup(0, kjt)
        assert torch.equal(out, before[[1, 2, 2]])
        out.sum().backward()
        assert client.push(0, kjt, out) == 2
        after = client.state_dict()["t0.weight"]
        expected = before.clone()
        expected[1] -= 0.5
        expected[2] -= 1.0                      # two bags of id 2: their gradients summed
        assert torch.equal(after, expected)
        assert hosted.num_lookups == 1 and hosted.num_pushes == 1   # the server object itself answered
        with pytest.raises(ValueError, match="id 10 outside table 't0'"):   # the server's own error class
            client.lookup(0, _kjt([10]))
    finally:
        get_client("own").close()


def test_call_local_answers_a_batch_per_call_and_a_missing_server_as_unavailable(hosted):
    client = PSClient([TableSpec("t0", 10, 4, ("f0",))], ["me"], name="batch", optimizer="sgd")
    try:
        endpoints = local_endpoints("me")
        assert endpoints is not None
        grad = torch.ones(1, 4)
        answers = call_local(endpoints, "batch", ([("push", ("batch", client._wire(_kjt([3])), grad)),
                                                   ("push", ("nobody", client._wire(_kjt([3])), grad))],)).wait()
        assert answers[0] == (1, None)
        assert isinstance(answers[1][1], ValueError) and "no tables configured for client 'nobody'" in str(
            answers[1][1])
    finally:
        client.close()
    stop_serving()
    with pytest.raises(RuntimeError, match="no parameter server runs in process"):
        call_local(endpoints, "stats", ()).wait()


@pytest.mark.timeout(400)
def test_servers_in_trainers_train_exactly_as_separate_server_processes(trained_groups):
    """The groups of ``_group.run_group`` (spawned once a session; the separate one is test_ps_group.py's too)."""
    world, steps, runs = _group.WORLD, _group.STEPS, _group.RUNS
    found = {in_trainers: trained_groups(in_trainers) for in_trainers in (None, "inline", "thread")}
    _group.assert_in_trainers_train_as_separate(found, runs, world, steps)


def test_group_servers_lists_the_trainer_that_hosts_one():
    from torch.distributed import rpc

    from scheduling.ps import group_servers, init_trainer

    serve_in_trainer("trainer0", name="ps0")
    try:
        init_trainer("trainer0", 0, 1, master_port=free_port(), timeout_s=30)
        try:
            assert group_servers() == ["trainer0"]
        finally:
            rpc.shutdown(graceful=False)
    finally:
        stop_serving()
