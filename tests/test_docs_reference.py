"""The generated reference pages cover what the code accepts and exports, each checked against a source the
generator does not use the same way, and against the built site:

* every key ``jobs.config`` accepts (the section classes' type hints, as ``parse_config`` reads them) and every key
  of the bundled configs has an entry, and each key's printed range is the rule ``parse_config`` enforces;
* every Prometheus metric name written in the exporters' source has an entry, with its labels;
* every ``results.json`` key (the ``jobs.results`` dataclasses' fields, and the keys of a results dict written by
  the report) has an entry;
* every option of the ``fxdist`` parser and every exception class of the packages (found by a plain regex) has
  an entry.
* every exception class has its section (anchor) on the troubleshooting page, which the API pages link.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import tomllib
import typing

import pytest

from tests._docs_site import DOCS, ROOT, built_site

sys.path.insert(0, str(DOCS))
import gen_reference  # noqa: E402

PACKAGES = ("fxdist", "recsys", "scheduling", "quant", "jobs")


@pytest.fixture(scope="module")
def site():
    return built_site()


def _schema_keys() -> set[tuple[str, str]]:
    from jobs import config

    return {(table, key) for table, cls in config._SECTIONS.items()
            for key in typing.get_type_hints(config._resolve(cls))}


def test_every_config_key_has_an_entry(site):
    documented = {(k["table"], k["key"]) for k in gen_reference.config_keys()}
    assert documented == _schema_keys()
    for path in (ROOT / "jobs").glob("*.toml"):
        bundled = {(t, k) for t, keys in tomllib.loads(path.read_text()).items() for k in keys}
        assert bundled <= documented, f"{path.name}: {bundled - documented} not documented"
    page = gen_reference.config_page()
    html = (site / "reference" / "config" / "index.html").read_text()
    missing = [f"[{t}] {k}" for t, k in sorted(_schema_keys())
               if f'<span id="{t}-{k}">' not in page or f'id="{t}-{k}"' not in html]
    assert not missing, f"config keys without an entry on the page: {missing}"


def test_each_config_range_is_the_rule_parse_config_enforces():
    from jobs.config import ConfigError, parse_config

    checked = 0
    for k in gen_reference.config_keys():
        match = re.fullmatch(r"an integer in ([-0-9_]+)\.\.([0-9_]+)|a finite number in [\[(]([-0-9.e+]+), ([0-9.e+]+)\]",
                             k["range"])
        if not match or isinstance(k["default"], list) or not isinstance(k["default"], (int, float)):
            continue
        too_big = int(match.group(2)) + 1 if match.group(2) else float(match.group(4)) * 2 + 1
        with pytest.raises(ConfigError) as e:
            parse_config({k["table"]: {k["key"]: too_big}})
        assert f"[{k['table']}] {k['key']} = " in str(e.value) and k["range"] in str(e.value), (k, str(e.value))
        checked += 1
    assert checked >= 30


def test_every_metric_has_an_entry(site):
    documented = {m["name"]: m for m in gen_reference.collect_metrics()}
    source = "".join((ROOT / "jobs" / name).read_text() for name in ("trainer/metrics.py", "trainer/server_metrics.py",
                                                                    "launcher/serving.py"))
    written = set(re.findall(r'"(fxdist_[a-z_]+)"', source))
    # prometheus_client adds _total to a Counter's name when it is exported
    exported = {n if n.endswith("_total") or n != "fxdist_samples" else n + "_total" for n in written}
    assert exported <= set(documented), f"metrics without an entry: {exported - set(documented)}"
    assert documented["fxdist_ps_rows"]["labels"] == ["job", "rank", "phase", "module", "table"]
    assert documented["fxdist_step_seconds"]["type"] == "histogram" and documented["fxdist_step_seconds"]["unit"]
    assert documented["fxdist_serve_requests_total"]["labels"] == ["code"]
    assert documented["fxdist_serve_request_seconds"]["exporter"] == "serving"
    html = (site / "reference" / "metrics" / "index.html").read_text()
    assert all(name in html for name in documented)


def test_every_results_key_has_an_entry(site):
    from jobs.results import InferenceResult, JobResults, PhaseResult

    documented = {(k["where"], k["key"]) for k in gen_reference.results_keys()}
    for where, cls in (("results.json", JobResults), ("phases.<phase>", PhaseResult), ("inference", InferenceResult)):
        fields = {(where, f.name) for f in dataclasses.fields(cls)}
        assert fields <= documented, f"{cls.__name__}: {fields - documented}"
    html = (site / "reference" / "results" / "index.html").read_text()
    assert all(f"<code>{key}</code>" in html for _, key in documented)


def test_every_cli_option_and_exception_has_an_entry(site):
    from jobs.launcher.cli import _parser

    cli = gen_reference.cli_page()
    parser = _parser()
    subs = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"][0]
    for name, sub in subs.choices.items():
        assert f"`fxdist {name}" in cli
        for action in sub._actions:
            for flag in action.option_strings:
                assert flag in cli or flag in ("-h", "--help"), f"fxdist {name} {flag}"
    errors = gen_reference.errors_page()
    html = (site / "reference" / "errors" / "index.html").read_text()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for name in re.findall(r"^class ([A-Z]\w*(?:Error|Warning))\(", path.read_text(), flags=re.MULTILINE):
                assert f"`{name}`" in errors and f"<code>{name}</code>" in html, f"{path}: {name}"


def test_each_exception_has_a_troubleshooting_anchor_the_api_pages_link(site):
    """``troubleshooting.md#configerror`` style links resolve on the site (one ``### Name`` section per exception
    class), and the API pages turn a docstring's ``See docs/troubleshooting.md#name.`` into a link to it."""
    html = (site / "troubleshooting" / "index.html").read_text()
    for c in gen_reference.exception_classes():
        if not c["warning"]:
            assert f'id="{c["name"].lower()}"' in html, c["name"]
    api = (site / "reference" / "api" / "jobs-config" / "index.html").read_text()
    assert '<a href="../../../troubleshooting/#configerror">docs/troubleshooting.md#configerror</a>' in api
