"""The per-trainer training loop that Ray Train runs: baseline phase, optimized phase, checkpoints.

``train_loop({"spec": spec})`` is the ``train_loop_per_worker`` of the job's ``TorchTrainer`` (``spec``: a
:class:`jobs.trainer.spec.TrainerSpec`). It meets the model only through the seams of :mod:`jobs.trainer.protocols` (a
``Workload`` and its ``Tables``). Each trainer:

1. reads its shard of the data (:mod:`jobs.trainer.workload`: the Criteo reader, or your ``[data] batches``) and
   starts its metrics exporter;
2. sets up the embedding tables: in the trainer (DDP, sparse gradients) or on the parameter servers
   (``jobs.trainer.servers.ServerTables``, over ``[cluster] transport``: the ``parameter_servers`` pass moves the
   tables of each phase's model, the built-in torchrec DLRM or yours, there);
3. trains both phases over the same batches, interleaved (:mod:`jobs.trainer.phases`; each phase's step loop is a
   :class:`jobs.trainer.pipeline.TrainPipeline`): ``baseline`` trains the eager module (on servers:
   after only the ``parameter_servers`` pass, so its lookups block), ``optimized`` trains
   ``fxdist.optimize(model, passes)`` (both wrapped in DDP), each from the same
   initial weights with its own optimizer and its own tables; they alternate blocks of
   ``[phases] block_steps`` steps (the order flips every block), so both see the same machine load
   and the QPS gain is the median of paired block ratios (:func:`jobs.stats.interleaved_gain`);
4. checkpoints every ``checkpoint_every`` steps (both phases' dense weights, optimizer states and
   server tables in one Ray Train checkpoint, :mod:`jobs.trainer.checkpoints`) and at the end, so a restarted worker
   group resumes both phases at the same step;
5. measures the held-out AUC / log loss of each phase's model after ``[job] eval_epochs`` passes over
   its shard (:func:`jobs.trainer.evaluation.eval_step`; one epoch by default, where DLRM on Criteo is known to peak and
   longer training over-fits) and again at the end; for the last phase it keeps a copy of the
   evaluated model, which the launcher quantizes;
6. sends progress to the launcher's :class:`JobState` actor, and per-phase statistics at phase ends;
7. injects the configured faults (``[faults]``, :mod:`jobs.trainer.faults`).

Source: Ray Train ``TorchTrainer`` user guide (report / get_checkpoint); DLRM training recipe.
"""

from __future__ import annotations

import os

import torch

from jobs.deltas import MODEL_DIR
from jobs.stats import peak_rss_bytes
from jobs.trainer.checkpoints import load_checkpoint
from jobs.trainer.metrics import Exporter, tls_options
from jobs.trainer.phases import run_phases
from jobs.trainer.pipeline import PHASES
from jobs.trainer.spec import TrainerSpec
from jobs.trainer.workload import make_tables, make_workload
from jobs.user_code import user_error_frame


def _deterministic_errors() -> dict[type, str]:
    """Error types that a retry cannot fix -> the kind the launcher maps to an exit status."""
    from fxdist.errors import TraceError
    from jobs.config import ConfigError
    from recsys.criteo_format import DataError
    from scheduling.ps.safe_load import CheckpointRefused

    return {ConfigError: "config", DataError: "data", TraceError: "job", CheckpointRefused: "job"}


def train_loop(loop_config: dict[str, TrainerSpec]) -> None:
    """Ray Train entry point: run the job on this trainer, stopping for good on a deterministic error.

    ``loop_config``: ``{"spec": spec}`` (Ray Train's ``train_loop_config`` is a dict), ``spec`` the
    :class:`jobs.trainer.spec.TrainerSpec` every trainer of the job gets.

    A deterministic error (:func:`_deterministic_errors`: bad config or data, a model that does not trace, an
    exception raised in your own code or a loss of yours without gradient at ``loss.backward()``:
    :func:`jobs.user_code.user_error_frame`) is recorded on the launcher's JobState actor; with one trainer the
    loop then returns, so ``fit()`` ends without a retry; with more it re-raises (the other ranks may wait in a
    collective, and only a restart frees them), and every later attempt returns at once, seeing the recorded
    error. Ray Train's retries are thus left to process and node failures.
    """
    import ray
    import ray.train

    spec = loop_config["spec"]
    state = spec.state
    if ray.get(state.failure.remote()) is not None:
        return  # an earlier attempt hit a deterministic error: nothing to retry
    try:
        _train_loop(spec)
    except Exception as e:  # noqa: BLE001 - deterministic errors stop the job; the others are Ray Train's
        kind, message = next((k for t, k in _deterministic_errors().items() if isinstance(e, t)), None), str(e)
        if kind is None and (where := user_error_frame(e, spec.config)) is None:
            raise
        if kind is None:
            kind, message = "job", f"{e} (raised by your code at {where}; not retried)"
        ctx = ray.train.get_context()
        ray.get(state.fail.remote(kind, type(e).__name__, message, ctx.get_world_rank()))
        if ctx.get_world_size() > 1:
            raise


def _train_loop(spec: TrainerSpec) -> None:
    """Run every phase of the job on this trainer (``spec``: the launcher's plan and runtime handles)."""
    import ray
    import ray.train

    from jobs.cluster import serve_exporter, where

    config, state = spec.config, spec.state
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if rank == 0:
        state.event.remote("rank 0: training loop started")
    torch.set_num_threads(max(1, int(config.cluster.cpus_per_trainer)))
    exporter, bound = None, None
    if spec.metrics_port is not None:
        exporter = Exporter(config.job.name, rank)
        exporter.touch(PHASES)
        bound = serve_exporter(exporter, config.metrics.host, spec.metrics_port + rank, tls_options(config.metrics))
    state.placed.remote(f"trainer{rank}", where(bound))  # where this trainer and its exporter run
    data = str(spec.plan.data_path or "")
    wait = f"{data} has no more complete line for this trainer (polling every {config.data.follow_poll_s} s)"
    workload = make_workload(config, rank, world, data, plan=spec.plan.data_plan, exporter=exporter,
                             on_wait=lambda waiting: state.wait_for_data.remote(rank, wait if waiting else None))
    if rank == 0 and workload.parse is not None:
        state.parse_stats.remote(workload.parse, workload.rows)
    resume = load_checkpoint()
    tables = make_tables(config, rank, world, spec, exporter)
    if rank == 0:
        state.event.remote("rank 0: data loaded, tables ready")
    graceful = False
    try:
        run_phases(config, rank, world, workload, tables, resume, state, exporter,
                   model_dir=spec.plan.run_dir / MODEL_DIR)  # the model's deltas ([export] every_steps)
        graceful = True
    finally:
        tables.close(graceful=graceful)
        workload.close()
        if exporter is not None:
            exporter.close()
    ray.get(state.process_stats.remote(f"trainer{rank}", {"pid": os.getpid(), "peak_rss_bytes": peak_rss_bytes()}))

