"""The typed results (jobs.results): results.json read into JobResults / PhaseResult / InferenceResult and written
back with the same keys and values, clear errors for a key the schema does not know or lacks, and the same table."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pytest

from jobs.launcher.report import table, write
from jobs.results import ABSENT, InferenceResult, JobResults, PhaseResult, ResultsError


def _phase(qps: float) -> dict:
    return {"trainers": 2, "steps": 12, "samples": 768, "wall_seconds": 0.8, "qps": qps, "step_p50_ms": 5.0,
            "step_p99_ms": 9.0, "lookup_p50_ms": 0.4, "lookup_p99_ms": 1.2, "loss": 0.45, "prefetched_lookups": 260,
            "metrics_percent": 0.02, "qps_series": [[0.5, 900.0], [1.0, 1100.0]], "loss_series": [0.7, 0.5],
            "quality": {"auc": 0.7, "log_loss": None, "rows": 500, "positives": 120}, "quality_step": 6,
            "quality_epochs": 0.4, "quality_end": {"auc": 0.72, "log_loss": 0.5, "rows": 500, "positives": 120},
            "optimize": {"passes": [{"name": "async_rpc", "nodes_added": 2, "nodes_erased": 1}], "fallback": None,
                         "prefetch": {"sparse_arch.t0": {"prefetched": True, "reason": None, "where": "forward"}}},
            "resumed_from_step": 0, "epochs": 0.8, "block_seconds": [[0.2, 0.2], [0.21, 0.19]], "reader": None}


_CHECK = {"baseline": 0.7, "optimized": 0.7, "diff": 0.0, "tolerance": 0.01, "ok": True}
_PARITY = {"metrics": ["auc"], "auc": _CHECK, "loss": _CHECK, "max_step_loss_diff": 0.0, "identical_losses": True,
           "ok": True, "mode": "warn", "passes": ["async_rpc_prefetch"]}


def _results() -> dict:
    """A completed run's results.json, every key a job writes (the shapes of jobs.launcher.launch / jobs.launcher.inference)."""
    inference = {"method": "quant: fuse + select_int8", "fused_modules": 2, "quantized_modules": 1, "isa": "avx2",
                 "layers": [{"target": "over_arch.0", "fp32_us": 10.0, "int8_us": 5.0, "chosen": True}],
                 "kept_fp32": False, "note": None, "all_int8_speedup": 1.3, "selection": "...",
                 "output_max_abs_diff": 0.01, "rows": 500, "batch_size": 64, "threads": 1,
                 "fp32": {"qps": 1e4, "auc": 0.7, "log_loss": 0.5}, "int8": {"qps": 2e4, "auc": 0.7, "log_loss": 0.5},
                 "speedup": 2.0, "device": "cpu", "model_step": 6, "seconds": 3.5}
    return {"status": "completed", "job": "demo", "config": {"cluster": {"trainers": 2, "parameter_servers": 1},
                                                             "job": {"steps": 12, "batch_size": 32}},
            "config_source": "defaults", "run_dir": "/tmp/run", "resumes": 0,
            "data": {"path": "x.tsv", "note": "", "parse": {"valid": 10, "malformed": {"field_count": 2}}},
            "tables": {"sizes": [500]}, "phases": {"baseline": _phase(1000.0), "optimized": _phase(1250.0)},
            "restarts": 0, "faults_fired": [],
            "checkpoints": [{"phase": "baseline", "step": 4, "model": "a", "tables": "b"}],
            "restores": [], "timeline": [[0.1, "baseline phase started at step 0"]], "starts": [["baseline", 0]],
            "server_joins": [[{"pid": 7, "group": 1}]], "placement": {}, "nodes_lost": [],
            "processes": {"launcher": {"pid": 1, "peak_rss_bytes": 10}}, "train_seconds": 20.5,
            "gain": {"median_percent": 25.0, "blocks": 0}, "parity": _PARITY, "inference": inference,
            "gain_percent": 25.0}


