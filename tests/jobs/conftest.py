"""Fixtures of the job tests."""

from __future__ import annotations

import pytest


def _start_ray():
    """The ``ray`` module with a local session running (2 CPUs, no dashboard); skips without Ray."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    return ray


def _all_cpus_free(ray, timeout_s: float) -> bool:
    """Whether every CPU of the session is free again (the module's jobs left no actor or placement group
    holding one) within ``timeout_s``: Ray releases an ended job's resources asynchronously."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ray.available_resources().get("CPU", 0.0) >= ray.cluster_resources().get("CPU", 0.0):
                return True
        except Exception:  # a session that broke down cannot be reused
            return False
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


@pytest.fixture(scope="package")
def _ray_package():
    """Shuts down, after the last test of tests/jobs, the Ray session its modules shared."""
    yield
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_session(_ray_package):
    """A local Ray session (2 CPUs, no dashboard) for the Ray jobs of one test module.

    One session serves every module of tests/jobs in turn (a start and a shutdown cost about 4 s on an idle
    2-core machine, more on a loaded one): a module gets the running one when the modules before it left every
    CPU free, else a fresh one, so no module waits for resources another one leaked. Started on first use; shut
    down after the package's last test (:func:`_ray_package`)."""
    ray = _start_ray()
    yield ray
    if not _all_cpus_free(ray, timeout_s=10.0):
        ray.shutdown()


ONE_SERVER_RUN = ["job.steps=8", "job.batch_size=32", "job.checkpoint_every=4", "job.progress=false",
                  "job.eval_epochs=0", "model.table_size=500", "model.bottom_mlp=[16]", "model.top_mlp=[16]",
                  "cluster.cpus_per_trainer=0.5", "cluster.rpc_timeout_s=20.0", "cluster.parameter_servers=1",
                  "quant.enabled=false", "metrics.enabled=false", "data.synthetic_rows=4000", "export.every_steps=2"]
"""The small job of :func:`one_server_run` (2 trainers, 8 steps, checkpoints every 4, a delta of the model every 2:
test_deltas.py), also the base of test_trainer_in_trainers.py's run with the servers in the trainers."""


@pytest.fixture(scope="package")
def one_server_run(_ray_package, tmp_path_factory):
    """One completed run of :data:`ONE_SERVER_RUN` on one server actor of its own (``servers_in_trainers =
    false``), shared by test_reshard_job.py (which resumes it onto two servers) and test_trainer_in_trainers.py
    (whose in-trainer servers must save the same checkpoints). ``results``: its results.json as it was when the
    run completed (the resume later rewrites the file)."""
    import json

    _start_ray()  # the package's session (ray_session), also when no module fixture has started it yet
    from jobs.launcher.cli import main

    run_dir = tmp_path_factory.mktemp("one_server") / "run"
    items = [*ONE_SERVER_RUN, 'phases.parity="warn"', "cluster.servers_in_trainers=false"]
    assert main(["launch", "--quiet", "--run-dir", str(run_dir), *[a for i in items for a in ("--set", i)]]) == 0
    return {"run_dir": run_dir, "results": json.loads((run_dir / "results.json").read_text())}
