"""``fxdist launch``: run a job on Ray (local or a cluster) and collect its results.

:func:`launch` does, in order:

1. plans the job (:func:`jobs.launcher.plan.make_plan`, a :class:`jobs.trainer.spec.JobPlan`): every check that needs no
   Ray (:mod:`jobs.launcher.checks`: config ranges, passes, the data file, and on this machine free metrics ports and
   enough memory), the first pass over the data (table sizes), and the run folder, not created yet
   (:mod:`jobs.launcher.runs`: a run is never overwritten; ``--resume`` continues an interrupted or failed one, or a
   completed one for more steps, possibly on another number of servers: :func:`jobs.launcher.plan.reshard_plan`);
2. joins Ray: an already initialised session, else ``[cluster] address``, else ``$RAY_ADDRESS``,
   else a local ``ray.init()``; then creates the run folder ``<run_dir>/<name>-<UTC timestamp>/`` (with
   generated Criteo-format data when no file was found) and a ``results.json`` saying ``"running"``;
3. writes Prometheus file-based service discovery (``prometheus/targets.json``) and a ready-to-run
   ``prometheus/prometheus.yml`` (from ``dashboards/``) into the run folder;
4. runs the trainers with Ray Train's ``TorchTrainer`` (DDP over gloo on CPU, nccl on GPU;
   ``FailureConfig(max_failures)`` restarts the worker group from the last checkpoint), after starting
   the parameter servers as Ray actors (:func:`jobs.trainer.servers.start_servers`; each worker group's rank 0 has
   them join its ``torch.distributed.rpc`` group, see :mod:`jobs.trainer.servers`; they are killed when the job ends,
   also on errors and Ctrl-C); each trainer gets a :class:`jobs.trainer.spec.TrainerSpec` (the plan and those
   handles); the trainers report to a :class:`JobState` actor, which the launcher polls for its progress display;
5. quantizes the dense layers of the last phase's model that the AUC refers to (after ``[job] eval_epochs``,
   see :func:`jobs.trainer.evaluation.eval_step`) and compares fp32 with int8 (:mod:`jobs.launcher.inference`:
   ``quant.select_int8`` for the built-in DLRM and for your model alike);
6. writes the trained model into ``model/`` (:mod:`jobs.launcher.model_export`: its state dict, torch.export
   programs, a sample input and ``model.json``), then ``results.json`` and ``qps.png``, and prints the results table
   (:mod:`jobs.launcher.report`).

A deterministic error in a trainer (bad config or data, a model that does not trace) is recorded on the
:class:`JobState` actor and ends the job on the first attempt (:func:`jobs.trainer.loop.train_loop`); the
launcher raises it (exit status 2 for config and data, 1 otherwise). Ray Train's retries
(``max_failures``) are for process and node failures. Whatever ends the job, ``results.json`` says how:
``"completed"``, ``"interrupted"`` or ``"failed"``, with the phases finished so far (:mod:`jobs.launcher.runs`).

Source: Ray Train (TorchTrainer, ScalingConfig, RunConfig, FailureConfig, CheckpointConfig).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypedDict

from jobs import table_sizes
from jobs.config import ConfigError, JobConfig, to_dict
from jobs.hosting import Hosting
from jobs.launcher import runs
from jobs.launcher.plan import make_plan, with_data
from jobs.launcher.prometheus import retarget, write_prometheus_files
from jobs.launcher.state import JobState, Snapshot, seed_snapshot, with_snapshot
from jobs.records import (
    Checkpoint,
    DataRecord,
    Gain,
    ModelState,
    Parity,
    ProcessStats,
    Reshard,
    TableSizes,
    TrainerFailure,
    Where,
)
from jobs.results import ABSENT, InferenceResult, JobResults, PhaseResult
from jobs.stats import peak_rss_bytes
from jobs.trainer.spec import JobPlan, TrainerSpec
from recsys.criteo_format import DataError
from scheduling.ps.safe_load import safe_load

if TYPE_CHECKING:
    from jobs.launcher.inference import Int8Keep

__all__ = ["launch", "JobState", "JobFailed", "ParityError", "compare_phases"]



def _join_ray(config: JobConfig, *, log: Any) -> tuple[bool, bool]:
    """Initialise Ray if needed; returns (this call started Ray, Ray spans a cluster)."""
    import ray

    address = config.cluster.address or os.environ.get("RAY_ADDRESS", "")
    if ray.is_initialized():
        return False, bool(address) and len(ray.nodes()) > 1
    if address:
        from jobs.cluster import SETUP_HOOK

        log(f"joining the Ray cluster at {address}")
        # every worker process sets GLOO_SOCKET_IFNAME / TP_SOCKET_IFNAME to its node's interface on start
        ray.init(address=address, log_to_driver=False, runtime_env={"worker_process_setup_hook": SETUP_HOOK})
        return True, True
    log("starting Ray locally (set RAY_ADDRESS or [cluster] address to use a cluster)")
    from recsys.quiet import RAY_TOKEN_AUTH_ENABLED, RAY_TOKEN_AUTH_LOGGER, drop_log_records

    drop_log_records(RAY_TOKEN_AUTH_LOGGER, RAY_TOKEN_AUTH_ENABLED)  # our own local cluster (token auth stays on)
    ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)  # no "Started a local Ray"
    return True, False


def check_gpus(config: JobConfig, resources: dict[str, float] | None = None) -> None:
    """With ``[cluster] use_gpu``: the Ray cluster must offer one GPU per trainer, else Ray Train would wait for
    them forever. ``resources``: ``ray.cluster_resources()`` (read when None).

    Raises:
        ConfigError: fewer GPUs than ``[cluster] trainers`` (nothing was started; the message says both counts).
    """
    c = config.cluster
    if not c.use_gpu:
        return
    if resources is None:
        import ray

        resources = ray.cluster_resources()
    gpus = resources.get("GPU", 0.0)
    if gpus < c.trainers:
        raise ConfigError(f"{config.source}: [cluster] use_gpu = true needs one GPU per trainer (trainers = "
                          f"{c.trainers}), but the Ray cluster offers {gpus:g} GPU(s); set use_gpu = false to train "
                          "on CPUs, or join a cluster with GPUs ([cluster] address)")


def _fit(trainer, box: FitBox) -> None:
    try:
        box.result = trainer.fit()
    except BaseException as e:  # re-raised in the launching thread
        box.error = e


@dataclass
class FitBox:
    """What the fit thread leaves: Ray Train's ``Result``, or the exception it raised."""

    result: Any = None
    error: BaseException | None = None


