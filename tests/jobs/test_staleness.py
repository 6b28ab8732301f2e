"""``[phases] max_staleness`` (jobs/staleness.py): its config keys, the stale prefetch pass it selects, its
quality-tolerance parity rule (within / outside the tolerance, error vs warn), and one short real job."""

from __future__ import annotations

import json
import math

import pytest

from jobs.config import ConfigError, JobConfig, load_config
from jobs.staleness import RULE, optimized_passes, staleness_parity


def _phase(auc: float | None = 0.75, rmse: float | None = None, losses=(0.7, 0.6, 0.5)) -> dict:
    quality = {"rows": 1000, "positives": 250}
    if auc is not None:
        quality["auc"] = auc
    if rmse is not None:
        quality = {"rmse": rmse, "rmse_se": 0.01, "rows": 1000}
    return {"quality": quality, "loss": losses[-1], "loss_series": list(losses)}


# ---- config ------------------------------------------------------------------------------------------------------

def test_max_staleness_defaults_to_exact_and_accepts_1():
    assert JobConfig().phases.max_staleness == 0 and JobConfig().phases.staleness_tolerance == 0.002
    assert load_config().phases.max_staleness == 0  # jobs/default.toml spells the default out
    c = JobConfig().replace(phases={"max_staleness": 1, "staleness_tolerance": 0.01})
    assert (c.phases.max_staleness, c.phases.staleness_tolerance) == (1, 0.01)


@pytest.mark.parametrize("phases, message", [
    ({"max_staleness": -1}, r"\[phases\] max_staleness = -1: must be an integer in 0\.\.64"),
    ({"max_staleness": 65}, r"\[phases\] max_staleness = 65: must be an integer in 0\.\.64"),
    ({"staleness_tolerance": -0.001}, r"\[phases\] staleness_tolerance = -0\.001: must be a finite number in \[0, 1\]"),
    ({"staleness_tolerance": 1.5}, r"\[phases\] staleness_tolerance = 1\.5: must be a finite number in \[0, 1\]"),
    ({"staleness_tolerance": math.nan}, r"\[phases\] staleness_tolerance = nan: must be a finite number"),
    ({"max_staleness": 1, "passes": ["async_rpc"]},
     r"max_staleness = 1 needs 'async_rpc_prefetch' in \[phases\] passes .*passes = \['async_rpc'\]"),
])
def test_bad_staleness_keys_name_the_key(phases, message):
    with pytest.raises(ConfigError, match=message):
        JobConfig().replace(phases=phases)


def test_max_staleness_needs_parameter_servers_and_held_out_data():
    with pytest.raises(ConfigError, match=r"max_staleness = 2 needs parameter servers \(\[cluster\] parameter_servers"):
        JobConfig().replace(phases={"max_staleness": 2}, cluster={"parameter_servers": 0})
    with pytest.raises(ConfigError, match=r"max_staleness = 1 needs held-out data .*eval_fraction > 0"):
        JobConfig().replace(phases={"max_staleness": 1}, data={"eval_fraction": 0.0})
    # exact training needs neither
    assert JobConfig().replace(cluster={"parameter_servers": 0}, data={"eval_fraction": 0.0}).phases.max_staleness == 0


def test_max_staleness_wrong_type_is_a_config_error():
    with pytest.raises(ConfigError, match=r"\[phases\] max_staleness: expected int, got str"):
        JobConfig().replace(phases={"max_staleness": "1"})


# ---- passes ------------------------------------------------------------------------------------------------------

def test_optimized_passes_make_async_rpc_prefetch_stale_only_with_max_staleness():
    from scheduling.async_rpc_pass import async_rpc

    assert optimized_passes(["async_rpc_prefetch", "fuse"], 0) == ["async_rpc_prefetch", "fuse"]
    stale, other = optimized_passes(["async_rpc_prefetch", "fuse"], 3)
    assert other == "fuse"
    assert stale.func is async_rpc and stale.keywords == {"prefetch": True, "max_staleness": 3}
    assert stale.name == "async_rpc_prefetch(max_staleness=3)"


# ---- parity rule -------------------------------------------------------------------------------------------------

def test_staleness_parity_accepts_an_auc_within_the_tolerance():
    p = staleness_parity(_phase(0.7565), _phase(0.7561, losses=(0.7, 0.65, 0.52)), max_staleness=1, tolerance=0.002)
    assert p["rule"] == RULE and p["metric"] == "auc" and p["metrics"] == ["auc"] and p["max_staleness"] == 1
    assert (p["exact"], p["stale"], p["tolerance"]) == (0.7565, 0.7561, 0.002)
    assert p["abs_diff"] == pytest.approx(0.0004) and p["ok"]
    # the losses differ (stale lookups) and do not fail it
    assert not p["identical_losses"] and p["max_step_loss_diff"] == pytest.approx(0.05)
    assert (p["loss_exact"], p["loss_stale"]) == (0.5, 0.52)


def test_staleness_parity_fails_outside_the_tolerance_either_way():
    assert not staleness_parity(_phase(0.7565), _phase(0.7530), max_staleness=1, tolerance=0.002)["ok"]
    assert not staleness_parity(_phase(0.7565), _phase(0.7600), max_staleness=1, tolerance=0.002)["ok"]
    assert staleness_parity(_phase(0.7565), _phase(0.7600), max_staleness=1, tolerance=0.004)["ok"]
    # exactly at the tolerance is accepted; identical AUCs with tolerance 0 too
    assert staleness_parity(_phase(0.5), _phase(0.75), max_staleness=1, tolerance=0.25)["ok"]
    assert staleness_parity(_phase(0.75), _phase(0.75), max_staleness=1, tolerance=0.0)["ok"]


