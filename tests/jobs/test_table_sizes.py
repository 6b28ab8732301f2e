"""Per-feature table sizes from the data, recorded; the model and the servers take them; the memory plan
uses them and refuses, before Ray starts, a plan that does not fit this machine."""

from __future__ import annotations

import json

import pytest
import torch

from jobs import criteo, table_sizes
from jobs.config import ConfigError, JobConfig
from jobs.launcher import checks
from jobs.launcher.cli import main
from jobs.launcher.first_pass import first_pass
from jobs.trainer.workload import build_model
from recsys.criteo_shard import scan
from recsys.criteo_synth import CRITEO_KAGGLE_CARDINALITIES, SynthSpec, write_synthetic

GB = 10**9
CRITEO_1TB_CARDINALITIES = (40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
                            2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36)
"""Criteo 1TB's distinct values per feature, capped at 40M (torchrec's DLRM example)."""


@pytest.fixture
def no_ray(monkeypatch):
    import jobs.launcher.launch

    def refuse(*args, **kwargs):
        raise AssertionError("the launcher reached Ray although the memory plan should have refused the job")

    monkeypatch.setattr(jobs.launcher.launch, "_join_ray", refuse)


def _sized(distinct, cap, **model) -> JobConfig:
    return JobConfig().replace(model={"table_sizes": table_sizes.sizes_from_counts(list(distinct), cap), **model})


def test_criteo_kaggle_capped_at_10m_rows_fits_24_gb_with_8bit_rows():
    config = _sized(CRITEO_KAGGLE_CARDINALITIES, 10_000_000, server_storage="fused8bit")
    assert max(table_sizes.sizes(config)) == 10_000_000 and sum(table_sizes.sizes(config)) > 33_000_000
    plan = checks.check_memory(config, available=24 * GB)  # computed, not allocated
    assert plan.total_bytes < 24 * GB and sum(plan.processes.values()) == plan.total_bytes
    rows = sum(table_sizes.sizes(config))
    assert plan.server_bytes == 2 * rows * (16 + 8 + 4)  # two phases: D + 8 bytes a row + fp32 Adagrad state
    fp32 = checks.estimate_memory(config.replace(model={"server_storage": "fp32"}))
    assert fp32.server_bytes == 2 * rows * (4 * 16 + 4) and fp32.total_bytes > plan.total_bytes
    two = checks.estimate_memory(config.replace(cluster={"parameter_servers": 2}))
    assert two.total_bytes == plan.total_bytes + checks.PROCESS_BASE_BYTES  # one more process
    assert two.processes["ps0"] < plan.processes["ps0"]


def test_an_oversized_plan_is_refused_with_the_numbers_and_the_fixes():
    config = _sized(CRITEO_1TB_CARDINALITIES, 40_000_000, server_storage="fp16")
    with pytest.raises(ConfigError) as info:
        checks.check_memory(config, available=24 * GB)
    message = str(info.value)
    assert "[model] table_sizes = per feature (204_184_609 rows in all, the largest 40_000_000)" in message
    assert "more than the 22.4 GiB this machine has available" in message and "Per process (GiB): trainer0" in message
    assert "a smaller [model] max_table_size" in message and 'server_storage = "fused8bit"' in message
    assert "more parameter servers on a Ray cluster" in message


def test_the_launcher_refuses_an_oversized_plan_before_ray_starts(tmp_path, capsys, no_ray):
    sizes = table_sizes.sizes_from_counts(list(CRITEO_1TB_CARDINALITIES), 40_000_000)
    rc = main(["launch", "--quiet", "--set", f'job.run_dir="{tmp_path / "runs"}"', "--set", "metrics.enabled=false",
               "--set", f"model.table_sizes={sizes}", "--set", "model.embedding_dim=64"])
    assert rc == 2
    assert "[model] table_sizes = per feature (204_184_609 rows in all" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    (path,) = write_synthetic(tmp_path_factory.mktemp("d"), 4000, spec=SynthSpec(seed=2, max_cardinality=700))
    return path


def test_sizes_from_the_data_are_resolved_and_recorded(data, tmp_path):
    config = JobConfig().replace(model={"table_sizes": "data", "max_table_size": 300}, data={"path": str(data)})
    resolved, plan, record = first_pass(config, data, local=True)
    assert plan.distinct is not None and plan.lines == 4000
    want = [min(d + 1, 300) for d in plan.distinct]
    assert table_sizes.sizes(resolved) == want == record["sizes"] and resolved.model.table_sizes == want
    assert 300 in want and min(want) < 300  # capped features and small ones
    path = table_sizes.write_record(tmp_path, record)
    saved = json.loads(path.read_text())
    assert saved["distinct"] == plan.distinct and saved["features"][0] == "C1" and saved["max_table_size"] == 300
    uniform, _, none = first_pass(config.replace(model={"table_sizes": "uniform"}), data, local=False)
    assert none is None and table_sizes.sizes(uniform) == [20000] * 26


def test_a_data_sized_plan_that_does_not_fit_is_refused(data, monkeypatch):
    monkeypatch.setattr(checks, "available_memory_bytes", lambda: 2**20)
    config = JobConfig().replace(model={"table_sizes": "data"})
    with pytest.raises(ConfigError, match=r"table_sizes = per feature .* the job needs about .* more than the 0\.0 GiB"):
        first_pass(config, data, local=True)


def test_the_model_takes_per_table_sizes(data):
    plan = scan(data, 1, 0.0, distinct_cap=10**6)
    config = JobConfig().replace(model={"table_sizes": table_sizes.sizes_from_counts(plan.distinct, 500),
                                        "bottom_mlp": [8], "top_mlp": [8], "embedding_dim": 4})
    assert len(set(table_sizes.sizes(config))) > 1  # the data gives different sizes per feature
    model = build_model(config)
    bags = model.sparse_arch.embedding_bag_collection.embedding_bags
    assert [bags[f"t_{key}"].weight.shape[0] for key in criteo.FEATURES] == table_sizes.sizes(config)
    ids = torch.tensor([[s - 1 for s in table_sizes.sizes(config)]] * 3)  # the last row of every table
    assert model(torch.zeros(3, 13), criteo.to_kjt(ids)).shape == (3, 1)
    with pytest.raises(RuntimeError, match="(?i)index"):  # one past the last row of each table (message varies)
        model(torch.zeros(3, 13), criteo.to_kjt(ids + 1))


def test_server_table_specs_use_the_per_table_sizes():
    config = _sized(CRITEO_KAGGLE_CARDINALITIES, 10_000_000).replace(cluster={"parameter_servers": 3})
    rows = checks._server_rows(config)
    assert sum(rows) == sum(table_sizes.sizes(config)) and len(rows) == 3
    assert max(rows) >= max(table_sizes.sizes(config))  # table-wise: the 10M-row table lies whole on one server
