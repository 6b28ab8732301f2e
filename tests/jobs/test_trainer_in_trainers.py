"""Parameter servers inside the trainers' processes in a job (``[cluster] servers_in_trainers = true``):
the same checkpoints as separate server actors, also across a killed trainer (its server dies with it and the
tables come back from the last checkpoint), then a resume onto two servers (resharding); the same over the
``socket`` transport (``[cluster] transport = "socket"``: each trainer's server on a socket of its own); and the
lifecycles' refusals."""

from __future__ import annotations

import json

import pytest

from jobs.launcher.cli import main
from jobs.trainer.in_trainers import InTrainerServers, InTrainerSocketServers, in_trainer_names
from jobs.trainer.metrics import Exporter
from scheduling.ps import PSServer
from tests.jobs.conftest import ONE_SERVER_RUN

SMALL = ONE_SERVER_RUN  # tests/jobs/conftest.py: the separate servers' run is the shared one_server_run


def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def _launch(run_dir, *items: str) -> dict:
    assert main(["launch", "--quiet", "--run-dir", str(run_dir), *_sets([*SMALL, *items])]) == 0
    return json.loads((run_dir / "results.json").read_text())


def _saved(results: dict) -> dict:
    return {(c["phase"], c["step"]): (c["tables"], c["model"]) for c in results["checkpoints"]}


def test_the_lifecycle_refuses_actors_and_kills():
    group = InTrainerServers(in_trainer_names(2), 5.0)
    assert group.names == ["trainer0", "trainer1"]
    with pytest.raises(ValueError, match="1 server actors given; servers in the trainers have none"):
        group.join([object()], 0, 2, ("127.0.0.1", 1))
    with pytest.raises(RuntimeError, match=r"server ps1 runs inside trainer 1's process: kill the trainer instead"):
        group.kill(1)


def test_the_socket_lifecycle_serves_ps_rank_on_a_socket_and_drops_it_on_leave():
    from scheduling.ps.in_trainers import hosted_worker
    from scheduling.ps.transport import socket_transport

    group = InTrainerSocketServers(["ps0"], 5.0)
    with pytest.raises(ValueError, match="1 server actors given; servers in the trainers have none"):
        group.join([object()], 0, 1, "127.0.0.1")
    with pytest.raises(RuntimeError, match="2 trainers without a torch.distributed group"):
        group.join([], 0, 2, "127.0.0.1")
    with pytest.raises(RuntimeError, match=r"server ps0 runs inside trainer 0's process: kill the trainer instead"):
        group.kill(0)
    assert group.join([], 0, 1, "127.0.0.1") == []
    try:
        address = socket_transport._ADDRESSES["ps0"]
        assert hosted_worker() == "ps0" and address.startswith("127.0.0.1:") and group.server.name == "ps0"
    finally:
        group.leave([], 0, graceful=True)
    assert hosted_worker() is None and "ps0" not in socket_transport._ADDRESSES and group.server is None


def test_a_trainer_exports_the_server_it_hosts_as_ps_i():
    e = Exporter("j", 0)
    e.watch_server(PSServer("ps0"), rank="ps0")
    assert e.registry.get_sample_value("fxdist_ps_pending_requests", {"job": "j", "rank": "ps0"}) == 0
    assert e.registry.get_sample_value("fxdist_ps_pending_requests", {"job": "j", "rank": "0"}) is None


@pytest.fixture(scope="module")
def runs(ray_session, one_server_run, tmp_path_factory):
    """The same small job with separate server actors (``one_server_run``, tests/jobs/conftest.py, shared with
    test_reshard_job.py; over sockets, the default transport) and with the servers in the trainers (over torch_rpc and
    over sockets), trainer 0 killed at step 6; one Ray session."""
    base = tmp_path_factory.mktemp("in_trainers")
    return {"base": base, "separate": one_server_run["results"],
            "in": _launch(base / "in", "cluster.servers_in_trainers=true", "cluster.transport=torch_rpc",
                          "faults.kill_trainer_at_step=6"),
            "in_socket": _launch(base / "in_socket", "cluster.servers_in_trainers=true", "cluster.transport=socket",
                                 "faults.kill_trainer_at_step=6")}


