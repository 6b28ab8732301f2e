"""The typed seams of a job: every implementation has every protocol member (the trainer never probes), and the
launcher's plan reaches the trainers as a frozen, picklable spec whose config is not re-parsed."""

from __future__ import annotations

import dataclasses

import cloudpickle
import pytest

from jobs import table_sizes
from jobs.config import JobConfig
from jobs.launcher.plan import make_plan, memory_estimate, with_data
from jobs.trainer.protocols import TableBackend, Tables, Workload
from jobs.trainer.spec import JobPlan, TrainerSpec
from jobs.trainer.workload import CriteoWorkload, LocalTables, UserWorkload
from recsys.criteo_synth import write_synthetic_criteo


def _members(protocol: type) -> set[str]:
    names = {n for n in vars(protocol) if not n.startswith("_")} | set(protocol.__annotations__)
    return names - {"__annotations__"}


@pytest.mark.parametrize("cls, protocol", [(LocalTables, Tables), (LocalTables, TableBackend),
                                           (UserWorkload, Workload), (CriteoWorkload, Workload)])
def test_every_implementation_has_every_member_of_its_protocol(cls, protocol):
    missing = sorted(n for n in _members(protocol) if not hasattr(cls, n))
    assert not missing, f"{cls.__name__} lacks {missing} of {protocol.__name__}"


def test_the_server_backend_and_its_views_have_every_member():
    from jobs.trainer.servers import ServerTables, _PhaseTables

    # ``moved`` and ``servers`` are set per instance (the tables the pass moved, the worker group's servers)
    assert sorted(n for n in _members(Tables) if not hasattr(_PhaseTables, n)) == ["moved"]
    assert sorted(n for n in _members(TableBackend) if not hasattr(ServerTables, n)) == ["servers"]


def test_local_tables_answer_what_the_trainer_asks():
    tables = LocalTables()
    assert tables.placement_pass() is None and tables.local and tables.servers is None  # no server to kill
    assert tables.attach(object()) is None and tables.view("optimized") is tables
    assert "kill_server" not in _members(Tables)  # faults go through the server group's lifecycle


def test_the_plan_resolves_table_sizes_and_the_spec_pickles_without_reparsing(tmp_path):
    data = write_synthetic_criteo(tmp_path / "c.tsv", 400, seed=1)
    config = JobConfig().replace(data={"path": str(data)}, model={"table_sizes": "data", "max_table_size": 50},
                                 job={"run_dir": str(tmp_path / "runs")}, metrics={"enabled": False})
    plan = make_plan(config, tmp_path / "run", local=False)
    assert plan.data_path == data and plan.run_dir == (tmp_path / "run").resolve() and not plan.run_dir.exists()
    assert isinstance(plan.config.model.table_sizes, list) and plan.tables["sizes"] == table_sizes.sizes(plan.config)
    assert plan.data_plan.rows and memory_estimate(plan).total_bytes > 0 and plan.data_note == f"Criteo data from {data}"
    assert with_data(plan) is plan  # the data was found: nothing to generate
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.config = config  # type: ignore[misc]
    spec = TrainerSpec(plan, state=None, servers=(), metrics_port=9400, rpc_host="127.0.0.1")
    back = cloudpickle.loads(cloudpickle.dumps({"spec": spec}))["spec"]
    assert back.config == plan.config and back.config.source == config.source and back.plan.data_path == data
    assert isinstance(back.plan, JobPlan) and back.metrics_port == 9400


def test_synthetic_data_is_planned_once_generated_into_the_run_folder(tmp_path, monkeypatch):
    for where in ("jobs.launcher.data.locate_data", "jobs.launcher.checks.locate_data"):  # no Criteo file anywhere
        monkeypatch.setattr(where, lambda path, table_size=0, follow=False: None)
    config = JobConfig().replace(data={"synthetic_rows": 300}, metrics={"enabled": False})
    plan = make_plan(config, tmp_path / "run", local=False)
    assert plan.needs_data and plan.data_plan is None
    plan.run_dir.mkdir()
    done = with_data(plan)
    assert not done.needs_data and done.data_path.parent == plan.run_dir and done.data_plan.lines == 300
