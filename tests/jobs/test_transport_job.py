"""Short jobs over the ``ray`` and ``socket`` transports (``[cluster] transport``): the trainers reach the
parameter-server actor without a torch.distributed.rpc group (its methods called directly, or its socket); the
server is killed mid-phase, Ray restarts its actor, and the restarted worker group loads the checkpoint's tables
into it (the same recovery as ``torch_rpc``); with no fault, ``socket`` trains exactly as ``torch_rpc``."""

from __future__ import annotations

import pytest

from jobs.config import load_config

pytestmark = pytest.mark.timeout(420)


def _config(transport: str, steps: int, **faults):
    return load_config().replace(
        job={"steps": steps, "batch_size": 32, "checkpoint_every": 10, "max_failures": 2, "progress": False,
             "name": f"fxdist-{transport.replace('_', '')}transport", "eval_epochs": 0},
        model={"table_size": 200, "bottom_mlp": [8], "top_mlp": [8]}, phases={"block_steps": 5},
        cluster={"trainers": 2, "parameter_servers": 1, "cpus_per_trainer": 0.5, "rpc_timeout_s": 20.0,
                 "transport": transport},
        metrics={"enabled": False}, quant={"enabled": False}, faults=faults)


@pytest.mark.parametrize("transport", ["ray", "socket"])
def test_transport_job_recovers_a_killed_server(ray_session, tmp_path, transport):
    from jobs.launcher.launch import launch

    r = launch(_config(transport, 20, kill_server_at_step=13), run_dir=tmp_path / "run", quiet=True)
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
    if transport == "socket":  # the restarted actor listens on a new socket, whose address rank 0 took again
        assert first["address"] != after["address"]
    # both phases trained the same batches in step order on the servers: same model
    assert r["parity"]["ok"], r["parity"]
    # the last worker group trained steps 11..20 of each phase, from the step-10 checkpoint
    assert r["phases"]["baseline"]["steps"] == r["phases"]["optimized"]["steps"] == 10


def test_socket_transport_job_trains_bit_identically_to_torch_rpc(ray_session, tmp_path):
    from jobs.launcher.launch import launch

    runs = {t: launch(_config(t, 8), run_dir=tmp_path / t, quiet=True) for t in ("torch_rpc", "socket")}
    for transport, r in runs.items():
        assert r["status"] == "completed" and r["config"]["cluster"]["transport"] == transport
    (joined,) = runs["socket"]["server_joins"][0]
    assert ":" in joined["address"]  # the actor's socket, not Ray, carried the requests
    for phase in ("baseline", "optimized"):
        losses = [runs[t]["phases"][phase]["loss_series"] for t in ("torch_rpc", "socket")]
        assert len(losses[0]) == 8 and losses[0] == losses[1]