def test_results_json_round_trips_with_the_same_keys_and_values(tmp_path):
    data = _results()
    typed = JobResults.from_json(data)
    assert isinstance(typed.phases["baseline"], PhaseResult) and isinstance(typed.inference, InferenceResult)
    assert typed.phases["optimized"].qps == 1250.0 and typed.inference.speedup == 2.0
    assert typed.to_json() == data  # results.json keeps its keys and values
    assert JobResults.from_json(typed.to_json()) == typed
    assert JobResults.from_json(json.loads(json.dumps(typed.to_json()))) == typed
    assert pickle.loads(pickle.dumps(typed)) == typed  # through Ray: ABSENT stays the one ABSENT
    assert pickle.loads(pickle.dumps(ABSENT)) is ABSENT
    write(typed, tmp_path)
    assert json.loads((tmp_path / "results.json").read_text()) == data


def test_absent_keys_stay_absent_and_nan_is_written_as_null():
    skipped = InferenceResult.from_json({"skipped": "no held-out batch", "model_step": None})
    assert skipped.to_json() == {"skipped": "no held-out batch", "model_step": None} and skipped.rows is ABSENT
    phase = PhaseResult(qps=float("nan"), step_p50_ms=1.0, step_p99_ms=2.0, lookup_p50_ms=None, lookup_p99_ms=None,
                        loss=math.inf, qps_series=[(0.5, 1.0)])
    assert phase.to_json() == {"qps": None, "step_p50_ms": 1.0, "step_p99_ms": 2.0, "lookup_p50_ms": None,
                               "lookup_p99_ms": None, "loss": None, "qps_series": [[0.5, 1.0]]}
    assert phase["qps_series"] == [(0.5, 1.0)] and "trainers" not in phase and phase.get("trainers", 3) == 3


@pytest.mark.parametrize("where, change, message", [
    ("top", lambda r: r.update(phasez={}), r"results: unknown key 'phasez'"),
    ("top", lambda r: r.pop("config"), r"results: required key 'config' is missing"),
    ("phase", lambda r: r["phases"]["optimized"].pop("step_p99_ms"),
     r"results.phases.optimized: required key 'step_p99_ms' is missing"),
    ("phase", lambda r: r["phases"]["baseline"].update(fetch_p50=1.0),
     r"results.phases.baseline: unknown key 'fetch_p50'"),
    ("inference", lambda r: r["inference"].update(speed_up=2.0), r"results.inference: unknown key 'speed_up'"),
    ("inference", lambda r: r.update(inference=[1]), r"results.inference: expected a JSON object, got list"),
])
def test_a_key_the_schema_does_not_know_or_lacks_is_named(where, change, message):
    data = _results()
    change(data)
    with pytest.raises(ResultsError, match=message):
        JobResults.from_json(data)


def test_the_table_is_the_same_for_the_typed_results():
    data = _results()
    data["phases"]["optimized"]["quality"] = {"auc": 0.71, "log_loss": 0.49, "rows": 500, "positives": 120}
    text = table(data)
    assert table(JobResults.from_json(data)) == text
    assert "QPS gain, optimized vs baseline: +25.0 %" in text and "int8 speed-up: 2.00x" in text
    assert "prefetch (async_rpc_prefetch): 1 of 1 lookups prefetched; 260 lookups answered by a prefetch" in text


DATA = Path(__file__).parent / "data"


def test_a_real_short_runs_results_round_trip_and_print_the_same_table():
    """results.json of a short run (2 trainers, 1 server, 12 steps, int8 comparison) and the table the report
    printed for it before the results were typed."""
    data = json.loads((DATA / "results_short_run.json").read_text())
    typed = JobResults.from_json(data)
    assert typed.to_json() == data and JobResults.from_json(typed.to_json()) == typed
    assert table(typed) + "\n" == (DATA / "results_short_run.table.txt").read_text()


def test_a_resumed_runs_results_are_read_typed_and_a_foreign_key_is_a_config_error(tmp_path):
    from jobs.config import ConfigError
    from jobs.launcher import runs

    runs.write(tmp_path, {**_results(), "phases": {"baseline": PhaseResult.from_json(_phase(1.0))}})
    typed = runs.read_results(tmp_path)
    assert typed.phases["baseline"] == PhaseResult.from_json(_phase(1.0)) and typed.status == "completed"
    runs.write(tmp_path, {**_results(), "fetch_p50": 1.0})
    with pytest.raises(ConfigError, match=r"results.json: results: unknown key 'fetch_p50'"):
        runs.read_results(tmp_path)
    assert runs.read_results(tmp_path / "absent") is None
