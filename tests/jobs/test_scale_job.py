"""The job on 200k synthetic Criteo lines (``fxdist data synth``) with per-feature table sizes from the data and
the servers' rows in FBGEMM's fused 8-bit form: it learns the synthetic label (held-out AUC > 0.6), both phases
still train bit-identically, the run records the cardinalities and the readers' parse throughput, and
results.json has every process's peak RSS and the rows and bytes the server held."""

from __future__ import annotations

import json

import pytest

from jobs.launcher.cli import main
from jobs.trainer.metrics import free_port_block
from recsys.criteo_synth import SynthSpec, write_synthetic

pytestmark = pytest.mark.timeout(420)


def test_synthetic_200k_lines_with_8bit_server_rows(ray_session, tmp_path, capsys):
    (data,) = write_synthetic(tmp_path / "data", 200_000, spec=SynthSpec(seed=3))
    run_dir = tmp_path / "run"
    sets = [f'data.path="{data}"', 'model.server_storage="fused8bit"', 'model.table_sizes="data"',
            "model.max_table_size=50000",
            "model.bottom_mlp=[64]", "model.top_mlp=[64]", "job.steps=120", "job.batch_size=256",
            "job.eval_epochs=0", "job.progress=false", "data.eval_fraction=0.05", "quant.enabled=false",
            "cluster.cpus_per_trainer=0.5", "cluster.servers_in_trainers=false", f"metrics.port={free_port_block(3)}"]
    assert main(["launch", "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)]]) == 0
    results = json.loads((run_dir / "results.json").read_text())
    assert results["config"]["model"]["server_storage"] == "fused8bit"
    assert results["data"]["parse"]["valid"] == 200_000
    cards = json.loads((run_dir / "cardinalities.json").read_text())
    sizes = [min(d + 1, 50_000) for d in cards["distinct"]]
    assert results["tables"]["sizes"] == sizes == results["config"]["model"]["table_sizes"] == cards["sizes"]
    assert max(sizes) == 50_000 and min(sizes) < 100  # capped features and small ones (Criteo Kaggle's C9 has 3)
    for phase in ("baseline", "optimized"):
        quality = results["phases"][phase]["quality"]
        assert quality["rows"] == 10_000 and quality["auc"] > 0.6, quality  # measured 0.736 (seed 3)
        reader = results["phases"][phase]["reader"]  # each trainer's capacity is its workers times their mean rate
        assert reader["capacity_lines_per_s"] == pytest.approx(reader["lines_per_s"] * reader["workers"] * 2)
        # the readers parsed at least the rows both trainers trained (120 steps of 256), from at least as many lines
        assert reader["lines"] >= reader["rows"] >= 2 * 120 * 256, reader
    assert results["parity"]["ok"] and results["parity"]["identical_losses"]
    processes = results["processes"]  # peak RSS of every process, and what the server holds
    assert sorted(processes) == ["launcher", "ps0", "trainer0", "trainer1"]
    for name, stats in processes.items():
        assert 50 * 2**20 < stats["peak_rss_bytes"] < 16 * 2**30, (name, stats)
    server = processes["ps0"]
    assert server["rows"] == 2 * sum(results["tables"]["sizes"])  # a table set per phase
    assert server["bytes"] == server["rows"] * (16 + 8 + 4)  # fused 8-bit rows (D + 8 bytes) + fp32 Adagrad state
    assert server["peak_rss_bytes"] > server["bytes"]
    assert "parity of the optimized phase (async_rpc_prefetch): OK" in capsys.readouterr().out