@dataclass
class JobStateWatch:
    """The launcher's watch over a running job's JobState actor (:class:`jobs.launcher.state.JobState`): its last
    snapshot, what to do when it changes, the nodes lost; kept between the launch's steps (:func:`launch`,
    :func:`_train`, :func:`_follow`)."""

    previous: JobResults | None = None
    """The resumed run's results (``--resume``), else None."""
    snap: Snapshot = field(default_factory=lambda: Snapshot())
    """The last JobState snapshot (:meth:`jobs.launcher.state.JobState.snapshot`): what an interrupted launch
    reports."""
    on_change: Callable[[Snapshot], object] = lambda snap: None
    """Runs with the snapshot when a phase has finished, a checkpoint was written or an event recorded."""
    on_placement: Callable[[Snapshot], None] = lambda snap: None
    """Runs with the snapshot when the exporters' placement changed (rewrites targets.json)."""
    placement: dict[str, Where] = field(default_factory=dict)
    """The last placement seen (``snap["placement"]``: process name -> where it runs)."""
    nodes: Any = None
    """A :class:`jobs.cluster.NodeWatch` on a cluster (each node lost goes to the JobState), else None."""
    warned: set[str] = field(default_factory=set)
    """Exporters already reported as unreachable from here (warned once each)."""


