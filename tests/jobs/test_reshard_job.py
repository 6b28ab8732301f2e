"""``fxdist launch --resume RUN --set cluster.parameter_servers=M --set job.steps=N``: a completed run on
one server continues on two, its tables resharded exactly; and the refusals that need no Ray."""

from __future__ import annotations

import json

import pytest

from jobs.config import ConfigError, JobConfig
from jobs.launcher import runs
from jobs.launcher.cli import main
from jobs.launcher.plan import format_reshard, reshard_plan


def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def _completed(run_dir, steps: int = 8, servers: int = 1) -> None:
    run_dir.mkdir(parents=True)
    config = JobConfig().replace(job={"steps": steps}, cluster={"parameter_servers": servers})
    from jobs.config import to_dict

    (run_dir / "results.json").write_text(json.dumps({"status": "completed", "job": "x", "config": to_dict(config),
                                                      "phases": {}}))


def test_resume_rules_for_servers_and_steps(tmp_path):
    run_dir = tmp_path / "run"
    _completed(run_dir)
    saved = runs.load_config(run_dir)  # a completed run's config loads: --set may continue it
    with pytest.raises(ConfigError, match=r"the run completed; there is nothing to resume .*job.steps=N, N > 8"):
        runs.choose(saved.replace(cluster={"parameter_servers": 2}), run_dir, resume=True)
    assert runs.choose(saved.replace(job={"steps": 12}), run_dir, resume=True) == run_dir.resolve()
    with pytest.raises(ConfigError, match=r"\[job\] steps can only grow \(the run used 8, --set gives 4\)"):
        runs.check_resume_changes(saved, saved.replace(job={"steps": 4}))
    with pytest.raises(ConfigError, match="parameter_servers can change only between positive counts"):
        runs.check_resume_changes(saved, saved.replace(cluster={"parameter_servers": 0}))
    runs.check_resume_changes(saved, saved.replace(cluster={"parameter_servers": 3}, job={"steps": 20}))


def test_reshard_plan_uses_the_placement_rule_on_the_new_servers():
    layout = {"baseline": {f"t{i}": {"servers": ["ps0"], "table": f"t{i}", "module": "ebc", "rows": 100 * (i + 1),
                                     "dim": 4, "dynamic": i == 0} for i in range(3)}}
    previous = {"config": {"cluster": {"parameter_servers": 1}}, "table_layout": layout}
    assert reshard_plan(previous, JobConfig().replace(cluster={"parameter_servers": 1})) is None
    plan = reshard_plan(previous, JobConfig().replace(cluster={"parameter_servers": 2}))
    assert plan is not None and (plan["from_servers"], plan["to_servers"]) == (1, 2)
    # largest first to the emptiest server: t2 (1200 rows x 4) -> ps0, t1 -> ps1, t0 -> ps1
    assert {p: t["after"] for p, t in plan["tables"]["baseline"].items()} == {"t0": ["ps1"], "t1": ["ps1"],
                                                                              "t2": ["ps0"]}
    text = format_reshard(plan)
    assert "from 1 to 2 parameter servers" in text and "t0  ps0 -> ps1" in text and "t2  ps0 -> ps0  (stays)" in text


@pytest.mark.timeout(600)
def test_a_completed_run_continues_on_two_servers(ray_session, one_server_run, capsys):
    """Resumes the 8-step run of ``one_server_run`` (tests/jobs/conftest.py: one server actor, checkpoints every
    4 steps, parity "warn"), shared with test_trainer_in_trainers.py, which reads only its results as completed."""
    run_dir, first = one_server_run["run_dir"], one_server_run["results"]
    assert first["status"] == "completed"
    assert {s for layout in first["table_layout"].values() for t in layout.values() for s in t["servers"]} == {"ps0"}
    final = {c["phase"]: c["tables"] for c in first["checkpoints"] if c["step"] == 8}
    # its checkpoints hold the tables by shard, in the run folder: what the resume below loads on 2 servers
    from jobs.launcher.model_export import latest_checkpoint
    from scheduling.ps.safe_load import safe_load

    by_shard = safe_load(latest_checkpoint(run_dir))["tables"]
    assert all(set(t) == {"dcp"} and (run_dir / t["dcp"] / ".metadata").is_file() for t in by_shard.values())
    committed = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (run_dir / "model" / "deltas").glob("*/delta.pt")}

    rc = main(["launch", "--resume", str(run_dir), *_sets(["cluster.parameter_servers=2", "job.steps=12",
                                                           "job.progress=false"])])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "resharding the tables from 1 to 2 parameter servers" in out and "ps0 -> ps1" in out
    done = json.loads((run_dir / "results.json").read_text())
    assert done["status"] == "completed" and done["resumes"] == 1
    assert done["config"]["cluster"]["parameter_servers"] == 2 and done["config"]["job"]["steps"] == 12
    reshard = done["reshards"][-1]
    assert (reshard["from_servers"], reshard["to_servers"]) == (1, 2)
    for phase, layout in done["table_layout"].items():
        actual = {path: t["servers"] for path, t in layout.items()}
        assert actual == {path: t["after"] for path, t in reshard["tables"][phase].items()}  # the plan printed
        assert {s for servers in actual.values() for s in servers} == {"ps0", "ps1"}
    for phase in final:
        # the 2 servers were loaded with exactly the tables the 1 server saved at step 8, then trained 4 steps more
        assert {"phase": phase, "step": 8, "tables": final[phase]}.items() <= next(
            r for r in done["restores"] if r["phase"] == phase and r["step"] == 8).items()
        assert done["phases"][phase]["resumed_from_step"] == 8 and done["phases"][phase]["steps"] == 4
    assert json.loads((run_dir / "results.0.json").read_text())["status"] == "completed"
    # the model's deltas ([export] every_steps = 2): those committed before are kept as they were (same files), the
    # resumed run adds steps 10 and 12 (the rows changed on the 2 servers), and the chain still rebuilds the model
    from jobs.deltas import committed_steps, load_delta
    from tests.jobs.test_deltas import _equal, _replay

    assert committed_steps(run_dir / "model") == [0, 2, 4, 6, 8, 10, 12] and not load_delta(run_dir / "model", 10).full
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in committed} == committed
    import torch

    _equal(_replay(run_dir, 12), torch.load(run_dir / "model" / "state_dict.pt", weights_only=True))
