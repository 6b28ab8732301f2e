"""Short jobs over the ``ray`` and ``socket`` transports (``[cluster] transport``): the trainers reach the
parameter-server actor without a torch.distributed.rpc group (its methods called directly, or its socket); the
server is killed mid-phase, Ray restarts its actor, and the restarted worker group loads the checkpoint's tables
into it (the same recovery as ``torch_rpc``); ``socket`` trains exactly as ``torch_rpc``, also across the fault. The
``socket`` job runs with ``[cluster] tls = true`` (every connection in TLS 1.3 with the job's own authority): plain
socket jobs are the default everywhere else, and TLS must not change a bit of what crosses.

Three jobs share one Ray session and are run once for the module (:func:`runs`): ``ray`` and ``socket`` with the
server killed at step 13, and ``torch_rpc`` with no fault, the reference the socket run must equal bit for bit."""

from __future__ import annotations

import pytest

from jobs.config import load_config

pytestmark = pytest.mark.timeout(900)  # per test, with the module's three jobs in its fixture

STEPS, CHECKPOINT, KILL_AT = 20, 10, 13


def _config(transport: str, steps: int, **faults):
    tls = {"tls": True} if transport == "socket" else {}
    return load_config().replace(
        job={"steps": steps, "batch_size": 32, "checkpoint_every": CHECKPOINT, "max_failures": 2, "progress": False,
             "name": f"fxdist-{transport.replace('_', '')}transport", "eval_epochs": 0},
        model={"table_size": 200, "bottom_mlp": [8], "top_mlp": [8]}, phases={"block_steps": 5},
        cluster={"trainers": 2, "parameter_servers": 1, "cpus_per_trainer": 0.5, "rpc_timeout_s": 20.0,
                 "transport": transport, **tls},
        metrics={"enabled": False}, quant={"enabled": False}, faults=faults)


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    """results of the ``ray`` and ``socket`` jobs with the server killed at step 13, and of the ``torch_rpc`` job
    with the same config and no fault."""
    from jobs.launcher.launch import launch

    tmp = tmp_path_factory.mktemp("transport")
    out = {t: launch(_config(t, STEPS, kill_server_at_step=KILL_AT), run_dir=tmp / t, quiet=True)
           for t in ("ray", "socket")}
    out["torch_rpc"] = launch(_config("torch_rpc", STEPS), run_dir=tmp / "torch_rpc", quiet=True)
    return out


@pytest.mark.parametrize("transport", ["ray", "socket"])
def test_transport_job_recovers_a_killed_server(runs, transport):
    r = runs[transport]
    assert r["status"] == "completed" and r["config"]["cluster"]["transport"] == transport
    assert r["faults_fired"] == ["server"] and r["restarts"] == 1
    # the restarted worker group resumed from step 10 with exactly the checkpoint's tables and weights
    saved = {(c["phase"], c["step"]): c for c in r["checkpoints"]}
    assert [(x["phase"], x["step"]) for x in r["restores"]] == [("baseline", 10), ("optimized", 10)]
    for restore in r["restores"]:
        assert restore["tables"] == saved[(restore["phase"], restore["step"])]["tables"]
        assert restore["model"] == saved[(restore["phase"], restore["step"])]["model"]
    # rank 0 reset the same actor handle twice: a new process after the kill, no group to re-join
    (first,), (after,) = r["server_joins"]
    assert after["pid"] != first["pid"]
    if transport == "socket":  # rank 0 took the restarted actor's address again (the OS may give it the same port)
        assert ":" in after["address"] and r["config"]["cluster"]["tls"] is True
    # both phases trained the same batches in step order on the servers: same model
    assert r["parity"]["ok"], r["parity"]
    # the last worker group trained steps 11..20 of each phase, from the step-10 checkpoint
    assert r["phases"]["baseline"]["steps"] == r["phases"]["optimized"]["steps"] == 10


def test_socket_transport_job_trains_bit_identically_to_torch_rpc(runs):
    """The socket run (server killed at step 13) against the torch_rpc run of the same config without a fault:
    the same dense weights and tables at the step-10 checkpoint (written before the fault) and at the end, and the
    same per-step losses of steps 11..20, bit for bit."""
    sock, rpc = runs["socket"], runs["torch_rpc"]
    assert rpc["status"] == "completed" and rpc["config"]["cluster"]["transport"] == "torch_rpc"
    assert rpc["faults_fired"] == [] and rpc["restarts"] == 0
    (joined,) = sock["server_joins"][0]
    assert ":" in joined["address"]  # the actor's socket, not Ray, carried the requests
    digests = {t: {(c["phase"], c["step"]): (c["model"], c["tables"]) for c in runs[t]["checkpoints"]}
               for t in ("torch_rpc", "socket")}
    for phase in ("baseline", "optimized"):
        for step in (CHECKPOINT, STEPS):
            assert digests["socket"][(phase, step)] == digests["torch_rpc"][(phase, step)], (phase, step)
        losses = [rpc["phases"][phase]["loss_series"], sock["phases"][phase]["loss_series"]]
        assert len(losses[0]) == STEPS and losses[0][CHECKPOINT:] == losses[1]
