"""CPU accounting of ``benchmarks/peer.py`` (``--cpu-account``): where a training step's CPU goes, per process.

On a machine with fewer cores than busy threads, throughput is set by the CPU work of *all* processes per step
(trainers, parameter servers, their RPC and communication threads), not by one trainer's wall time alone. Trainer
0 snapshots every process of the run (the pids the driver publishes) at the start and at the end of the timed
steps; the difference, divided by the steps, gives per process kind (``trainer``, ``server``) and per thread:

- ``cpu_ms``: time on a CPU (``/proc/<pid>/task/<tid>/schedstat`` field 1, ns), summed over threads;
- ``wait_ms``: time runnable but not running, waiting for a core (schedstat field 2, the run-queue wait);
- ``switches``: context switches (voluntary + involuntary, ``/proc/<pid>/task/<tid>/status``): a thread that
  wakes and sleeps very often (polling) shows here;
- ``faults``: the process's minor page faults (``/proc/<pid>/stat`` field 10): memory the allocator returned to
  the kernel and touches again (each fault zeroes a page in the kernel);
- ``process_cpu_ms``: the process's user + system time (``/proc/<pid>/stat`` fields 14-15, clock ticks), which
  also counts threads that ended inside the window (a check of the per-thread sum; 10 ms resolution).

Threads are grouped by name (``/proc/<pid>/task/<tid>/comm``) with digits dropped (``pt_autograd_0`` ->
``pt_autograd_#``); the main thread (tid == pid) is ``main``. A thread alive at only one of the two snapshots
counts from zero (started inside the window) or not at all (ended inside it; only ``process_cpu_ms`` has it).

Source: proc(5) (``/proc/pid/stat``, ``/proc/pid/task``) and the kernel's ``Documentation/scheduler/sched-stats.rst``
(``/proc/<pid>/schedstat``: time on the cpu, time waiting on a runqueue, timeslices run).
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path

KINDS = ("trainer", "server")
_TICK_MS = 1e3 / os.sysconf("SC_CLK_TCK")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:   # the thread or process ended
        return None


def thread_group(name: str, main: bool) -> str:
    """The group a thread is counted in: ``main`` for the process's main thread, else its name with every run of
    digits replaced by ``#`` (``"pt_autograd_0"`` -> ``"pt_autograd_#"``)."""
    return "main" if main else re.sub(r"\d+", "#", name.strip()) or "?"


def snapshot(pids: dict[int, str]) -> dict:
    """``{pid: {"kind", "process_ticks", "faults", "threads": {tid: (group, cpu_ns, wait_ns, switches)}}}`` now, for
    ``pids`` (``{pid: kind}``); a process that is gone is left out."""
    out: dict[int, dict] = {}
    for pid, kind in pids.items():
        stat = _read(Path(f"/proc/{pid}/stat"))
        if stat is None:
            continue
        fields = stat[stat.rindex(")") + 2:].split()   # after "pid (comm) ": field 3 (state) is fields[0]
        threads = {}
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            base = Path(f"/proc/{pid}/task/{tid}")
            comm, sched, status = _read(base / "comm"), _read(base / "schedstat"), _read(base / "status")
            if comm is None or sched is None or status is None:
                continue
            run_ns, wait_ns = (int(x) for x in sched.split()[:2])
            switches = sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches:" in line)
            threads[tid] = (thread_group(comm, tid == pid), run_ns, wait_ns, switches)
        out[pid] = {"kind": kind, "process_ticks": int(fields[11]) + int(fields[12]), "faults": int(fields[7]),
                    "threads": threads}
    return out


def account(before: dict, after: dict, steps: int) -> dict:
    """Per step between two :func:`snapshot` s: ``{"kinds": {kind: {"processes", "cpu_ms", "wait_ms", "switches",
    "process_cpu_ms", "faults"}}, "threads": {(kind, group): {"threads", "cpu_ms", "wait_ms", "switches"}}}`` (sums over
    the processes of a kind and the threads of a group, divided by ``steps``).

    Raises:
        ValueError: ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError(f"account: steps must be >= 1, got {steps}")
    kinds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    threads: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for pid, end in after.items():
        start = before.get(pid)
        if start is None:
            continue
        k = kinds[end["kind"]]
        k["processes"] += 1
        k["process_cpu_ms"] += (end["process_ticks"] - start["process_ticks"]) * _TICK_MS / steps
        k["faults"] += (end["faults"] - start["faults"]) / steps
        for tid, (group, run_ns, wait_ns, switches) in end["threads"].items():
            _, run0, wait0, switches0 = start["threads"].get(tid, (group, 0, 0, 0))
            for target in (k, threads[(end["kind"], group)]):
                target["cpu_ms"] += (run_ns - run0) / 1e6 / steps
                target["wait_ms"] += (wait_ns - wait0) / 1e6 / steps
                target["switches"] += (switches - switches0) / steps
            threads[(end["kind"], group)]["threads"] += 1
    return {"kinds": {k: dict(v) for k, v in kinds.items()}, "threads": {k: dict(v) for k, v in threads.items()}}


def kinds_line(acc: dict, step_ms: float) -> str:
    """One system's kinds as ``trainer 2x 30.1 cpu / 4.2 wait, server 2x ...`` plus the cores busy per step."""
    parts, total = [], 0.0
    for kind in KINDS:
        k = acc["kinds"].get(kind)
        if k:
            total += k["cpu_ms"]
            parts.append(f"{kind} {k['cpu_ms']:6.1f} {k['wait_ms']:6.1f}")
    return "  ".join(parts) + f"  total {total:6.1f} ({total / step_ms:4.2f} cores)"


def thread_table(acc: dict, limit: int = 12) -> list[str]:
    """The thread groups using the most CPU, one line each: kind, group, threads, cpu, wait, switches per step."""
    rows = sorted(acc["threads"].items(), key=lambda kv: -kv[1]["cpu_ms"])[:limit]
    return [f"    {kind:<8} {group:<24} {int(v['threads']):>3} threads {v['cpu_ms']:7.2f} cpu ms {v['wait_ms']:6.2f} "
            f"wait ms {v['switches']:7.1f} switches" for (kind, group), v in rows]
