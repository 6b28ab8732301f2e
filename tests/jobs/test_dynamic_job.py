"""Dynamic (collisionless) tables in the job (``[model] table_sizes = "dynamic"``): the config checks, the reader's
raw ids (no modulo, fixed tables unchanged), the server-state checkpoints and statistics, the results line, and a
short job on Ray whose 26 tables fill up and evict, restarted once from a checkpoint after its server is killed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jobs import table_sizes
from jobs.config import ConfigError, load_config, parse_config
from jobs.launcher.report import dynamic_line, table
from jobs.trainer.checkpoints import digest
from jobs.trainer.servers import dynamic_stats
from recsys.criteo_format import RAW_IDS, hash_ids, mix64, parse_line, raw_id, table_size_list
from recsys.criteo_synth import write_synthetic_criteo

pytestmark = pytest.mark.timeout(600)

DYNAMIC = {"table_sizes": "dynamic", "dynamic_capacity": 3000}


# ---- config -----------------------------------------------------------------------------------------------------
def test_dynamic_config_resolves_to_capacity_rows_and_the_pass_argument():
    config = parse_config({"model": {**DYNAMIC, "dynamic_min_count": 2, "dynamic_expire_steps": 50}})
    assert table_sizes.sizes(config) == [3000] * 26
    assert table_sizes.reader_sizes(config) == [RAW_IDS] * 26
    spec = table_sizes.dynamic(config, ["t_C1", "t_C2"])
    assert spec == {"t_C1": {"capacity": 3000, "min_count": 2, "expire_steps": 50},
                    "t_C2": {"capacity": 3000, "min_count": 2, "expire_steps": 50}}
    assert table_sizes.dynamic(parse_config({"model": DYNAMIC}), ["t_C1"])["t_C1"]["expire_steps"] is None  # 0: never
    fixed = parse_config({"model": {"table_size": 500}})
    assert table_sizes.dynamic(fixed, ["t_C1"]) is None and table_sizes.reader_sizes(fixed) == [500] * 26


@pytest.mark.parametrize("raw, match", [
    ({"model": DYNAMIC, "cluster": {"parameter_servers": 0}}, r"needs \[cluster\] parameter_servers >= 1"),
    ({"model": {**DYNAMIC, "dynamic_capacity": 0}}, r"\[model\] dynamic_capacity = 0: must be an integer in 1\.\."),
    ({"model": {**DYNAMIC, "dynamic_min_count": 0}}, r"\[model\] dynamic_min_count = 0"),
    ({"model": {**DYNAMIC, "dynamic_expire_steps": -1}}, r"\[model\] dynamic_expire_steps = -1"),
    ({"model": {**DYNAMIC, "plan": {"t_C3": "row_wise"}}}, r't_C3 = "row_wise": dynamic tables .* table-wise'),
    ({"model": {"table_sizes": "dynamc"}}, r'table_sizes = .dynamc.: must be "uniform", "data", "dynamic"'),
])
def test_bad_dynamic_configs_name_the_key_and_the_file(raw, match):
    with pytest.raises(ConfigError, match=match) as info:
        parse_config(raw, source="my.toml")
    assert str(info.value).startswith("my.toml: ")


def test_dynamic_errors_only_for_dynamic_tables():
    from jobs.config_rules import dynamic_errors

    fixed, dynamic = parse_config({}).model, parse_config({"model": DYNAMIC}).model
    no_servers = parse_config({"cluster": {"parameter_servers": 0}}).cluster
    assert dynamic_errors(fixed, no_servers, user_model=True) == []
    assert len(dynamic_errors(dynamic, no_servers, user_model=True)) == 2


def test_movielens_job_refuses_dynamic_tables_with_a_clear_error():
    with pytest.raises(ConfigError, match=r'is for the built-in DLRM, not \[model\] factory = .jobs.movielens:model.'):
        load_config("jobs/movielens.toml").replace(model={"table_sizes": "dynamic"})


def test_default_toml_spells_out_the_dynamic_keys():
    import tomllib

    from jobs.config import DEFAULT_CONFIG

    raw = tomllib.loads(DEFAULT_CONFIG.read_text())["model"]
    assert (raw["dynamic_capacity"], raw["dynamic_min_count"], raw["dynamic_expire_steps"]) == (20000, 1, 0)
    assert load_config().replace(model={"table_sizes": "dynamic"}).model.table_sizes == "dynamic"


# ---- reader -----------------------------------------------------------------------------------------------------
def test_raw_ids_are_the_unreduced_mix_and_fixed_tables_are_unchanged():
    rng = np.random.default_rng(0)
    values = rng.integers(0, 2**40, size=(64, 26), dtype=np.uint64)
    present = rng.random((64, 26)) > 0.1
    sizes = [RAW_IDS] * 13 + [1000] * 13
    ids = hash_ids(values, present, sizes)
    for i in range(64):
        for j in range(26):
            v = int(values[i, j])
            want = 0 if not present[i, j] else (raw_id(v, j) if j < 13 else 1 + mix64(v, j) % 999)
            assert ids[i, j] == want
    raw = ids[:, :13][present[:, :13]]
    assert raw.min() >= 0 and raw.max() > 2**40  # no modulo: 63-bit ids, kept non-negative
    assert raw_id(5, 0) == mix64(5, 0) & (2**63 - 1)
    # the fixed tables' ids do not depend on the other tables being dynamic
    assert np.array_equal(ids[:, 13:], hash_ids(values, present, [1000] * 26)[:, 13:])
    with pytest.raises(ValueError, match="or 0: raw ids"):
        table_size_list([1] * 26)


def test_job_reader_gives_raw_ids_for_dynamic_tables(tmp_path):
    from jobs.trainer.workload import criteo_shard

    path = write_synthetic_criteo(tmp_path / "d.txt", 200, seed=1)
    fixed = criteo_shard(parse_config({"model": {"table_size": 700}}), path, eval_fraction=0.0)
    dynamic = criteo_shard(parse_config({"model": DYNAMIC}), path, eval_fraction=0.0)
    lines = path.read_text().splitlines()
    for row, line in enumerate(lines[:50]):
        assert fixed.sparse[row].tolist() == parse_line(line, 700)[1]
        assert dynamic.sparse[row].tolist() == parse_line(line, [RAW_IDS] * 26)[1]
    assert int(dynamic.sparse.max()) >= 700 and torch.equal(fixed.dense, dynamic.dense)
    assert torch.equal(fixed.labels, dynamic.labels)


# ---- server state, statistics, results line ---------------------------------------------------------------------
def _table_stats(names_rows):
    """What ``PSClient.dynamic_stats()`` answers (``DynamicTable.stats()`` per table) for a dynamic table of capacity 3
    per (name, lookups of a new id each)."""
    from scheduling.ps.dynamic import DynamicSpec, DynamicTable
    from scheduling.ps.optimizer import make_optimizer

    out = {}
    for name, rows in names_rows:
        t = DynamicTable(4, DynamicSpec(capacity=3), make_optimizer("sgd", lr=0.1))
        for step in range(rows):
            t.lookup(torch.tensor([step], dtype=torch.int64))
        out[name] = t.stats()
    return out


def _server_state(names_rows):
    """A PSClient.server_states()-like list for one server: a dynamic table per (name, rows) and a fixed one."""
    from scheduling.ps.dynamic import DynamicSpec, DynamicTable
    from scheduling.ps.optimizer import make_optimizer
    from scheduling.ps.shard_plan import TableSpec, plan_shards

    shards = {}
    for name, rows in names_rows:
        t = DynamicTable(4, DynamicSpec(capacity=3), make_optimizer("sgd", lr=0.1))
        for step in range(rows):
            t.lookup(torch.tensor([step], dtype=torch.int64))
        spec = plan_shards([TableSpec(name, 3, 4, (name[2:],), dynamic=DynamicSpec(3))], 1)[0]
        shards[f"ns/{spec.key}"] = {"spec": spec, "dynamic": t.state_dict()}
    fixed = plan_shards([TableSpec("pos", 8, 4, ("p",))], 1)[0]
    shards["ns/pos"] = {"spec": fixed, "weight": torch.zeros(8, 4), "state": None, "dynamic": None}
    return [shards]


def test_dynamic_stats_per_table_in_natural_order():
    stats = dynamic_stats({"c": _table_stats([("t_C10", 5)]), "d": _table_stats([("t_C2", 2)])})
    assert list(stats) == ["t_C2", "t_C10"]  # natural order, over the clients
    assert stats["t_C10"] == {"rows": 3, "capacity": 3, "inserts": 5, "evictions": 2, "admitted": 5, "rejected": 0,
                              "expired": 0}
    assert stats["t_C2"]["rows"] == 2 and stats["t_C2"]["evictions"] == 0


def test_checkpoint_digest_covers_the_dynamic_id_maps():
    a = {"dynamic_tables": {"c": _server_state([("t_C1", 5)])}}
    b = {"dynamic_tables": {"c": _server_state([("t_C1", 4)])}}
    assert digest(a) == digest({"dynamic_tables": {"c": _server_state([("t_C1", 5)])}})
    assert digest(a) != digest(b) != digest({})


def test_results_line():
    tables = {f"t_C{j}": {"rows": 2871 + j, "capacity": 3000, "inserts": 9, "evictions": 1000, "admitted": 9,
                          "rejected": 0, "expired": 0} for j in range(1, 27)}
    assert dynamic_line(tables) == "dynamic tables: 26, rows 2,872-2,897 of capacity 3,000; 26,000 evictions"
    results = {"job": "j", "config": {}, "phases": {"optimized": {"qps": 1.0, "dynamic_tables": tables}}}
    assert "dynamic tables: 26, rows 2,872-2,897" in table(results)
    assert "dynamic tables" not in table({"job": "j", "config": {}, "phases": {"optimized": {"qps": 1.0}}})


# ---- a short job on Ray -----------------------------------------------------------------------------------------
def test_short_dynamic_job_fills_and_evicts_and_restores_after_a_server_fault(ray_session, tmp_path):
    """Two trainers, 12 steps of 64 rows over small synthetic data, 26 dynamic tables of 50 rows: the tables
    fill and evict. The server is killed at step 8; the worker group restarts from the step-5 checkpoint, whose
    dynamic tables (id maps included) come back exactly. The servers step the dynamic tables with the trainers'
    lookups in rank order (``scheduling.ps.ordering``, rule 3), so the two phases train bit for bit alike (the
    parity check's default ``error`` mode, identical per-step losses, the same tables' counters)."""
    from jobs.launcher.launch import launch

    data = write_synthetic_criteo(tmp_path / "data.txt", 3000, seed=0)
    config = load_config().replace(
        job={"steps": 12, "batch_size": 64, "checkpoint_every": 5, "progress": False, "name": "dyn-test",
             "eval_epochs": 0, "max_failures": 2},
        data={"path": str(data)},
        model={"table_sizes": "dynamic", "dynamic_capacity": 50, "bottom_mlp": [8], "top_mlp": [8]},
        cluster={"cpus_per_trainer": 0.5, "rpc_timeout_s": 20.0}, metrics={"enabled": False},
        quant={"enabled": True, "calibration_batches": 1}, faults={"kill_server_at_step": 8})
    r = launch(config, run_dir=tmp_path / "run", quiet=True)
    assert r["restarts"] == 1 and r["faults_fired"] == ["server"]
    assert r["parity"]["ok"] and r["parity"]["identical_losses"] and r["parity"]["max_step_loss_diff"] == 0
    assert r["phases"]["baseline"]["dynamic_tables"] == r["phases"]["optimized"]["dynamic_tables"]
    for phase in ("baseline", "optimized"):
        p = r["phases"][phase]
        tables = p["dynamic_tables"]
        assert list(tables) == [f"t_C{j}" for j in range(1, 27)]
        assert all(0 < t["rows"] <= t["capacity"] == 50 for t in tables.values())
        assert all(t["admitted"] == t["rows"] + t["evictions"] + t["expired"] for t in tables.values())
        assert sum(t["evictions"] for t in tables.values()) > 0
        assert p["resumed_from_step"] == 5 and 0 < p["quality"]["auc"] <= 1
    # the restored tables are those checkpointed at step 5 (digests of the servers' state, id maps included)
    saved = {(c["phase"], c["step"]): c["tables"] for c in r["checkpoints"]}
    assert r["restores"] and all(x["tables"] == saved[(x["phase"], x["step"])] for x in r["restores"])
    assert digest({}) not in saved.values()  # the servers' state is in the checkpoints
    assert r["inference"]["skipped"].startswith("dynamic tables")
    assert "dynamic tables: 26, rows " in table(r)


def test_evaluation_leaves_the_dynamic_tables_as_training_alone(ray_session, tmp_path):
    """One trainer, 8 steps: the held-out evaluation after step 3 (``eval_epochs``) or only after the last step gives
    the same dynamic tables' counters in both phases (the optimized one prefetches). Evaluation's lookups are
    read-only (``scheduling.placement.read_only``) and keep training's prefetch; as training lookups they admitted
    held-out ids and evicted training rows, and the step-3 prefetch was sent again."""
    from jobs.launcher.launch import launch

    data = write_synthetic_criteo(tmp_path / "data.txt", 2000, seed=0)

    def run(eval_epochs: float, name: str):
        config = load_config().replace(
            job={"steps": 8, "batch_size": 64, "checkpoint_every": 0, "progress": False, "name": name,
                 "eval_epochs": eval_epochs},
            data={"path": str(data)},
            model={"table_sizes": "dynamic", "dynamic_capacity": 50, "bottom_mlp": [8], "top_mlp": [8]},
            cluster={"trainers": 1, "cpus_per_trainer": 0.5, "rpc_timeout_s": 20.0}, metrics={"enabled": False},
            quant={"enabled": False})
        return launch(config, run_dir=tmp_path / name, quiet=True)

    early, late = run(0.1, "dyn-eval-early"), run(0.0, "dyn-eval-late")
    for phase in ("baseline", "optimized"):
        a, b = early["phases"][phase], late["phases"][phase]
        assert a["quality_step"] == 3 and b["quality_step"] == 8 and 0 < a["quality"]["auc"] <= 1
        assert sum(t["evictions"] for t in a["dynamic_tables"].values()) > 0
        assert a["dynamic_tables"] == b["dynamic_tables"], phase
