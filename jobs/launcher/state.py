"""The launcher's record of a job: the :class:`JobState` actor, shared by every trainer restart, and the
results.json fields made from its snapshots.

Source: Ray actors as shared state (Ray Core "Actors" guide).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TypedDict

from jobs.records import (
    CheckpointRecord,
    NodeLost,
    ParseRecord,
    ProcessStats,
    ServerJoin,
    TablePlace,
    TrainerFailure,
    Where,
)
from jobs.results import JobResults, PhaseResult
from recsys.criteo_format import ParseCounts

__all__ = ["JobState", "Snapshot", "seed_snapshot", "with_snapshot", "restart_count"]


class Snapshot(TypedDict, total=False):
    """What :meth:`JobState.snapshot` returns (all keys), or :func:`seed_snapshot` (the resumed run's part)."""

    progress: dict[str, int]
    """Phase -> its last step reported."""
    totals: dict[str, int]
    """Phase -> its steps."""
    starts: list[tuple[str, int]]
    """(phase, step) of every phase start."""
    results: dict[str, PhaseResult]
    """The phases finished."""
    fired: list[str]
    parse: ParseRecord | None
    checkpoints: list[CheckpointRecord]
    restores: list[CheckpointRecord]
    events: list[tuple[float, str]]
    server_joins: list[list[ServerJoin]]
    placement: dict[str, Where]
    table_layout: dict[str, dict[str, TablePlace]]
    nodes_lost: list[NodeLost]
    processes: dict[str, ProcessStats]
    error: TrainerFailure | None
    waiting: dict[int, str]
    """Rank -> what it waits for (``[data] follow``: the trainer has read all the data there is), while it waits."""


class JobState:
    """Driver-owned actor: progress, phase results, fault markers and a deterministic error, shared by all
    trainer restarts.

    ``previous``: the results of an interrupted or failed run being resumed (:func:`jobs.launcher.runs.read_results`; a
    dict of the same keys is read by :meth:`JobResults.from_json`); its finished phases, checkpoints, fired faults
    and timeline carry over (not its error).

    Raises:
        jobs.results.ResultsError: a ``previous`` dict that does not fit the results schema.
    """

    def __init__(self, previous: JobResults | None = None) -> None:
        prev = JobResults.from_json(previous) if previous is not None else _EMPTY
        self.progress_steps: dict[str, int] = {}
        self.totals: dict[str, int] = {}
        self.starts: list[tuple[str, int]] = [(str(x[0]), int(x[1])) for x in (prev.starts or [])]
        self.results: dict[str, PhaseResult] = dict(prev.phases)
        self.fired: set[str] = set(prev.faults_fired or [])
        self.parse: ParseRecord | None = (prev.data or {}).get("parse")
        self.t0 = time.time()
        self.events: list[tuple[float, str]] = [(float(x[0]), str(x[1])) for x in (prev.timeline or [])]
        self.checkpoints: list[CheckpointRecord] = list(prev.checkpoints or [])
        self.restores: list[CheckpointRecord] = list(prev.restores or [])
        self.server_joins: list[list[ServerJoin]] = list(prev.server_joins or [])
        self.placement: dict[str, Where] = {}
        self.table_layout: dict[str, dict[str, TablePlace]] = {}
        self.nodes_lost: list[NodeLost] = list(prev.nodes_lost or [])
        self.processes: dict[str, ProcessStats] = dict(prev.processes or {})
        self.error: TrainerFailure | None = None
        self.waiting: dict[int, str] = {}
        if previous is not None:
            self.event(f"launcher: resuming a run that was {prev.status or 'unknown'}")

    def fail(self, kind: str, error_type: str, message: str, rank: int) -> None:
        """A trainer hit a deterministic error (``kind``: "config", "data" or "job"); the first one is kept
        and every later attempt of the worker group stops at once (:func:`jobs.trainer.loop.train_loop`)."""
        if self.error is None:
            self.error = {"kind": kind, "type": error_type, "message": message, "rank": rank}
            self.event(f"rank {rank}: {error_type}: {message}")

    def failure(self) -> TrainerFailure | None:
        """The deterministic error recorded by :meth:`fail`, or None."""
        return self.error

    def fire(self, fault: str) -> bool:
        """True the first time ``fault`` is asked for, False afterwards."""
        if fault in self.fired:
            return False
        self.fired.add(fault)
        return True

    def event(self, what: str) -> None:
        """Record ``what`` with the seconds since the job started (the report's timeline)."""
        self.events.append((round(time.time() - self.t0, 3), what))

    def checkpointed(self, phase: str, step: int, model_digest: str, tables_digest: str) -> None:
        """A checkpoint was written: digests of its dense weights and server tables."""
        self.checkpoints.append({"phase": phase, "step": step, "model": model_digest, "tables": tables_digest})
        self.event(f"checkpoint {phase} step {step}")

    def restored(self, phase: str, step: int, model_digest: str, tables_digest: str) -> None:
        """A restarted worker group loaded a checkpoint: digests of what the model and servers now hold."""
        self.restores.append({"phase": phase, "step": step, "model": model_digest, "tables": tables_digest})
        self.event(f"restored {phase} step {step}")

    def placed(self, name: str, info: Where) -> None:
        """``name`` (``trainer<r>`` or ``ps<i>``) runs where ``info`` says (:func:`jobs.cluster.where`); the
        latest report wins (a restarted process may run elsewhere)."""
        self.placement[name] = info.copy()

    def tables_placed(self, phase: str, layout: dict[str, TablePlace]) -> None:
        """Rank 0's ``parameter_servers`` pass placed ``phase``'s tables: ``{"<path>": {"servers", "table", "module",
        "rows", "dim", "dynamic"}}`` (:func:`scheduling.placement.restore.table_layout`); the latest report wins."""
        self.table_layout[phase] = dict(layout)

    def node_lost(self, lost: NodeLost) -> None:
        """A node that ran some of the job's processes died: ``{"node_id", "address", "ran": [names]}``
        (:class:`jobs.cluster.NodeWatch`); Ray Train and Ray restart them on the remaining nodes."""
        self.nodes_lost.append(lost.copy())
        self.event(f"launcher: node {lost.get('address')} ({str(lost.get('node_id'))[:8]}) died; it ran "
                   + ", ".join(lost.get("ran", [])))

    def process_stats(self, name: str, stats: ProcessStats) -> None:
        """What process ``name`` (``trainer<r>``, ``ps<i>``) measured at its end: ``pid``, ``peak_rss_bytes``
        (and a server's ``rows`` / ``bytes`` held); the latest report wins."""
        self.processes[name] = stats.copy()

    def servers_joined(self, joined: list[ServerJoin]) -> None:
        """A worker group's rank 0 had every server actor join its RPC group: ``[{"pid", "group"}, ...]``."""
        self.server_joins.append(joined)
        self.event("servers joined: " + ", ".join(f"ps{i} pid {j['pid']} group {j['group']}"
                                                  for i, j in enumerate(joined)))

    def parse_stats(self, stats: ParseCounts, rows: int) -> None:
        self.parse = {**stats, "rank0_rows": rows}

    def phase_started(self, phase: str, start: int, total: int) -> None:
        self.starts.append((phase, start))
        self.event(f"{phase} phase started at step {start}")
        self.totals[phase] = total
        self.progress_steps[phase] = start

    def progress(self, phase: str, step: int) -> None:
        self.progress_steps[phase] = step

    def wait_for_data(self, rank: int, what: str | None) -> None:
        """Trainer ``rank`` waits for data (``[data] follow``): ``what`` it waits for, or None when data came again.
        The timeline records the first wait of each rank only (a trickle of data would add one event per poll)."""
        if what is None:
            self.waiting.pop(rank, None)
            return
        if not any(f"rank {rank}: waiting for data" in e for _, e in self.events):
            self.event(f"rank {rank}: waiting for data: {what}")
        self.waiting[rank] = what

    def phase_done(self, phase: str, summary: PhaseResult) -> None:
        """Keep the phase's summary; one that covers more of the phase (an earlier ``resumed_from_step``)
        is kept instead: a restart after ``phase_done`` but before the phase's final checkpoint was
        registered re-runs only the phase's last steps."""
        kept = self.results.get(phase)
        if kept is not None and (kept.resumed_from_step or 0) < (summary.resumed_from_step or 0):
            self.event(f"{phase} phase done again (from step {summary.resumed_from_step}); "
                       f"kept the result from step {kept.resumed_from_step or 0}")
        else:
            self.results[phase] = summary
            self.event(f"{phase} phase done")
        self.progress_steps[phase] = self.totals.get(phase, summary.steps or 0)

    def snapshot(self) -> Snapshot:
        return {"progress": dict(self.progress_steps), "totals": dict(self.totals), "starts": list(self.starts),
                "results": dict(self.results), "fired": sorted(self.fired), "parse": self.parse,
                "checkpoints": list(self.checkpoints), "restores": list(self.restores), "events": list(self.events),
                "server_joins": list(self.server_joins), "placement": dict(self.placement),
                "table_layout": dict(self.table_layout),
                "nodes_lost": list(self.nodes_lost), "processes": dict(self.processes), "error": self.error,
                "waiting": dict(self.waiting)}


def seed_snapshot(previous: JobResults | None) -> Snapshot:
    """A :meth:`JobState.snapshot` as the results ``previous`` of a resumed run left it."""
    prev = previous or _EMPTY
    return {"results": dict(prev.phases), "parse": (prev.data or {}).get("parse"),
            "fired": prev.faults_fired or [], "checkpoints": prev.checkpoints or [], "restores": prev.restores or [],
            "events": [(float(e[0]), str(e[1])) for e in prev.timeline or []],
            "starts": [(str(s[0]), int(s[1])) for s in prev.starts or []], "server_joins": prev.server_joins or [],
            "nodes_lost": prev.nodes_lost or [], "processes": prev.processes or {}}


_EMPTY = JobResults(job=None, config={}, phases={})
"""No previous run."""


def with_snapshot(results: JobResults, snap: Snapshot) -> JobResults:
    """``results`` plus what the JobState snapshot says (phases finished, checkpoints, timeline...)."""
    return dataclasses.replace(
        results, data={**(results.data or {}), "parse": snap.get("parse")}, phases=snap.get("results", {}),
        restarts=restart_count(snap), faults_fired=snap.get("fired", []), checkpoints=snap.get("checkpoints", []),
        restores=snap.get("restores", []), timeline=[list(e) for e in snap.get("events", [])],
        starts=[list(s) for s in snap.get("starts", [])], server_joins=snap.get("server_joins", []),
        placement=snap.get("placement", {}), table_layout=snap.get("table_layout", {}),
        nodes_lost=snap.get("nodes_lost", []), processes=dict(snap.get("processes", {})))


def restart_count(snap: Snapshot) -> int:
    """Worker-group restarts seen: starts of a phase beyond its first (every restart starts every phase)."""
    seen: dict[str, int] = {}
    for phase, _ in snap.get("starts", []):
        seen[phase] = seen.get(phase, 0) + 1
    return max((n - 1 for n in seen.values()), default=0)