@pytest.mark.timeout(900)
def test_servers_in_the_trainers_train_exactly_like_separate_ones_across_a_killed_trainer(runs):
    sep, inside = runs["separate"], runs["in"]
    assert inside["status"] == sep["status"] == "completed" and sep["parity"]["ok"]  # sep: parity "warn"
    assert inside["servers_in_trainers"]["chosen"] and not sep["servers_in_trainers"]["chosen"]
    assert "ps0" not in inside["processes"] and inside["placement"]["ps0"]["in"] == "trainer0"
    assert {s for layout in inside["table_layout"].values() for t in layout.values() for s in t["servers"]} == {
        "trainer0"}
    # the killed trainer took server 0 (trainer 0's) down with the group: rank 0 restored the step-4 tables
    assert inside["faults_fired"] == ["trainer"] and inside["restarts"] == 1
    saved = _saved(inside)
    assert [(r["phase"], r["step"]) for r in inside["restores"]] == [("baseline", 4), ("optimized", 4)]
    for r in inside["restores"]:
        assert (r["tables"], r["model"]) == saved[(r["phase"], r["step"])]
    # every checkpoint (tables and dense weights) is the separate socket servers' one, bit for bit (across transports)
    assert saved == _saved(sep)
    assert inside["parity"]["ok"] and inside["parity"]["identical_losses"]


@pytest.mark.timeout(900)
def test_a_run_with_servers_in_the_trainers_resumes_onto_two_of_them(runs, capsys):
    run_dir = runs["base"] / "in"
    rc = main(["launch", "--resume", str(run_dir), *_sets(["cluster.parameter_servers=2", "job.steps=12",
                                                           "job.progress=false"])])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "resharding the tables from 1 to 2 parameter servers" in out
    assert "servers_in_trainers = true: the servers run in the trainers" in out
    done = json.loads((run_dir / "results.json").read_text())
    assert done["status"] == "completed" and done["config"]["cluster"]["parameter_servers"] == 2
    assert "trainer0 -> trainer1" in out  # the plan names the new servers as the pass does
    reshard = done["reshards"][-1]
    for phase, layout in done["table_layout"].items():
        actual = {path: t["servers"] for path, t in layout.items()}
        assert actual == {path: t["after"] for path, t in reshard["tables"][phase].items()}
        assert {s for servers in actual.values() for s in servers} == {"trainer0", "trainer1"}
    saved = _saved(done)
    assert [(r["phase"], r["step"]) for r in done["restores"]][-2:] == [("baseline", 8), ("optimized", 8)]
    for r in done["restores"][-2:]:  # the step-8 tables, now on two in-trainer servers, read back whole
        assert (r["tables"], r["model"]) == saved[(r["phase"], r["step"])]
    assert ("optimized", 12) in saved and done["parity"]["ok"]


@pytest.mark.timeout(900)
def test_servers_in_the_trainers_over_sockets_train_exactly_like_separate_ones_across_a_killed_trainer(runs):
    sep, inside = runs["separate"], runs["in_socket"]
    assert inside["status"] == "completed" and inside["config"]["cluster"]["transport"] == "socket"
    assert inside["servers_in_trainers"]["chosen"] and "ps0" not in inside["processes"]
    assert inside["placement"]["ps0"]["in"] == "trainer0"
    assert {s for layout in inside["table_layout"].values() for t in layout.values() for s in t["servers"]} == {"ps0"}
    assert inside["faults_fired"] == ["trainer"] and inside["restarts"] == 1
    saved = _saved(inside)
    assert [(r["phase"], r["step"]) for r in inside["restores"]] == [("baseline", 4), ("optimized", 4)]
    for r in inside["restores"]:   # the new group's new server (a new socket) got the step-4 tables back
        assert (r["tables"], r["model"]) == saved[(r["phase"], r["step"])]
    assert saved == _saved(sep)    # every checkpoint is the separate socket servers' one, bit for bit
    assert inside["parity"]["ok"] and inside["parity"]["identical_losses"]
