"""What a launch decided before any trainer starts (:class:`JobPlan`), and what each trainer gets
(:class:`TrainerSpec`).

:func:`make_plan` runs, before Ray starts, every check that needs no Ray (:func:`jobs.launcher.preflight.check`), the
first pass over the Criteo data when there is a file (:func:`jobs.launcher.preflight.plan`: each trainer's rows and, with
``[model] table_sizes = "data"``, the per-feature table sizes, :func:`jobs.table_sizes.resolve`), the memory
estimate (:func:`jobs.launcher.preflight.estimate_memory`) and the run folder (:func:`jobs.launcher.runs.choose`, not created).
When no Criteo file was found, the launcher generates synthetic data into the run folder once it exists and
completes the plan with :func:`with_data` (that first pass runs then).

The trainers get a :class:`TrainerSpec`: the plan and the runtime handles (the JobState actor, the server
actors, the metrics base port, the RPC host), passed as Ray Train's ``train_loop_config={"spec": spec}`` (Ray
requires a dict there) and read by :func:`jobs.trainer.worker.train_loop`. Both are frozen dataclasses of plain values,
the config's entry points being ``"package.module:function"`` strings, never callables: they pickle
(cloudpickle, by reference to this module) and the config is not re-parsed on the trainer.

Source: Ray Train ``TorchTrainer(train_loop_per_worker, train_loop_config)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from jobs.config import JobConfig
from jobs.launcher import preflight, runs

if TYPE_CHECKING:
    from recsys.criteo_shard import DataPlan

__all__ = ["JobPlan", "TrainerSpec", "make_plan", "with_data"]


@dataclass(frozen=True)
class JobPlan:
    """A launch's decisions, made before any trainer starts.

    ``config``: the job config with ``[model] table_sizes`` resolved (a list of 26 sizes when it was "data");
    ``run_dir``: the run folder (absolute; created by the launcher once Ray has started); ``data_path``: the
    Criteo data (a file, directory or glob), or None for your ``[data] batches`` and, until :func:`with_data`,
    for synthetic data not generated yet; ``data_note``: where the data came from (for the log and results.json);
    ``data_plan``: the first pass (:class:`recsys.criteo_shard.DataPlan`: lines, rows per trainer, held-out rows),
    None for your batches; ``tables``: the table-size record for ``cardinalities.json`` (distinct counts per
    feature, sizes) with ``table_sizes = "data"``, else None; :attr:`memory`: the built-in model's memory estimate in
    bytes (:class:`jobs.launcher.preflight.MemoryEstimate`), None for your model (not estimated); ``resume``: the launch
    continues the run in ``run_dir``; ``local``: the job runs on this machine (no Ray cluster expected).
    """

    config: JobConfig
    run_dir: Path
    data_path: Path | None = None
    data_note: str = ""
    data_plan: DataPlan | None = None
    tables: dict[str, Any] | None = None
    resume: bool = False
    local: bool = True

    @property
    def memory(self) -> preflight.MemoryEstimate | None:
        """The built-in model's memory estimate (:func:`jobs.launcher.preflight.estimate_memory`), derived from
        :attr:`config` when asked; None for your model and while the table sizes are not resolved."""
        if self.config.user_model or self.config.model.table_sizes == "data":
            return None
        return preflight.estimate_memory(self.config)

    @property
    def needs_data(self) -> bool:
        """The built-in model's Criteo data is still to be generated (:func:`with_data`)."""
        return not self.config.user_model and self.data_path is None


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
    data_path = preflight.check(config, local=local, log=log)
    data_plan, record = None, None
    if data_path is not None and not config.user_model:  # the first pass: shares, per-feature table sizes
        config, data_plan, record = preflight.plan(config, data_path, local=local, log=log)
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
    config, data_plan, record = preflight.plan(config, data_path, local=plan.local, log=log)
    return replace(plan, config=config, data_path=data_path, data_note=note, data_plan=data_plan, tables=record)


@dataclass(frozen=True)
class TrainerSpec:
    """What every trainer of a job gets (:func:`jobs.trainer.worker.train_loop`): the :class:`JobPlan` and the runtime
    handles the launcher made once Ray started.

    ``state``: the launcher's :class:`jobs.launcher.state.JobState` actor (progress, results, deterministic errors);
    ``servers``: the parameter-server actor handles (``[cluster] parameter_servers`` of them,
    :func:`jobs.trainer.servers.start_servers`; empty without servers); ``metrics_port``: the exporters' base port (trainer rank ``r`` exports on
    ``metrics_port + r``), None without metrics; ``rpc_host``: the address the RPC group's rendezvous binds to,
    None to use the node's Ray address (on a cluster).
    """

    plan: JobPlan
    state: Any
    servers: tuple[Any, ...] = field(default=())
    metrics_port: int | None = None
    rpc_host: str | None = None

    @property
    def config(self) -> JobConfig:
        """The job config (table sizes resolved)."""
        return self.plan.config
