"""The Benchmarks page's tables and plots, made from the benchmarks' JSON records at every docs build.

A benchmark run with ``--json PATH`` writes a record (``benchmarks/_bench.py``'s ``Record``, format
:data:`FORMAT`): the benchmark's name, command line, date, machine (CPU model, cores, int8 ISA and its flags,
torch), the load average at start and end, and groups of rows (fxdist's value, the peer's, the ratio fxdist /
peer and its spread over rounds). The records committed under ``benchmarks/results/`` are rendered here:

* :func:`render` replaces a marker ``<!-- benchmark: NAME -->`` in ``docs/benchmarks.md`` with the record
  ``NAME.json``'s tables (each captioned with its machine, ISA and load) and its plot, and the marker
  ``<!-- benchmark: rest -->`` with every record no other marker placed, each under its own heading;
* :func:`plots` draws one SVG per record with matplotlib (the ratio of each row as a bar from the parity line at 1,
  on a log axis, its spread as an error bar), which ``docs/hooks.py`` adds to the site as ``assets/benchmarks/NAME.svg``.

A file that is not a valid record is named on the page in a warning box, and :func:`problems` says why
(``tests/test_docs_benchmarks.py`` fails on it).
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FORMAT = "fxdist-benchmark/1"
PLOT_DIR = "assets/benchmarks"
MARKER = re.compile(r"^<!-- benchmark: ([\w.-]+) -->$", flags=re.MULTILINE)
REQUIRED = {"benchmark": str, "title": str, "command": str, "date": str, "machine": dict, "load_start": list,
            "load_end": list, "groups": list, "rows": list}
MACHINE_KEYS = ("cpu", "cores", "isa", "flags", "torch")
ROW_KEYS = ("group", "name", "fxdist", "peer", "ratio")
BUSY = 2.0
"""A record whose load average exceeded ``BUSY`` x its cores gets a warning box: its ratios carry others' noise."""


def problems(record: Any) -> list[str]:
    """What keeps ``record`` (a parsed JSON file) from being rendered; empty when it is a valid record."""
    if not isinstance(record, dict):
        return ["not a JSON object"]
    if record.get("format") != FORMAT:
        return [f"format is {record.get('format')!r}, not {FORMAT!r}"]
    found = [f"{key} missing or not a {kind.__name__}" for key, kind in REQUIRED.items()
             if not isinstance(record.get(key), kind)]
    if found:
        return found
    found += [f"machine.{key} missing" for key in MACHINE_KEYS if key not in record["machine"]]
    keys = {g.get("key") for g in record["groups"] if isinstance(g, dict)}
    for i, row in enumerate(record["rows"]):
        if not isinstance(row, dict) or any(k not in row for k in ROW_KEYS):
            found.append(f"row {i} lacks one of {ROW_KEYS}")
        elif row["group"] not in keys:
            found.append(f"row {i} names group {row['group']!r}, which the record does not declare")
    return found


def records(folder: Path = RESULTS) -> dict[str, tuple[dict[str, Any] | None, list[str]]]:
    """Every ``*.json`` of ``folder`` by file stem: ``(record, [])`` or ``(None or the data, its problems)``."""
    out: dict[str, tuple[dict[str, Any] | None, list[str]]] = {}
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            out[path.stem] = (None, [f"does not parse: {exc}"])
            continue
        out[path.stem] = (data, problems(data))
    return out


def _num(value: float) -> str:
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"


def _load(record: dict[str, Any]) -> str:
    return f"load {record['load_start'][0]:.1f} → {record['load_end'][0]:.1f}"


def machine_short(record: dict[str, Any]) -> str:
    """``2-core Intel(R) Xeon(R) Processor, AVX-512 VNNI + AMX-INT8``: the caption of each table."""
    m = record["machine"]
    return f"{m['cores']}-core {m['cpu']}, {m['isa']}"


def machine_line(record: dict[str, Any]) -> str:
    """The record's full provenance: date, machine, ISA flags, torch, load average at start and end, command."""
    m = record["machine"]
    flags = " ".join(m["flags"]) or "none of avx2, avx512f, avx512_vnni, amx"
    settings = ", ".join(f"{k} {v}" for k, v in record.get("settings", {}).items())
    return (f"Measured {record['date'][:16].replace('T', ' ')} on a {m['cores']}-core {m['cpu']} (ISA "
            f"**{m['isa']}**; int8 flags: {flags}), torch {m['torch']}; load average (1 min) "
            f"{record['load_start'][0]:.1f} at the start, {record['load_end'][0]:.1f} at the end"
            + (f"; {settings}" if settings else "") + f". Command: `{record['command']}`")


def group_table(record: dict[str, Any], group: dict[str, Any]) -> str:
    """One group's Markdown table, captioned with what it compares, the machine, ISA and load."""
    peer, unit = group["peer"], group["unit"]
    better = "lower" if group.get("lower_is_better", True) else "higher"
    lines = [f"**{group['title']}**: fxdist vs {peer}, {unit}, {better} is better; ratio fxdist / {peer}. "
             f"*{machine_short(record)}, {_load(record)}.*", "",
             f"| | fxdist | {peer} | fxdist / {peer} | spread over rounds |", "|---|---:|---:|---:|---|"]
    for row in record["rows"]:
        if row["group"] == group["key"]:
            spread = row.get("spread")
            lines.append(f"| {row['name']} | {_num(row['fxdist'])} | {_num(row['peer'])} | **{row['ratio']:.2f}** | "
                         + (f"{spread[0]:.2f}-{spread[1]:.2f}" if spread else "-") + " |")
    return "\n".join(lines)


