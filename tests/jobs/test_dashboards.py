"""dashboards/: the recording rules and every Grafana expression pass ``promtool check rules``; the "Parameter servers"
row shows every parameter-server metric; dashboards/README.md lists them. (Whether the expressions return data in a
real job: tests/jobs/test_job.py.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from jobs.launcher.prometheus import DASHBOARDS
from jobs.trainer.server_metrics import SERVER_METRICS

STALENESS = "fxdist_ps_staleness_steps"


def _promtool() -> str:
    binary = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None)
    if binary is None:
        pytest.skip("promtool is not installed (it comes with Debian's prometheus package: scripts/bootstrap.sh)")
    return binary


def _check_rules(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


def _rules() -> dict[str, str]:
    """Recording rule name -> its expression."""
    doc = yaml.safe_load((DASHBOARDS / "rules.yml").read_text())
    return {r["record"]: r["expr"] for group in doc["groups"] for r in group["rules"]}


def _panels() -> list[dict]:
    return json.loads((DASHBOARDS / "grafana-fxdist.json").read_text())["panels"]


def test_recording_rules_pass_promtool():
    proc = _check_rules(DASHBOARDS / "rules.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in proc.stdout


def test_every_dashboard_expression_is_valid_promql(tmp_path):
    """Each panel's expression, as a recording rule of its own, through ``promtool check rules`` (its PromQL parser)."""
    exprs = [t["expr"].replace("$job", ".*") for p in _panels() for t in p.get("targets", [])]
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"fxdist:panel_{i}", "expr": e}
                                                        for i, e in enumerate(exprs)]}]}
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump(rules))
    proc = _check_rules(path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in proc.stdout
    # the check can fail: an unbalanced expression is refused
    path.write_text(yaml.safe_dump({"groups": [{"name": "bad", "rules": [{"record": "x:y", "expr": "sum by (job"}]}]}))
    assert _check_rules(path).returncode != 0


def test_panel_ids_are_unique():
    ids = [p["id"] for p in _panels()]
    assert len(ids) == len(set(ids)), ids


def test_the_parameter_servers_row_shows_every_server_metric():
    panels = _panels()
    start = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == "Parameter servers")
    row = []
    for p in panels[start + 1:]:
        if p["type"] == "row":
            break
        row.append(p)
    rules = _rules()
    shown = ""
    for p in row:
        for t in p["targets"]:
            expr = t["expr"]
            # a recorded series: the expression it records
            shown += expr + " " + " ".join(rules[r] for r in re.findall(r"fxdist:[\w:]+", expr))
    missing = [m for m in (*SERVER_METRICS, STALENESS) if m not in shown]
    assert not missing, f"the Parameter servers row shows no panel of {missing}"
    # latency quantiles come from the server-side histograms
    for kind in ("lookup", "push"):
        for q in ("0.5", "0.99"):
            assert f"histogram_quantile({q}, sum by (job, rank, le) (rate(fxdist_ps_server_{kind}_seconds_bucket" \
                in shown


def test_dashboards_readme_lists_every_metric():
    text = (DASHBOARDS / "README.md").read_text()
    missing = [m for m in (*SERVER_METRICS, STALENESS) if f"`{m}`" not in text]
    assert not missing, f"dashboards/README.md does not list {missing}"
