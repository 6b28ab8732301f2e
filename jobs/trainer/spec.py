"""What every trainer of a job gets from the launcher: the launch's :class:`JobPlan` inside a :class:`TrainerSpec`.

The launcher makes the plan (:func:`jobs.launcher.plan.make_plan`) and, once Ray started, the spec: the plan and the
runtime handles (the JobState actor, the server actors, the metrics base port, the RPC host), passed as Ray Train's
``train_loop_config={"spec": spec}`` (Ray requires a dict there) and read by :func:`jobs.trainer.loop.train_loop`.
Both are frozen dataclasses of plain values, the config's entry points being ``"package.module:function"`` strings,
never callables: they pickle (cloudpickle, by reference to this module) and the config is not re-parsed on the
trainer. They live on the trainer side, below the launcher, so that the trainers never import the launcher.

Source: Ray Train ``TorchTrainer(train_loop_per_worker, train_loop_config)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.config import JobConfig
from jobs.records import TableSizes

if TYPE_CHECKING:
    from recsys.criteo_shard import DataPlan

__all__ = ["JobPlan", "TrainerSpec"]


@dataclass(frozen=True)
class JobPlan:
    """A launch's decisions, made before any trainer starts.

    ``config``: the job config with ``[model] table_sizes`` resolved (a list of 26 sizes when it was "data");
    ``run_dir``: the run folder (absolute; created by the launcher once Ray has started); ``data_path``: the
    Criteo data (a file, directory or glob), or None for your ``[data] batches`` and, until
    :func:`jobs.launcher.plan.with_data`, for synthetic data not generated yet; ``data_note``: where the data came from
    (for the log and results.json); ``data_plan``: the first pass (:class:`recsys.criteo_shard.DataPlan`: lines, rows
    per trainer, held-out rows), None for your batches; ``tables``: the table-size record for ``cardinalities.json``
    (distinct counts per feature, sizes) with ``table_sizes = "data"``, else None; ``resume``: the launch
    continues the run in ``run_dir``; ``local``: the job runs on this machine (no Ray cluster expected).
    """

    config: JobConfig
    run_dir: Path
    data_path: Path | None = None
    data_note: str = ""
    data_plan: DataPlan | None = None
    tables: TableSizes | None = None
    resume: bool = False
    local: bool = True

    @property
    def needs_data(self) -> bool:
        """The built-in model's Criteo data is still to be generated (:func:`jobs.launcher.plan.with_data`)."""
        return not self.config.user_model and self.data_path is None


@dataclass(frozen=True)
class TrainerSpec:
    """What every trainer of a job gets (:func:`jobs.trainer.loop.train_loop`): the :class:`JobPlan` and the runtime
    handles the launcher made once Ray started.

    ``state``: the launcher's :class:`jobs.launcher.state.JobState` actor (progress, results, deterministic errors);
    ``servers``: the parameter-server actor handles (``[cluster] parameter_servers`` of them,
    :func:`jobs.trainer.servers.start_servers`; empty without servers); ``metrics_port``: the exporters' base port
    (trainer rank ``r`` exports on ``metrics_port + r``), None without metrics; ``rpc_host``: the address the RPC
    group's rendezvous binds to, None to use the node's Ray address (on a cluster); ``servers_in_trainers``: the
    launcher chose servers inside the trainers' processes (:func:`jobs.hosting.choose_hosting`; ``servers`` is empty);
    ``auth_key``: the job's key for the ``socket`` transport's handshake (``scheduling.ps.transport.auth``), drawn by
    the launcher and handed over through Ray (kept out of the repr), None: the trainers' own; ``transport_tls``: the
    job's TLS credentials (``scheduling.ps.transport.tls.TLSCredentials``, ``[cluster] tls``), None: plain TCP.
    """

    plan: JobPlan
    state: Any
    servers: tuple[Any, ...] = field(default=())
    metrics_port: int | None = None
    rpc_host: str | None = None
    servers_in_trainers: bool = False
    auth_key: bytes | None = field(default=None, repr=False)
    transport_tls: Any = field(default=None, repr=False)

    @property
    def config(self) -> JobConfig:
        """The job config (table sizes resolved)."""
        return self.plan.config
