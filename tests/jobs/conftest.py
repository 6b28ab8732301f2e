"""Fixtures of the job tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray session (2 CPUs, no dashboard) shared by the Ray jobs of one test module."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


ONE_SERVER_RUN = ["job.steps=8", "job.batch_size=32", "job.checkpoint_every=4", "job.progress=false",
                  "job.eval_epochs=0", "model.table_size=500", "model.bottom_mlp=[16]", "model.top_mlp=[16]",
                  "cluster.cpus_per_trainer=0.5", "cluster.rpc_timeout_s=20.0", "cluster.parameter_servers=1",
                  "quant.enabled=false", "metrics.enabled=false", "data.synthetic_rows=4000"]
"""The small job of :func:`one_server_run` (2 trainers, 8 steps, checkpoints every 4), also the base of
test_trainer_in_trainers.py's run with the servers in the trainers."""


@pytest.fixture(scope="session")
def one_server_run(tmp_path_factory):
    """One completed run of :data:`ONE_SERVER_RUN` on one server actor of its own (``servers_in_trainers =
    false``), shared by test_reshard_job.py (which resumes it onto two servers) and test_trainer_in_trainers.py
    (whose in-trainer servers must save the same checkpoints). ``results``: its results.json as it was when the
    run completed (the resume later rewrites the file)."""
    import json

    pytest.importorskip("ray")
    from jobs.launcher.cli import main

    run_dir = tmp_path_factory.mktemp("one_server") / "run"
    items = [*ONE_SERVER_RUN, 'phases.parity="warn"', "cluster.servers_in_trainers=false"]
    assert main(["launch", "--quiet", "--run-dir", str(run_dir), *[a for i in items for a in ("--set", i)]]) == 0
    return {"run_dir": run_dir, "results": json.loads((run_dir / "results.json").read_text())}
