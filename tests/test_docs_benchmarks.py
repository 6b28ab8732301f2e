"""The Benchmarks page is made from the benchmarks' JSON records (``docs/gen_benchmarks.py``):

* every record in ``benchmarks/results/`` parses, is in the record format, and names its machine and ISA;
* every record appears on the built page (its machine, ISA, rows and plot), and every marker of
  ``docs/benchmarks.md`` names a record that exists;
* a benchmark run with ``--json`` writes a valid record (``benchmarks/ir.py`` at a tiny size: seconds);
* :func:`gen_benchmarks.render` places a record at its marker, the rest at ``rest``, and names a bad file.
"""

from __future__ import annotations

import html
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._docs_site import DOCS, ROOT, built_site

sys.path.insert(0, str(DOCS))
import gen_benchmarks  # noqa: E402

RECORDS = sorted(gen_benchmarks.RESULTS.glob("*.json"))


@pytest.fixture(scope="module")
def page() -> str:
    return (built_site() / "benchmarks" / "index.html").read_text(encoding="utf-8")


def test_the_page_has_records():
    assert RECORDS, "benchmarks/results/ holds no record"


@pytest.mark.parametrize("path", RECORDS, ids=[p.name for p in RECORDS])
def test_each_record_parses_and_names_its_machine_and_isa(path: Path):
    record = json.loads(path.read_text(encoding="utf-8"))
    assert gen_benchmarks.problems(record) == []
    machine = record["machine"]
    assert machine["cpu"] and machine["cpu"] != "unknown CPU"
    assert machine["isa"] and machine["isa"] != "unknown" and machine["cores"] >= 1
    assert record["rows"], "a record without rows shows nothing"
    assert all(r["fxdist"] > 0 and r["peer"] > 0 for r in record["rows"])


@pytest.mark.parametrize("path", RECORDS, ids=[p.name for p in RECORDS])
def test_each_record_appears_on_the_built_page_with_its_plot(page: str, path: Path):
    record = json.loads(path.read_text(encoding="utf-8"))
    for text in (record["machine"]["cpu"], record["machine"]["isa"], record["command"],
                 *(row["name"] for row in record["rows"])):
        assert html.escape(text, quote=False) in page, text
    plot = f"assets/benchmarks/{path.stem}.svg"
    assert plot in page
    assert (built_site() / plot).read_text().lstrip().startswith(("<?xml", "<svg"))


def test_every_marker_of_the_page_names_a_record():
    names = set(gen_benchmarks.MARKER.findall((DOCS / "benchmarks.md").read_text())) - {"rest"}
    assert names, "docs/benchmarks.md places no record"
    assert names <= {p.stem for p in RECORDS}


def test_a_benchmark_writes_a_valid_record_with_json(tmp_path: Path):
    out = tmp_path / "ir.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ir.py"), "--nodes", "60", "--reps", "2",
                    "--json", str(out)], check=True, capture_output=True, timeout=300, cwd=ROOT)
    record = json.loads(out.read_text())
    assert gen_benchmarks.problems(record) == []
    assert record["benchmark"] == "ir" and "--nodes 60" in record["command"]
    assert {r["group"] for r in record["rows"]} == {"ir", "forward", "forward_eager"}
    phases = {r["name"]: r for r in record["rows"] if r["group"] == "ir"}
    assert set(phases) == {"construction", "construction (gc off)", "python_code", "recompile"}
    for row in phases.values():
        assert row["ratio"] == pytest.approx(row["fxdist"] / row["peer"])
        assert row["spread"][0] <= row["spread"][1]
    assert len(record["load_start"]) == len(record["load_end"]) == 3


def _record(benchmark: str, rows: list[tuple[str, float, float]]) -> dict:
    return {"format": gen_benchmarks.FORMAT, "benchmark": benchmark, "title": f"the {benchmark} title",
            "command": f"benchmarks/{benchmark}.py", "date": "2026-11-28T10:00:00+0000",
            "machine": {"cpu": "Test CPU", "cores": 2, "isa": "AVX2, no VNNI", "flags": ["avx2"], "torch": "2.x"},
            "load_start": [0.5, 0.4, 0.3], "load_end": [1.5, 1.0, 0.5], "settings": {"reps": 3},
            "groups": [{"key": "g", "title": "G", "peer": "torch.fx", "unit": "ms", "lower_is_better": True}],
            "rows": [{"group": "g", "name": n, "fxdist": a, "peer": b, "ratio": a / b, "spread": [0.4, 0.6]}
                     for n, a, b in rows], "notes": ["a note"]}


