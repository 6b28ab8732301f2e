"""Start-up and timing shared by the benchmark scripts.

glibc reads its allocator settings at process start only, so a benchmark that wants them fixed
(with default settings the allocator's page faults dominate batch timings: 11-14 % of eager batch-8 latency)
re-executes itself once with them set. Scripts import this module as ``_bench`` (their own folder is on ``sys.path``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Callable

ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "33554432"}


def reexec_with_fixed_allocator(extra_env: dict[str, str] | None = None) -> None:
    """Re-execute this script with :data:`ALLOCATOR_ENV` (and ``extra_env``) unless already set."""
    want = {**ALLOCATOR_ENV, **(extra_env or {})}
    if any(os.environ.get(k) != v for k, v in want.items()):
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **want})


def median_ms(fn: Callable[[Any], Any], x: Any, budget_s: float, min_calls: int = 3) -> float:
    """Median milliseconds per ``fn(x)`` over as many calls as fit in ``budget_s`` (at least ``min_calls``)."""
    times = []
    start = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


# --- the benchmarks' JSON record (``--json PATH``), read by docs/gen_benchmarks.py for the Benchmarks page ---

RECORD_FORMAT = "fxdist-benchmark/1"
"""The ``format`` field of a record; docs/gen_benchmarks.py renders the records of this format."""
INT8_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile", "amx_int8")
"""The /proc/cpuinfo flags that decide int8 speed (FBGEMM/oneDNN kernels: AVX2, AVX-512, VNNI dot products, AMX)."""


def isa_summary(flags: set[str]) -> str:
    """The widest int8 path these flags offer, e.g. ``"AVX-512 VNNI + AMX-INT8"`` or ``"AVX2, no VNNI"``."""
    if flags & {"avx512_vnni", "avx512vnni"}:
        isa = "AVX-512 VNNI"
    elif "avx_vnni" in flags:
        isa = "AVX-VNNI"
    elif "avx512f" in flags:
        isa = "AVX-512, no VNNI"
    else:
        isa = "AVX2, no VNNI" if "avx2" in flags else "no AVX2"
    return f"{isa} + AMX-INT8" if "amx_int8" in flags else isa


def machine(cpuinfo: str = "/proc/cpuinfo") -> dict[str, Any]:
    """The machine a record was measured on: CPU model, cores, the int8 ISA flags present, torch's version."""
    try:
        lines = open(cpuinfo).read().splitlines()
    except OSError:
        lines = []
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "unknown CPU")
    flags = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
    import torch

    return {"cpu": model, "cores": os.cpu_count(), "isa": isa_summary(flags) if flags else "unknown",
            "flags": [f for f in INT8_FLAGS if f in flags], "torch": torch.__version__,
            "threads": torch.get_num_threads()}


class Record:
    """One run's measured rows, written as JSON by :meth:`write` (``--json PATH``).

    Groups are the tables of the record: each names its peer (``"torch.fx"``, ``"eager fp32"``...), the unit of
    its rows and whether a lower value is better. A row holds fxdist's and the peer's value, the ratio fxdist /
    peer (as the script prints it: a median of per-round ratios, or a ratio of medians) and its spread
    (``[min, max]`` of the per-round ratios, rounds paired as they ran; None where not paired).
    """

    def __init__(self, benchmark: str, title: str, settings: dict[str, Any] | None = None) -> None:
        self.data: dict[str, Any] = {
            "format": RECORD_FORMAT, "benchmark": benchmark, "title": title,
            "command": " ".join([".venv/bin/python", os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "settings": dict(settings or {}),
            "load_start": list(os.getloadavg()), "groups": [], "rows": [], "notes": []}

    def group(self, key: str, title: str, peer: str, unit: str, lower_is_better: bool = True) -> None:
        """Declare a table: its ``key`` (rows name it), title, peer, unit of the values, direction."""
        self.data["groups"].append({"key": key, "title": title, "peer": peer, "unit": unit,
                                    "lower_is_better": lower_is_better})

    def row(self, group: str, name: str, fxdist: float, peer: float, ratio: float | None = None,
            spread: list[float] | None = None) -> None:
        """Add a measured row of ``group``; ``ratio`` defaults to ``fxdist / peer``."""
        self.data["rows"].append({"group": group, "name": name, "fxdist": fxdist, "peer": peer,
                                  "ratio": fxdist / peer if ratio is None else ratio,
                                  "spread": None if spread is None else [min(spread), max(spread)]})

    def note(self, text: str) -> None:
        """A line printed under the record's tables (a setting, an accuracy figure)."""
        self.data["notes"].append(text)

    def write(self, path: str | None) -> None:
        """Write the record to ``path`` (nothing when None), with the machine and the load at the end."""
        if path is None:
            return
        import json

        self.data["machine"] = machine()
        self.data["load_end"] = list(os.getloadavg())
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.data, f, indent=1, ensure_ascii=False)
            f.write("\n")
        print(f"record written to {path}")


def paired(ours: list[float], theirs: list[float]) -> list[float]:
    """Per-round ratios ``ours[i] / theirs[i]`` of two interleaved series."""
    return [a / b for a, b in zip(ours, theirs)]
