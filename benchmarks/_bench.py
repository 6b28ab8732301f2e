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