def test_render_places_records_at_their_markers_and_the_rest_and_names_a_bad_file(tmp_path: Path):
    (tmp_path / "one.json").write_text(json.dumps(_record("one", [("row a", 1.0, 2.0)])))
    (tmp_path / "two.json").write_text(json.dumps(_record("two", [("row b", 3.0, 1.5)])))
    (tmp_path / "bad.json").write_text(json.dumps({"benchmark": "bad"}))
    out = gen_benchmarks.render("# B\n\n<!-- benchmark: one -->\n\n## Rest\n\n<!-- benchmark: rest -->\n", tmp_path)
    first, rest = out.split("## Rest")
    assert "| row a | 1.00 | 2.00 | **0.50** | 0.40-0.60 |" in first and "row b" not in first
    assert "2-core Test CPU, AVX2, no VNNI, load 0.5 → 1.5" in first
    assert "### the two title" in rest and "| row b | 3.00 | 1.50 | **2.00** |" in rest and "row a" not in rest
    assert "bad.json is not a fxdist-benchmark/1 record" in rest
    assert "<!--" not in out
    assert "Measured on a busy machine" not in out      # load 1.5 on 2 cores
    busy = _record("one", [("row a", 1.0, 2.0)])
    busy["load_end"] = [9.0, 5.0, 2.0]
    (tmp_path / "one.json").write_text(json.dumps(busy))
    assert "The load average reached 9 on 2 cores" in gen_benchmarks.render("<!-- benchmark: one -->", tmp_path)
    svgs = gen_benchmarks.plots(tmp_path)
    assert set(svgs) == {"assets/benchmarks/one.svg", "assets/benchmarks/two.svg"}
    assert "row b" in svgs["assets/benchmarks/two.svg"]


def test_problems_name_what_a_record_lacks():
    record = _record("x", [("r", 1.0, 1.0)])
    assert gen_benchmarks.problems(record) == []
    del record["machine"]["isa"]
    record["rows"][0]["group"] = "nope"
    assert gen_benchmarks.problems(record) == ["machine.isa missing",
                                               "row 0 names group 'nope', which the record does not declare"]
    assert gen_benchmarks.problems({"format": "other"}) == ["format is 'other', not 'fxdist-benchmark/1'"]


def test_peers_record_pairs_rounds_with_dmp_and_the_ceiling_and_notes_failed_runs():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _bench
    import peer

    def run(qps: float) -> dict:
        return {"qps": qps, "first_loss": 0.7, "last_loss": 0.69, "wall": 1.0}

    found = {"dmp_tw": [run(100.0), run(200.0), run(100.0)],
             "fx_prefetch_0ms": [run(150.0), run(200.0), {"error": "EADDRINUSE", "wall": 1.0}],
             "dense_only": [run(300.0), run(400.0), run(200.0)]}
    record = _bench.Record("peer", "peer")
    peer.record_size(record, "10x4", found)
    rows = {r["group"]: r for r in record.data["rows"]}
    assert set(rows) == {"dmp_10x4", "ceiling_10x4"}    # fxdist systems only: the peers are not rows
    dmp = rows["dmp_10x4"]
    assert (dmp["fxdist"], dmp["peer"], dmp["spread"]) == (175.0, 100.0, [1.0, 1.5])   # round 3 failed: left out
    assert dmp["ratio"] == pytest.approx(1.25)
    assert rows["ceiling_10x4"]["spread"] == [0.5, 0.5]
    assert not any(g["lower_is_better"] for g in record.data["groups"])
    assert any("fx_prefetch_0ms: 1 of 3 runs failed (left out): EADDRINUSE" in n for n in record.data["notes"])
    assert gen_benchmarks.problems({**record.data, "machine": _bench.machine(), "load_end": [0.0] * 3}) == []
