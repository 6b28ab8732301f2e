"""A short job with ``[cluster] transport = "ray"``: the trainers call the parameter-server actor directly
(no torch.distributed.rpc group), the server is killed mid-phase, Ray restarts its actor, and the restarted
worker group loads the checkpoint's tables into it (the same recovery as ``torch_rpc``)."""

from __future__ import annotations

import pytest

from jobs.config import load_config

pytestmark = pytest.mark.timeout(420)


def test_ray_transport_job_recovers_a_killed_server(ray_session, tmp_path):
    from jobs.launcher.launch import launch

    config = load_config().replace(
        job={"steps": 20, "batch_size": 32, "checkpoint_every": 10, "max_failures": 2, "progress": False,
             "name": "fxdist-raytransport", "eval_epochs": 0},
        model={"table_size": 200, "bottom_mlp": [8], "top_mlp": [8]}, phases={"block_steps": 5},
        cluster={"trainers": 2, "parameter_servers": 1, "cpus_per_trainer": 0.5, "rpc_timeout_s": 20.0,
                 "transport": "ray"},
        metrics={"enabled": False}, quant={"enabled": False}, faults={"kill_server_at_step": 13})
    r = launch(config, run_dir=tmp_path / "run", quiet=True)
    assert r["status"] == "completed" and r["config"]["cluster"]["transport"] == "ray"
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
    # both phases trained the same batches in step order on the servers: same model
    assert r["parity"]["ok"], r["parity"]
    # the last worker group trained steps 11..20 of each phase, from the step-10 checkpoint
    assert r["phases"]["baseline"]["steps"] == r["phases"]["optimized"]["steps"] == 10