def _follow(state, box: FitBox, thread: threading.Thread, show: bool, watch: JobStateWatch) -> Snapshot:
    """Poll the JobState actor and update the progress display (:class:`jobs.launcher.progress.Progress`: one bar on a
    terminal, plain lines otherwise) until the fit thread ends.

    Each snapshot goes to ``watch.snap``; ``watch.on_change(snap)`` runs when a phase has finished, a checkpoint
    was written or an event recorded since the last poll, ``watch.on_placement(snap)`` when the placement changed.
    With ``watch.nodes`` (on a cluster) each node lost goes to the JobState.
    """
    import ray

    from jobs.launcher.progress import Progress

    progress = Progress() if show else None
    snap: Snapshot = watch.snap
    seen = _milestones(snap)
    try:
        while True:
            alive = thread.is_alive()
            try:
                snap = watch.snap = ray.get(state.snapshot.remote(), timeout=10)
            except Exception:  # a slow actor must not kill the job
                pass
            if _milestones(snap) != seen:
                seen = _milestones(snap)
                watch.on_change(snap)
            for lost in watch.nodes.poll(snap.get("placement", {})) if watch.nodes is not None else ():
                state.node_lost.remote(lost)  # noted; Ray Train restarts the worker group meanwhile
            if snap.get("placement", {}) != watch.placement:
                watch.placement = snap.get("placement", {})
                watch.on_placement(snap)
            if progress is not None:
                progress.update(snap)
            if not alive:
                break
            thread.join(timeout=0.5)
    finally:
        if progress is not None:
            progress.close()
    return snap


def _milestones(snap: Snapshot) -> tuple[tuple[str, ...], int, int]:
    """Phases finished, checkpoints and timeline events so far: results.json is rewritten when they change."""
    return tuple(sorted(snap.get("results", {}))), len(snap.get("checkpoints", [])), len(snap.get("events", []))


