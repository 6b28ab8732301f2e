"""What a job reports of its optimized module: the passes run and, per parameter-server lookup, whether
``async_rpc_prefetch`` prefetches it and why not.

:func:`optimize_record` reads the module's ``meta["fxdist"]`` (the passes' own records: ``passes`` from
``fxdist.optimize``, ``prefetch.lookups`` from :mod:`scheduling.prefetch`) into the phase's ``optimize`` entry of
results.json; :func:`prefetch_lines` is that entry in the results table (:mod:`jobs.launcher.report`)::

    prefetch (async_rpc_prefetch): 1 of 2 lookups prefetched; 396 lookups answered by a prefetch
      item     prefetched      model.py:10
      cluster  NOT prefetched  model.py:9: its ids depend on the output of module 'proj' (server 0)

Source: torchrec ``TrainPipelineSparseDist`` (which batches' input distribution runs ahead).
"""

from __future__ import annotations

from typing import Any

from jobs.records import OptimizeRecord, PrefetchLookup
from jobs.results import PhaseResult

__all__ = ["optimize_record", "prefetch_lines"]


def optimize_record(gm: Any) -> OptimizeRecord:
    """``{"passes": [...]}`` of ``gm`` (a GraphModule from ``fxdist.optimize``), and ``"prefetch"``: ``{module
    path (or client): {"prefetched": bool, "reason": str | None, "where": "file:line" | None, "servers": [int]}}``
    when a prefetch pass ran (``gm.meta["fxdist"]["prefetch"]["lookups"]``)."""
    meta = getattr(gm, "meta", {}).get("fxdist", {})
    out: OptimizeRecord = {"passes": list(meta.get("passes", []))}
    lookups = meta.get("prefetch", {}).get("lookups")
    if lookups is not None:
        out["prefetch"] = {name: PrefetchLookup(**record) for name, record in lookups.items()}
    return out


def prefetch_lines(phase: PhaseResult) -> list[str]:
    """The results table's lines on the prefetch of a phase (its summary: ``optimize.prefetch`` and
    ``prefetched_lookups``, the lookups of all trainers answered by a prefetch); none when no prefetch pass ran."""
    lookups = (phase.get("optimize") or {}).get("prefetch")
    if lookups is None:
        return []
    done = sum(1 for r in lookups.values() if r.get("prefetched"))
    answered = phase.get("prefetched_lookups")
    lines = [f"prefetch (async_rpc_prefetch): {done} of {len(lookups)} lookups prefetched"
             + (f"; {answered} lookups answered by a prefetch" if answered is not None else "")]
    if not lookups:
        return [lines[0] + " (no table on the parameter servers)"]
    width = max(len(name) for name in lookups)
    for name, r in lookups.items():
        state = "prefetched" if r.get("prefetched") else "NOT prefetched"
        where = r.get("where") or "-"
        lines.append(f"  {name:<{width}}  {state:<14}  {where}" + ("" if r.get("prefetched") else f": {r.get('reason')}"))
    return lines