def test_staleness_parity_fails_without_a_metric_and_uses_rmse_without_auc():
    missing = staleness_parity(_phase(0.75), _phase(None), max_staleness=1, tolerance=0.5)
    assert not missing["ok"] and math.isnan(missing["stale"])
    nan = staleness_parity(_phase(0.75), _phase(math.nan), max_staleness=1, tolerance=0.5)
    assert not nan["ok"]
    rmse = staleness_parity(_phase(None, rmse=0.95), _phase(None, rmse=0.953), max_staleness=2, tolerance=0.002)
    assert rmse["metric"] == "rmse" and rmse["abs_diff"] == pytest.approx(0.003) and not rmse["ok"]
    with pytest.raises(ValueError, match="tolerance must be a finite number >= 0, got -1"):
        staleness_parity(_phase(), _phase(), max_staleness=1, tolerance=-1)


def _completed(parity_mode: str, stale_auc: float, tmp_path) -> tuple:
    """compare_phases + the launcher's report of a completed stale run (no Ray): (results, error or None)."""
    from jobs.launcher.launch import ParityError, _report, compare_phases
    from tests.jobs.test_results import _phase as full_phase
    from tests.jobs.test_results import _results

    config = JobConfig().replace(phases={"max_staleness": 1, "parity": parity_mode})
    base = {**full_phase(1000.0), "quality": {"auc": 0.7565, "log_loss": 0.5, "rows": 1000, "positives": 250}}
    opt = {**full_phase(1200.0), "quality": {"auc": stale_auc, "log_loss": 0.5, "rows": 1000, "positives": 250},
           "loss_series": [0.7, 0.52]}
    results = {**_results(), "phases": {"baseline": base, "optimized": opt}}
    results.update(compare_phases(config, results["phases"]))
    try:
        return _report(config, results, tmp_path, True, print), None
    except ParityError as e:
        return json.loads((tmp_path / "results.json").read_text()), e


def test_error_mode_fails_the_job_outside_the_tolerance_and_warn_reports_it(tmp_path):
    from jobs.launcher.report import table
    from jobs.results import JobResults

    typed, error = _completed("error", 0.7561, tmp_path / "ok")
    assert error is None and typed.parity["ok"] and typed.parity["mode"] == "error"
    text = table(typed)
    assert ("parity of the optimized phase (async_rpc_prefetch): OK: AUC 0.7561 vs exact 0.7565 (|diff| 0.0004 "
            "<= 0.002, max_staleness=1); largest per-step loss difference") in text

    written, error = _completed("error", 0.7500, tmp_path / "bad")
    assert error is not None and "lost more quality than [phases] staleness_tolerance allows: AUC 0.7500 vs " \
        "exact 0.7565 (|diff| 0.0065 > 0.002, max_staleness=1)" in str(error)
    assert written["parity"]["rule"] == RULE and not written["parity"]["ok"]  # results written all the same
    assert "parity of the optimized phase (async_rpc_prefetch): FAILED: AUC 0.7500" in table(JobResults.from_json(written))

    typed, error = _completed("warn", 0.7500, tmp_path / "warn")
    assert error is None and not typed.parity["ok"] and typed.parity["mode"] == "warn"
    assert "parity of the optimized phase (async_rpc_prefetch): WARNING: AUC 0.7500" in table(typed)


# ---- a real job ---------------------------------------------------------------------------------------------------

@pytest.mark.timeout(420)
def test_a_stale_job_trains_and_records_the_tolerance_parity(ray_session, tmp_path):
    from jobs.launcher.launch import launch

    config = load_config().replace(
        job={"steps": 12, "batch_size": 32, "checkpoint_every": 0, "progress": False, "name": "fxdist-stale",
             "eval_epochs": 0},
        data={"synthetic_rows": 2000},
        model={"table_size": 200, "bottom_mlp": [8], "top_mlp": [8]},
        phases={"block_steps": 4, "max_staleness": 1, "parity": "warn", "staleness_tolerance": 0.05},
        cluster={"trainers": 2, "parameter_servers": 1, "cpus_per_trainer": 0.5, "rpc_timeout_s": 20.0,
                 "server_fetch_delay_ms": 0.0},
        metrics={"enabled": False}, quant={"enabled": False})
    r = launch(config, run_dir=tmp_path / "run", quiet=True)
    assert r["status"] == "completed"
    written = json.loads((tmp_path / "run" / "results.json").read_text())["parity"]
    for key in ("rule", "metric", "max_staleness", "exact", "stale", "abs_diff", "tolerance", "ok", "mode"):
        assert key in written, key
    assert written["rule"] == RULE and written["max_staleness"] == 1 and written["tolerance"] == 0.05
    assert written["abs_diff"] == pytest.approx(abs(written["stale"] - written["exact"]))
    assert written["exact"] == r["phases"]["baseline"]["quality"]["auc"]
    assert written["stale"] == r["phases"]["optimized"]["quality"]["auc"]
    assert written["ok"] == (written["abs_diff"] <= 0.05)
    # the optimized phase ran the stale pass, prefetched its lookups, and trained differently from the exact one
    names = [p["name"] for p in r["phases"]["optimized"]["optimize"]["passes"]]
    assert "async_rpc_prefetch(max_staleness=1)" in names, names
    assert r["phases"]["optimized"]["prefetched_lookups"] > 0
    assert not written["identical_losses"] and written["max_step_loss_diff"] > 0
    # the first step saw the same (initial) rows in both phases: staleness starts with the second
    base_losses, opt_losses = r["phases"]["baseline"]["loss_series"], r["phases"]["optimized"]["loss_series"]
    assert base_losses[0] == opt_losses[0]