def _trainer(config: JobConfig, spec: TrainerSpec, run_dir: Path):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from jobs.cluster import set_train_poll, trainer_strategy
    from jobs.trainer.loop import train_loop

    set_train_poll()  # Ray Train's controller notices a job's end, a dead trainer, a checkpoint sooner
    c = config.cluster
    return TorchTrainer(
        train_loop,
        train_loop_config={"spec": spec},  # Ray Train takes a dict
        torch_config=TorchConfig(backend="nccl" if c.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=c.trainers, use_gpu=c.use_gpu,
                                     resources_per_worker={"CPU": c.cpus_per_trainer},
                                     placement_strategy=trainer_strategy(c.placement)),
        run_config=RunConfig(
            name="train", storage_path=str((run_dir / "ray").resolve()),
            failure_config=FailureConfig(max_failures=config.job.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )


def launch(config: JobConfig, *, run_dir: str | Path | None = None, quiet: bool = False,
           resume: bool = False) -> JobResults:
    """Run the job described by ``config`` and return its results (also written to ``results.json``).

    Every check that needs no Ray runs first (:func:`jobs.launcher.plan.make_plan`: :func:`jobs.launcher.checks.check`,
    the first pass over the data, :func:`jobs.launcher.runs.choose`); the run folder is created only once they pass and
    Ray has started.

    Args:
        config: The job config.
        run_dir: The run folder; default ``<[job] run_dir>/<name>-<UTC timestamp>``. It must not hold a
            run yet, unless ``resume`` (see :mod:`jobs.launcher.runs`).
        quiet: No progress display or table (tests).
        resume: Continue the interrupted or failed run in ``run_dir`` from its last checkpoint (``config``
            should be :func:`jobs.launcher.runs.load_config` of it).

    Returns:
        The :class:`jobs.results.JobResults` written to results.json, with ``status`` ``"completed"``.

    Raises:
        ConfigError: a bad config, a taken port, not enough memory, a run folder that holds a run (or
            cannot be resumed), or a trainer's deterministic config error; nothing was started or retried.
        recsys.criteo_format.DataError: the data cannot be used (found before Ray starts, or by a trainer).
        JobFailed: a trainer's deterministic error of another kind (e.g. a model that does not trace).
        ray.train.TrainingFailedError (or the trainer's exception): training failed more than
            ``max_failures`` times; the run folder keeps the logs and checkpoints.
        KeyboardInterrupt: Ctrl-C; results.json then says ``"status": "interrupted"``.
    """
    log = (lambda msg: None) if quiet else (lambda msg: print(f"[fxdist] {msg}", flush=True))
    plan = make_plan(config, run_dir, resume=resume, local=not _expect_cluster(config), log=log)
    run_dir, previous = plan.run_dir, runs.read_results(plan.run_dir) if resume else None
    started_ray, on_cluster = _join_ray(plan.config, log=log)
    try:
        hosting = _hosting(plan.config, log)  # on the CPUs Ray offers
        reshards = _resume_record(run_dir, previous, plan.config, log, hosting.in_trainers)
    except BaseException:
        if started_ray:
            import ray

            ray.shutdown()
        raise
    if previous is not None and runs.status_of(previous) == "completed":  # continued for more steps
        previous = dataclasses.replace(previous, phases={})
    watch = JobStateWatch(previous=previous)
    results = JobResults(job=config.job.name, config=to_dict(plan.config), phases={}, status="running",
                         config_source=config.source, run_dir=str(run_dir),
                         launcher={"pid": os.getpid(), "host": socket.gethostname()},
                         resumes=((previous.resumes or 0) if previous else 0) + (1 if resume else 0),
                         reshards=reshards or ABSENT,
                         servers_in_trainers=hosting.to_json() if plan.config.cluster.parameter_servers else ABSENT)
    try:
        try:
            check_gpus(plan.config)
            run_dir.mkdir(parents=True, exist_ok=True)
            plan = with_data(plan, log=log)
            config, data_path = plan.config, plan.data_path
            results = _record_data(plan, results)
            watch.on_change = lambda snap: runs.write(run_dir, with_snapshot(results, snap))
            runs.write(run_dir, with_snapshot(results, seed_snapshot(previous)))
            snap, final, train_seconds = _train(plan, on_cluster, quiet=quiet, log=log, watch=watch,
                                                in_trainers=hosting.in_trainers)
        finally:
            if started_ray:
                import ray

                ray.shutdown()
        results = with_snapshot(results, snap)
        compared = compare_phases(config, results.phases)
        results = dataclasses.replace(results, status="completed", train_seconds=train_seconds,
                                      gain=compared.get("gain", ABSENT), parity=compared.get("parity", ABSENT))
        results = _after_training(config, final, results, run_dir, data_path, log)  # int8 stage, then RUN_DIR/model/
        launcher: ProcessStats = {"pid": os.getpid(), "peak_rss_bytes": peak_rss_bytes()}
        processes = {**(results.processes or {}), "launcher": launcher}
        results = dataclasses.replace(results, processes=processes)
    except BaseException as e:
        if run_dir.is_dir():
            _record_end(run_dir, results, watch, e)
        raise
    return _report(config, results, run_dir, quiet, log)


def _hosting(config: JobConfig, log: Any) -> Hosting:
    """Where the servers run (:func:`jobs.hosting.choose_hosting`, on the CPUs Ray offers), logged with the reason."""
    from jobs.hosting import AUTO, choose_hosting, job_cpus

    hosting = choose_hosting(config, job_cpus() if config.cluster.servers_in_trainers == AUTO else None)
    if config.cluster.parameter_servers:
        log(f"parameter servers: {hosting.reason}")
    return hosting


def _resume_record(run_dir: Path, previous: JobResults | None, config: JobConfig, log: Any,
                   in_trainers: bool = False) -> list[Reshard]:
    """On ``--resume``: the run's reshards so far plus this one's (:func:`jobs.launcher.plan.reshard_plan`, printed;
    ``in_trainers``: onto servers in the trainers), and a completed run's results.json kept as
    ``results.<resumes>.json`` before it is continued."""
    from jobs.launcher.plan import format_reshard, reshard_plan

    if previous is None:
        return []
    if runs.status_of(previous) == "completed":
        kept = run_dir / f"results.{previous.resumes or 0}.json"
        kept.write_text((run_dir / runs.RESULTS).read_text())
        log(f"continuing the completed run ({previous.config['job']['steps']} steps) to {config.job.steps} steps; "
            f"its results are kept in {kept}")
    record = reshard_plan(previous, config, in_trainers=in_trainers)
    if record is None:
        return list(previous.reshards or [])
    log(format_reshard(record))
    return [*(previous.reshards or []), record]


def _report(config: JobConfig, results: JobResults, run_dir: Path, quiet: bool, log: Any) -> JobResults:
    """Write results.json and the plot, print the table and return the results written; raise
    :class:`ParityError` (``[phases] parity = "error"``) when the optimized phase did not train like the baseline."""
    from jobs.launcher import report

    typed = report.write(dataclasses.replace(JobResults.from_json(results), launcher=ABSENT), run_dir)
    if not quiet:
        print(report.table(typed), flush=True)
        log(f"results: {run_dir / 'results.json'}, plot: {run_dir / 'qps.png'}")
    parity = typed.parity or None
    if parity is not None and not parity["ok"] and config.phases.parity == "error":
        raise ParityError(f"parity check failed: the optimized phase (passes {list(config.phases.passes)}) "
                          f"{report.parity_problem(parity)}; results kept in {run_dir / 'results.json'} "
                          '(set [phases] parity = "warn" to accept a difference)')
    return typed


def _record_data(plan: JobPlan, results: JobResults) -> JobResults:
    """``results`` with the data (path, note, the first pass's ``scan``), the config with its table sizes
    resolved, and ``tables`` (the sizes, and the cardinalities they came from, also in ``cardinalities.json``)."""
    data: DataRecord = {"path": str(plan.data_path or ""), "note": plan.data_note}
    results = dataclasses.replace(results, data=data)
    if plan.data_plan is not None:
        data["scan"] = plan.data_plan.summary()
        tables: TableSizes = {"sizes": table_sizes.sizes(plan.config)}
        tables.update(plan.tables or {})  # the cardinalities the sizes came from
        results = dataclasses.replace(results, config=to_dict(plan.config), tables=tables)
    if plan.tables is not None:
        table_sizes.write_record(plan.run_dir, plan.tables)
    return results


class ParityError(RuntimeError):
    """The optimized phase's model differs from the baseline's by more than the baseline's own spread.

    See docs/troubleshooting.md#parityerror.
    """


class PhaseComparison(TypedDict, total=False):
    """:func:`compare_phases`: results.json's ``gain`` and ``parity``."""

    gain: Gain
    parity: Parity


def compare_phases(config: JobConfig, phases: dict[str, PhaseResult]) -> PhaseComparison:
    """``{"gain": ..., "parity": ...}`` of the optimized phase against the baseline (empty without both):
    the interleaved-block QPS gain (:func:`jobs.stats.interleaved_gain`) and the parity check
    (:func:`jobs.stats.parity_check`, or :func:`jobs.staleness.staleness_parity` with ``[phases] max_staleness``;
    with ``mode`` = ``[phases] parity`` and the passes checked)."""
    from jobs.staleness import staleness_parity
    from jobs.stats import interleaved_gain, parity_check

    base, opt = phases.get("baseline"), phases.get("optimized")
    if not base or not opt:
        return {}
    blocks = [{"baseline": b, "optimized": o} for b, o in zip(base.get("block_seconds") or [],
                                                                opt.get("block_seconds") or [])]
    if config.phases.max_staleness:  # stale lookups: the AUC within a tolerance, not identical training
        parity = staleness_parity(base, opt, max_staleness=config.phases.max_staleness,
                                  tolerance=config.phases.staleness_tolerance)
    else:
        parity = parity_check(base, opt)
    parity["mode"], parity["passes"] = config.phases.parity, list(config.phases.passes)
    return {"gain": interleaved_gain(blocks), "parity": parity}


class JobFailed(RuntimeError):
    """A trainer hit a deterministic error that is not about the config or the data (e.g. the model does
    not trace): the job stopped on the first attempt, without Ray Train's retries.

    See docs/troubleshooting.md#jobfailed.
    """


def _expect_cluster(config: JobConfig) -> bool:
    """Whether the job will run on a Ray cluster (the same rule as :func:`_join_ray`), known before Ray
    starts unless a Ray session is already initialised."""
    import ray

    address = config.cluster.address or os.environ.get("RAY_ADDRESS", "")
    if ray.is_initialized():
        return bool(address) and len(ray.nodes()) > 1
    return bool(address)


def _record_end(run_dir: Path, results: JobResults, watch: JobStateWatch, error: BaseException) -> None:
    """Write results.json of a run that did not complete: "interrupted" (Ctrl-C) or "failed"."""
    snap = watch.snap or seed_snapshot(watch.previous)
    out = with_snapshot(results, snap)
    running = {p: n for p, n in snap.get("progress", {}).items() if p not in snap.get("results", {})}
    resume = f"fxdist launch --resume {run_dir}"
    if isinstance(error, KeyboardInterrupt):
        out = dataclasses.replace(out, status="interrupted", progress=running, resume=resume, launcher=ABSENT)
    else:
        out = dataclasses.replace(out, status="failed", error=f"{type(error).__name__}: {error}", progress=running,
                                  resume=resume, launcher=ABSENT)
    try:
        runs.write(run_dir, out)
    except OSError:  # the original error matters more
        return
    error.add_note(f"run folder: {run_dir} ({out.status}); continue it with `{resume}`")


def _after_training(config: JobConfig, final: Checkpoint, results: JobResults, run_dir: Path,
                    data_path: Path | None, log: Any) -> JobResults:
    """``results`` with, under ``[quant] enabled``, the int8 stage's ``inference`` (:func:`_quantize`); the trained
    model goes into ``run_dir/model/`` (:func:`jobs.launcher.model_export.after_job`, with the int8 model if chosen)."""
    from jobs.launcher.inference import Int8Keep
    from jobs.launcher.model_export import after_job, with_tables

    final = with_tables(final, run_dir)  # tables checkpointed by shard: read whole here (the model file holds them)
    int8 = Int8Keep()
    if config.quant.enabled:
        results = dataclasses.replace(results, inference=_quantize(config, final, data_path, log, int8))
    after_job(config, final, results, run_dir, data_path, int8.module, log)
    return results


def _quantize(config: JobConfig, final: Checkpoint, data_path: Path | None, log: Any,
              keep: Int8Keep | None = None) -> InferenceResult:
    """fp32 vs int8 inference of the model the table's AUC refers to (:mod:`jobs.launcher.inference`); ``keep``
    receives the int8 module when it is chosen (``keep.module``)."""
    from jobs.launcher import inference

    log("post-training quantization of the dense layers: fp32 vs int8")
    t_quant = time.perf_counter()
    last = list(final["models"])[-1]
    evaluated = (final.get("eval") or {}).get(last) or {}
    model_state: ModelState = {  # the model the table's AUC refers to
        "model": evaluated["model"], "tables": evaluated.get("tables", {}), "step": evaluated.get("step")
    } if "model" in evaluated else {"model": final["models"][last], "tables": final["tables"][last], "step": final["step"]}
    out = inference.compare(config, model_state, data_path, keep=keep)
    return dataclasses.replace(out, model_step=evaluated.get("step", final.get("step")),
                               seconds=time.perf_counter() - t_quant)


def _recorded_error(error: TrainerFailure) -> Exception:
    """The launcher-side exception for a trainer's deterministic error (exit 2 for config/data, else 1)."""
    message = f"trainer rank {error['rank']}: {error['type']}: {error['message']} (stopped on the first attempt)"
    if error["kind"] == "config":
        return ConfigError(message)
    if error["kind"] == "data":
        return DataError(message)
    return JobFailed(message)


def _train(plan: JobPlan, on_cluster: bool, *, quiet: bool, log: Any, watch: JobStateWatch,
           in_trainers: bool = False) -> tuple[Snapshot, Checkpoint, float]:
    """Start the server actors (none when ``in_trainers``: the trainers host the servers), run the TorchTrainer,
    kill the actors (also on errors and Ctrl-C).

    ``watch.snap`` keeps the last JobState snapshot, also when this raises.

    Returns:
        (the JobState snapshot, the final checkpoint's contents, training seconds).

    Raises:
        the trainers' recorded deterministic error (:func:`_recorded_error`) before fit()'s own.
    """
    import ray

    config, run_dir = plan.config, plan.run_dir
    servers: list[Any] = []
    state: Any = None  # the JobState actor's handle
    try:
        metrics_port = None
        if config.metrics.enabled:
            prom = write_prometheus_files(config, run_dir, in_trainers=in_trainers)
            metrics_port = config.metrics.port
            log(f"metrics on {config.metrics.host}:{metrics_port}..; Prometheus config: {prom}")
            watch.on_placement = lambda snap: retarget(config, run_dir, snap.get("placement", {}), log,
                                                       watch.warned, in_trainers=in_trainers)
        from jobs.cluster import NodeWatch, here_options

        # on the launcher's node, as Ray Train's controller: the job's record must outlive any other node
        state = ray.remote(num_cpus=0, **here_options())(JobState).remote(watch.previous)
        if on_cluster:
            watch.nodes = NodeWatch()
        key, transport_tls = _job_secrets(config)
        if config.cluster.parameter_servers and not in_trainers:
            from jobs.trainer.servers import start_servers

            servers = start_servers(config, metrics_port, uuid.uuid4().hex[:8], auth_key=key, save_root=str(run_dir),
                                    transport_tls=transport_tls)
        spec = TrainerSpec(plan, state, tuple(servers), metrics_port, rpc_host=None if on_cluster else "127.0.0.1",
                           servers_in_trainers=in_trainers, auth_key=key, transport_tls=transport_tls)
        trainer = _trainer(config, spec, run_dir)
        from jobs.launcher.report import counted

        log(f"training: {counted(config.cluster.trainers, 'trainer')}, "
            f"{counted(config.cluster.parameter_servers, 'parameter server')} "
            f"({'in the trainers' if in_trainers else 'Ray actors'}, transport {config.cluster.transport}), "
            f"{config.job.steps} steps per phase, "
            f"passes {list(config.phases.passes)}")
        box = FitBox()
        t0 = time.perf_counter()
        state.event.remote("launcher: TorchTrainer.fit started")
        thread = threading.Thread(target=_fit, args=(trainer, box), daemon=True)
        thread.start()
        _follow(state, box, thread, not quiet and config.job.progress, watch)
        train_seconds = time.perf_counter() - t0
        _record_server_stats(state, servers, config.cluster.rpc_timeout_s)
        snap = watch.snap = ray.get(state.snapshot.remote(), timeout=60)
        recorded = snap.get("error")
        if recorded:
            raise _recorded_error(recorded) from box.error
        if box.error is not None:
            raise box.error
        return snap, _final_state(box.result), train_seconds
    except BaseException:
        if state is not None:
            try:  # what finished, for results.json (the actor dies with ray.shutdown)
                watch.snap = ray.get(state.snapshot.remote(), timeout=5)
            except BaseException:
                pass
        raise
    finally:
        if servers:
            from jobs.trainer.servers import stop_servers

            stop_servers(servers)


def _job_secrets(config: JobConfig) -> tuple[bytes, Any]:
    """The job's socket-transport key and, with ``[cluster] tls``, its TLS credentials (a fresh authority's;
    None without): drawn here, handed to the server actors and trainers through Ray only."""
    from scheduling.ps.transport.auth import new_key

    if not config.cluster.tls:
        return new_key(), None
    from scheduling.ps.transport.tls import job_credentials

    return new_key(), job_credentials(f"fxdist-{config.job.name}")


def _record_server_stats(state: Any, servers: list[Any], timeout_s: float) -> None:
    """Each server's :meth:`scheduling.ps.transport.ray_transport.PSActor.stats` (with :class:`jobs.trainer.servers.ServerHooks`)
    into the JobState (``ps<i>``); skipped when a server does not answer (a dead one has nothing to report)."""
    import ray

    for i, actor in enumerate(servers):
        try:
            ray.get(state.process_stats.remote(f"ps{i}", ray.get(actor.stats.remote(), timeout=timeout_s)))
        except Exception:  # noqa: BLE001 - statistics never fail a job
            pass


def _final_state(result) -> Checkpoint:
    checkpoint = result.checkpoint
    if checkpoint is None:
        raise RuntimeError("the training run ended without a checkpoint; see Ray's logs "
                           "(/tmp/ray/session_latest/logs on the head node)")
    with checkpoint.as_directory() as d:  # mapped, not read: only what the int8 comparison uses is paged in
        return safe_load(os.path.join(d, "state.pt"), map_location="cpu", mmap=True)