def section(name: str, record: dict[str, Any], heading: str = "") -> str:
    """A record's Markdown: provenance, one table per group, notes, the plot (``assets/benchmarks/NAME.svg``)."""
    parts = [heading] if heading else []
    parts.append(machine_line(record))
    load = max(record["load_start"][0], record["load_end"][0])
    if load > BUSY * record["machine"]["cores"]:
        parts.append(f'!!! warning "Measured on a busy machine"\n    The load average reached {load:.0f} on '
                     f"{record['machine']['cores']} cores: other processes held most of the CPU during this run, "
                     "so its ratios carry their noise (see each row's spread). Rerun it on a quieter machine "
                     "before quoting a figure.")
    parts += [group_table(record, g) for g in record["groups"]
              if any(r["group"] == g["key"] for r in record["rows"])]
    notes = record.get("notes") or []
    if notes:
        parts.append("\n".join(f"- {note}" for note in notes))
    if record["rows"]:
        parts.append(f"![{record['title']}: the ratios, fxdist / peer]({PLOT_DIR}/{name}.svg)")
    return "\n\n".join(parts)


def _invalid(name: str, why: list[str]) -> str:
    return (f'!!! warning "benchmarks/results/{name}.json is not a {FORMAT} record"\n    '
            + "; ".join(why))


def render(markdown: str, folder: Path = RESULTS) -> str:
    """``markdown`` with every ``<!-- benchmark: NAME -->`` marker replaced by that record's section and
    ``<!-- benchmark: rest -->`` by the records no marker names (each under a ``###`` heading)."""
    found = records(folder)
    named = set(MARKER.findall(markdown)) - {"rest"}

    def one(name: str, heading: str = "") -> str:
        if name not in found:
            return f'!!! note "No record yet"\n    Run `benchmarks/{name}.py --json benchmarks/results/{name}.json`.'
        record, why = found[name]
        return _invalid(name, why) if why or record is None else section(name, record, heading)

    def rest() -> str:
        out = []
        for name, (record, _why) in found.items():
            if name not in named:
                title = record.get("title", name) if isinstance(record, dict) else name
                out.append(one(name, f"### {title}\n\n`benchmarks/results/{name}.json`"))
        return "\n\n".join(out)

    return MARKER.sub(lambda m: rest() if m[1] == "rest" else one(m[1]), markdown)


def plot(record: dict[str, Any]) -> str:
    """An SVG of the record's ratios (one panel per group, bars from 1 to the ratio on a log axis; error bars: the
    spread over rounds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    plt.rcParams["svg.hashsalt"] = "fxdist"   # stable ids: the same record gives the same file
    plt.rcParams["svg.fonttype"] = "none"     # text as text: smaller files, searchable labels
    groups = [g for g in record["groups"] if any(r["group"] == g["key"] for r in record["rows"])]
    sizes = [sum(r["group"] == g["key"] for r in record["rows"]) for g in groups]
    height = 0.8 + 0.3 * sum(sizes) + 0.9 * len(groups)
    fig, axes = plt.subplots(len(groups), 1, squeeze=False, figsize=(7.5, height), gridspec_kw={"height_ratios": sizes})
    for ax, group in zip(axes[:, 0], groups):
        rows = [r for r in record["rows"] if r["group"] == group["key"]][::-1]
        ratios = [r["ratio"] for r in rows]
        low = [r["ratio"] - r["spread"][0] if r.get("spread") else 0 for r in rows]
        high = [r["spread"][1] - r["ratio"] if r.get("spread") else 0 for r in rows]
        # bars from the parity line at 1 to the ratio, on a log axis: 0.5x and 2x are as far from 1
        ax.barh(range(len(rows)), [r - 1 for r in ratios], left=1,
                xerr=[[max(v, 0) for v in low], [max(v, 0) for v in high]],
                color="#3f6fb5", ecolor="#222222", capsize=3, height=0.6)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ends = [v for r in rows for v in (r.get("spread") or [r["ratio"]]) + [r["ratio"]] if v > 0]
        ax.set_xlim(min(ends + [1.0]) / 1.25, max(ends + [1.0]) * 1.25)
        ax.axvline(1.0, color="#b53f3f", linewidth=1)
        ax.set_yticks(range(len(rows)), [r["name"] for r in rows], fontsize=8)
        better = "lower" if group.get("lower_is_better", True) else "higher"
        ax.set_title(f"{group['title']}\nfxdist / {group['peer']}, {better} is better", fontsize=8, loc="left")
        ax.tick_params(axis="x", labelsize=8)
    axes[-1, 0].set_xlabel(f"ratio fxdist / peer; {machine_short(record)}, {_load(record)}", fontsize=8)
    fig.tight_layout()
    out = io.StringIO()
    fig.savefig(out, format="svg", metadata={"Date": None})
    plt.close(fig)
    return out.getvalue()


def plots(folder: Path = RESULTS) -> dict[str, str]:
    """``{"assets/benchmarks/NAME.svg": svg}`` for every valid record with rows."""
    return {f"{PLOT_DIR}/{name}.svg": plot(record) for name, (record, why) in records(folder).items()
            if record is not None and not why and record["rows"]}
