"""The plan of a launch: what it decides before any trainer starts (a :class:`jobs.trainer.spec.JobPlan`).

:func:`make_plan` runs, before Ray starts, every check that needs no Ray (:func:`jobs.launcher.checks.check`), the
first pass over the Criteo data when there is a file (:func:`jobs.launcher.first_pass.first_pass`: each trainer's rows
and, with ``[model] table_sizes = "data"``, the per-feature table sizes, :func:`jobs.table_sizes.resolve`), the memory
estimate (:func:`jobs.launcher.checks.estimate_memory`) and the run folder (:func:`jobs.launcher.runs.choose`, not
created). When no Criteo file was found, the launcher generates synthetic data into the run folder once it exists and
completes the plan with :func:`with_data` (that first pass runs then).

The trainers get a :class:`jobs.trainer.spec.TrainerSpec`: the plan and the runtime handles.

:func:`reshard_plan`: a ``--resume`` onto another number of parameter servers moves each phase's tables; the plan
says which server held each table and which will (the placement pass's rule on the new servers,
:func:`scheduling.placement.restore.replan`), printed by :func:`format_reshard`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

from jobs.config import JobConfig
from jobs.launcher import checks, runs
from jobs.launcher.first_pass import first_pass
from jobs.records import Reshard, TableMove, TablePlace
from jobs.results import JobResults
from jobs.trainer.spec import JobPlan

__all__ = ["make_plan", "memory_estimate", "with_data", "reshard_plan", "format_reshard"]


def memory_estimate(plan: JobPlan) -> checks.MemoryEstimate | None:
    """The built-in model's memory estimate in bytes (:func:`jobs.launcher.checks.estimate_memory`), derived from
    ``plan.config`` when asked; None for your model and while the table sizes are not resolved."""
    if plan.config.user_model or plan.config.model.table_sizes == "data":
        return None
    return checks.estimate_memory(plan.config)


def make_plan(config: JobConfig, run_dir: str | Path | None = None, *, resume: bool = False, local: bool = True,
              log: Callable[[str], None] | None = None) -> JobPlan:
    """Check ``config`` and plan the job, before Ray starts (see the module docstring); creates nothing.

    Args:
        run_dir: The run folder asked for (``--run-dir``), or None for ``<[job] run_dir>/<name>-<UTC timestamp>``.
        resume: Continue the interrupted or failed run in ``run_dir`` (:mod:`jobs.launcher.runs`).
        local: The job runs on this machine: ports and memory are checked here too.
        log: ``log(message)`` for what was checked, or None.

    Raises:
        ConfigError: a bad config, a taken port, not enough memory, or a run folder that holds a run (or cannot
            be resumed). recsys.criteo_format.DataError: the data file cannot be used.
    """
    data_path = checks.check(config, local=local, log=log)
    data_plan, record = None, None
    if data_path is not None and not config.user_model:  # the first pass: shares, per-feature table sizes
        config, data_plan, record = first_pass(config, data_path, local=local, log=log)
    plan = JobPlan(config, runs.choose(config, run_dir, resume=resume), data_path, data_plan=data_plan,
                   tables=record, resume=resume, local=local)
    if config.user_model:
        return replace(plan, data_note=f"your batches from {config.data.batches}, your model from "
                                       f"{config.model.factory}")
    return replace(plan, data_note=f"Criteo data from {data_path}") if data_path is not None else plan


def with_data(plan: JobPlan, *, log: Callable[[str], None] | None = None) -> JobPlan:
    """``plan`` with its data: when :attr:`JobPlan.needs_data`, synthetic Criteo-format data of ``[data]
    synthetic_rows`` rows generated into ``plan.run_dir`` (which must exist) and its first pass; else ``plan``.
    Logs where the data comes from (``data_note``), then the first pass.

    Raises:
        ConfigError: the resolved tables do not fit in memory. recsys.criteo_format.DataError: the file cannot be read.
    """
    log = log if log is not None else (lambda message: None)
    if not plan.needs_data:
        log(plan.data_note)
        return plan
    from jobs.launcher.data import resolve_data_path

    config = plan.config
    data_path, note = resolve_data_path("", plan.run_dir, config.data.synthetic_rows, seed=config.job.seed)
    log(note)
    config, data_plan, record = first_pass(config, data_path, local=plan.local, log=log)
    return replace(plan, config=config, data_path=data_path, data_note=note, data_plan=data_plan, tables=record)


def reshard_plan(previous: JobResults | None, config: JobConfig, *,
                 in_trainers: bool = False) -> Reshard | None:
    """The tables' move of a ``--resume`` onto another ``[cluster] parameter_servers`` count, or None when the count
    is unchanged (or the run had none).

    Args:
        previous: the resumed run's results (its ``config`` and ``table_layout``: phase -> ``"<path>"`` ->
            ``servers``, ``table``, ``module``, ``rows``, ``dim``, ``dynamic``).
        config: the resumed run's config, with the new ``[cluster] parameter_servers``.
        in_trainers: the new servers live in the trainers (:mod:`jobs.hosting`): named ``trainer<i>``, not ``ps<i>``
            (over ``[cluster] transport = "socket"`` they keep ``ps<i>``).

    Returns:
        ``{"from_servers", "to_servers", "tables": {phase: {"<path>": {"before": [names], "after": [names]}}}}``;
        ``tables`` is empty when the run recorded no layout (runs from before layouts were recorded).
    """
    from scheduling.placement.restore import replan

    config_then = (previous.get("config") if previous is not None else None) or {}
    old = int(config_then.get("cluster", {}).get("parameter_servers", 0))
    new = config.cluster.parameter_servers
    if old == new or not old or not new:
        return None
    rpc_names = in_trainers and config.cluster.transport != "socket"   # over sockets they stay ps<i>
    names = [f"{'trainer' if rpc_names else 'ps'}{i}" for i in range(new)]
    tables: dict[str, dict[str, TableMove]] = {}
    layouts: dict[str, dict[str, TablePlace]] = (previous.get("table_layout") if previous is not None else None) or {}
    for phase, layout in layouts.items():
        after = replan(layout, names)
        tables[phase] = {path: {"before": list(t["servers"]), "after": after[path]} for path, t in layout.items()}
    return {"from_servers": old, "to_servers": new, "tables": tables}


def format_reshard(plan: Reshard) -> str:
    """:func:`reshard_plan`'s record as text: a header, then per phase one line per table, ``old -> new`` servers.

    >>> print(format_reshard({"from_servers": 1, "to_servers": 2, "tables": {"baseline": {
    ...     "t_a": {"before": ["ps0"], "after": ["ps0"]}, "t_b": {"before": ["ps0"], "after": ["ps1"]}}}}))
    resharding the tables from 1 to 2 parameter servers (rows, optimizer state and dynamic id maps move whole)
      baseline:
        t_a  ps0 -> ps0  (stays)
        t_b  ps0 -> ps1
    """
    from scheduling.ps.reshard import format_moves

    lines = [f"resharding the tables from {plan['from_servers']} to {plan['to_servers']} parameter servers (rows, "
             "optimizer state and dynamic id maps move whole)"]
    if not plan["tables"]:
        lines.append("  (the run recorded no table layout: the placement pass prints the new one)")
    for phase, tables in plan["tables"].items():
        lines.append(f"  {phase}:")
        moves = format_moves({p: t["before"] for p, t in tables.items()}, {p: t["after"] for p, t in tables.items()})
        lines += ["  " + line for line in moves.splitlines()]
    return "\n".join(lines)
