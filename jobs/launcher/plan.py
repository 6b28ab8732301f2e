"""The plan of a launch: what it decides before any trainer starts (a :class:`jobs.trainer.spec.JobPlan`).

:func:`make_plan` runs, before Ray starts, every check that needs no Ray (:func:`jobs.launcher.checks.check`), the
first pass over the Criteo data when there is a file (:func:`jobs.launcher.first_pass.first_pass`: each trainer's rows
and, with ``[model] table_sizes = "data"``, the per-feature table sizes, :func:`jobs.table_sizes.resolve`), the memory
estimate (:func:`jobs.launcher.checks.estimate_memory`) and the run folder (:func:`jobs.launcher.runs.choose`, not
created). When no Criteo file was found, the launcher generates synthetic data into the run folder once it exists and
completes the plan with :func:`with_data` (that first pass runs then).

The trainers get a :class:`jobs.trainer.spec.TrainerSpec`: the plan and the runtime handles.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

from jobs.config import JobConfig
from jobs.launcher import checks, runs
from jobs.launcher.first_pass import first_pass
from jobs.trainer.spec import JobPlan

__all__ = ["make_plan", "memory_estimate", "with_data"]


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
