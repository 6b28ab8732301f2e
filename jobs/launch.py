"""``fxdist launch``: run a job on Ray (local or a cluster) and collect its results.

:func:`launch` does, in order:

1. creates the run folder ``<run_dir>/<name>-<UTC timestamp>/`` and finds the data (configured path,
   else ``../shared/data/criteo/train_examples.txt``, else generated Criteo-format data);
2. joins Ray: an already initialised session, else ``[cluster] address``, else ``$RAY_ADDRESS``,
   else a local ``ray.init()``;
3. writes Prometheus file-based service discovery (``prometheus/targets.json``) and a ready-to-run
   ``prometheus/prometheus.yml`` (from ``dashboards/``) into the run folder;
4. runs the trainers with Ray Train's ``TorchTrainer`` (DDP over gloo on CPU, nccl on GPU;
   ``FailureConfig(max_failures)`` restarts the worker group from the last checkpoint), after starting
   the parameter servers as Ray actors (:func:`jobs.ps.start_servers`; each worker group's rank 0 has
   them join its ``torch.distributed.rpc`` group, see :mod:`jobs.ps`; they are killed when the job ends,
   also on errors and Ctrl-C); the trainers report to a :class:`JobState` actor, which the launcher
   polls for the progress bars;
5. quantizes the dense model of the last phase that the AUC refers to (after ``[job] eval_epochs``,
   see :func:`jobs.worker.eval_step`) and compares fp32 with int8 (:mod:`jobs.inference`);
6. writes ``results.json`` and ``qps.png`` and prints the results table (:mod:`jobs.report`).

Source: Ray Train (TorchTrainer, ScalingConfig, RunConfig, FailureConfig, CheckpointConfig).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from jobs.config import JobConfig, to_dict
from jobs.data import resolve_data_path

__all__ = ["launch", "JobState", "ParityError", "compare_phases", "write_prometheus_files", "DASHBOARDS"]

DASHBOARDS = Path(__file__).resolve().parents[1] / "dashboards"


class JobState:
    """Driver-owned actor: progress, phase results and fault markers, shared by all trainer restarts."""

    def __init__(self) -> None:
        self.progress_steps: dict[str, int] = {}
        self.totals: dict[str, int] = {}
        self.starts: list[tuple[str, int]] = []
        self.results: dict[str, Any] = {}
        self.fired: set[str] = set()
        self.parse: dict[str, Any] | None = None
        self.t0 = time.time()
        self.events: list[tuple[float, str]] = []
        self.checkpoints: list[dict[str, Any]] = []
        self.restores: list[dict[str, Any]] = []
        self.server_joins: list[list[dict[str, int]]] = []

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

    def servers_joined(self, joined: list[dict[str, int]]) -> None:
        """A worker group's rank 0 had every server actor join its RPC group: ``[{"pid", "group"}, ...]``."""
        self.server_joins.append(joined)
        self.event("servers joined: " + ", ".join(f"ps{i} pid {j['pid']} group {j['group']}"
                                                  for i, j in enumerate(joined)))

    def parse_stats(self, stats: dict[str, Any], rows: int) -> None:
        self.parse = {**stats, "rank0_rows": rows}

    def phase_started(self, phase: str, start: int, total: int) -> None:
        self.starts.append((phase, start))
        self.event(f"{phase} phase started at step {start}")
        self.totals[phase] = total
        self.progress_steps[phase] = start

    def progress(self, phase: str, step: int) -> None:
        self.progress_steps[phase] = step

    def phase_done(self, phase: str, summary: dict[str, Any]) -> None:
        self.results[phase] = summary
        self.event(f"{phase} phase done")
        self.progress_steps[phase] = self.totals.get(phase, summary.get("steps", 0))

    def snapshot(self) -> dict[str, Any]:
        return {"progress": dict(self.progress_steps), "totals": dict(self.totals), "starts": list(self.starts),
                "results": dict(self.results), "fired": sorted(self.fired), "parse": self.parse,
                "checkpoints": list(self.checkpoints), "restores": list(self.restores), "events": list(self.events),
                "server_joins": list(self.server_joins)}


def _join_ray(config: JobConfig, *, log: Any) -> tuple[bool, bool]:
    """Initialise Ray if needed; returns (this call started Ray, Ray spans a cluster)."""
    import ray

    address = config.cluster.address or os.environ.get("RAY_ADDRESS", "")
    if ray.is_initialized():
        return False, bool(address) and len(ray.nodes()) > 1
    if address:
        log(f"joining the Ray cluster at {address}")
        ray.init(address=address, log_to_driver=False)
        return True, True
    log("starting Ray locally (set RAY_ADDRESS or [cluster] address to use a cluster)")
    ray.init(include_dashboard=False, log_to_driver=False)
    return True, False


def write_prometheus_files(config: JobConfig, run_dir: Path) -> Path:
    """Write ``prometheus/targets.json`` (file-based service discovery) and ``prometheus/prometheus.yml``.

    Targets: trainer rank r at ``host:port + r``, parameter server i at ``host:port + trainers + i``;
    each target carries labels ``fxdist_job`` and ``role``. Returns the prometheus.yml path.
    """
    m, c = config.metrics, config.cluster
    out = run_dir / "prometheus"
    out.mkdir(parents=True, exist_ok=True)
    host = "127.0.0.1" if m.host in ("", "0.0.0.0") else m.host
    groups = [
        {"targets": [f"{host}:{m.port + r}" for r in range(c.trainers)],
         "labels": {"fxdist_job": config.job.name, "role": "trainer"}},
    ]
    if c.parameter_servers:
        groups.append({"targets": [f"{host}:{m.port + c.trainers + i}" for i in range(c.parameter_servers)],
                       "labels": {"fxdist_job": config.job.name, "role": "parameter_server"}})
    (out / "targets.json").write_text(json.dumps(groups, indent=2) + "\n")
    template = (DASHBOARDS / "prometheus.yml").read_text()
    rendered = template.replace("{{TARGETS_DIR}}", str(out)).replace("{{RULES}}", str(DASHBOARDS / "rules.yml"))
    (out / "prometheus.yml").write_text(rendered)
    return out / "prometheus.yml"


def _check_ports(config: JobConfig) -> None:
    """Fail early, with the fix, when an exporter port of this machine is taken.

    Raises:
        ConfigError: naming the port in use.
    """
    import socket

    from jobs.config import ConfigError

    m, c = config.metrics, config.cluster
    for port in range(m.port, m.port + c.trainers + c.parameter_servers):
        with socket.socket() as s:
            try:
                s.bind((m.host, port))
            except OSError as e:
                raise ConfigError(
                    f"{config.source}: [metrics] port: {m.host}:{port} is in use ({e.strerror}); the job needs ports "
                    f"{m.port}..{m.port + c.trainers + c.parameter_servers - 1}. Pick another base, e.g. "
                    f"--set metrics.port={m.port + 100}, or --set metrics.enabled=false"
                ) from None


def _fit(trainer, box: dict[str, Any]) -> None:
    try:
        box["result"] = trainer.fit()
    except BaseException as e:  # re-raised in the launching thread
        box["error"] = e


def _follow(state, box: dict[str, Any], thread: threading.Thread, show: bool) -> dict[str, Any]:
    """Poll the JobState actor and draw a tqdm bar per phase until the fit thread ends."""
    import ray
    from tqdm import tqdm

    bars: dict[str, Any] = {}
    snap: dict[str, Any] = {}
    while True:
        alive = thread.is_alive()
        try:
            snap = ray.get(state.snapshot.remote(), timeout=10)
        except Exception:  # a slow actor must not kill the job
            pass
        if show:
            for phase, total in snap.get("totals", {}).items():
                bar = bars.get(phase)
                if bar is None:
                    bar = bars[phase] = tqdm(total=total, desc=f"{phase:>9}", unit="step", leave=True)
                if bar.disable:
                    continue
                bar.n = snap["progress"].get(phase, 0)
                bar.refresh()
                if phase in snap.get("results", {}):
                    bar.close()
        if not alive:
            break
        thread.join(timeout=0.5)
    for bar in bars.values():
        bar.close()
    return snap


def _trainer(config: JobConfig, loop_config: dict[str, Any], run_dir: Path):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from jobs.worker import train_loop

    c = config.cluster
    return TorchTrainer(
        train_loop,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend="nccl" if c.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=c.trainers, use_gpu=c.use_gpu,
                                     resources_per_worker={"CPU": c.cpus_per_trainer}),
        run_config=RunConfig(
            name="train", storage_path=str((run_dir / "ray").resolve()),
            failure_config=FailureConfig(max_failures=config.job.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )


def launch(config: JobConfig, *, run_dir: str | Path | None = None, quiet: bool = False) -> dict[str, Any]:
    """Run the job described by ``config`` and return its results (also written to ``results.json``).

    Args:
        config: The job config.
        run_dir: The run folder; default ``<[job] run_dir>/<name>-<UTC timestamp>``.
        quiet: No progress bars or table (tests).

    Returns:
        The results dict (see :mod:`jobs.report` for its keys).

    Raises:
        ray.train.TrainingFailedError (or the trainer's exception): training failed more than
            ``max_failures`` times; the run folder keeps the logs and checkpoints.
    """
    import ray

    from jobs import inference, report

    log = (lambda msg: None) if quiet else (lambda msg: print(f"[fxdist] {msg}", flush=True))
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    run_dir = Path(run_dir) if run_dir else Path(config.job.run_dir) / f"{config.job.name}-{stamp}"
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    data_path, data_note = resolve_data_path(config.data.path, run_dir, config.data.synthetic_rows,
                                             seed=config.job.seed)
    log(data_note)
    started_ray, on_cluster = _join_ray(config, log=log)
    try:
        snap, final, train_seconds = _train(config, run_dir, data_path, on_cluster, quiet=quiet, log=log)
    finally:
        if started_ray:
            ray.shutdown()
    results = {
        "job": config.job.name, "config": to_dict(config), "config_source": config.source,
        "data": {"path": str(data_path), "note": data_note, "parse": snap.get("parse")},
        "phases": snap.get("results", {}), "train_seconds": train_seconds,
        "restarts": _restarts(snap), "faults_fired": snap.get("fired", []), "run_dir": str(run_dir),
        "checkpoints": snap.get("checkpoints", []), "restores": snap.get("restores", []),
        "timeline": snap.get("events", []), "starts": snap.get("starts", []),
        "server_joins": snap.get("server_joins", []),
    }
    results.update(compare_phases(config, results["phases"]))
    if config.quant.enabled:
        log("post-training quantization of the dense model: fp32 vs int8")
        t_quant = time.perf_counter()
        last = list(final["models"])[-1]
        evaluated = (final.get("eval") or {}).get(last) or {}
        model_state = evaluated if "model" in evaluated else {  # the model the table's AUC refers to
            "model": final["models"][last], "tables": final["tables"][last], "step": final["step"]}
        results["inference"] = inference.compare(config, model_state, data_path)
        results["inference"]["model_step"] = evaluated.get("step", final.get("step"))
        results["inference"]["seconds"] = time.perf_counter() - t_quant
    report.write(results, run_dir)
    if not quiet:
        print(report.table(results), flush=True)
        log(f"results: {run_dir / 'results.json'}, plot: {run_dir / 'qps.png'}")
    parity = results.get("parity")
    if parity is not None and not parity["ok"] and config.phases.parity == "error":
        raise ParityError(f"parity check failed: the optimized phase (passes {list(config.phases.passes)}) "
                          f"{report.parity_problem(parity)}; results kept in {run_dir / 'results.json'} "
                          '(set [phases] parity = "warn" to accept a difference)')
    return results


class ParityError(RuntimeError):
    """The optimized phase's model differs from the baseline's by more than the baseline's own spread."""


def compare_phases(config: JobConfig, phases: dict[str, Any]) -> dict[str, Any]:
    """``{"gain": ..., "parity": ...}`` of the optimized phase against the baseline (empty without both):
    the interleaved-block QPS gain (:func:`jobs.stats.interleaved_gain`) and the parity check
    (:func:`jobs.stats.parity_check`, with ``mode`` = ``[phases] parity`` and the passes checked)."""
    from jobs.stats import interleaved_gain, parity_check

    base, opt = phases.get("baseline"), phases.get("optimized")
    if not base or not opt:
        return {}
    blocks = [{"baseline": b, "optimized": o} for b, o in zip(base.get("block_seconds") or [],
                                                                opt.get("block_seconds") or [])]
    parity = parity_check(base, opt)
    parity.update(mode=config.phases.parity, passes=list(config.phases.passes))
    return {"gain": interleaved_gain(blocks), "parity": parity}


def _train(config: JobConfig, run_dir: Path, data_path: Path, on_cluster: bool, *, quiet: bool,
           log: Any) -> tuple[dict[str, Any], dict[str, Any], float]:
    """Start the server actors, run the TorchTrainer, kill the actors (also on errors and Ctrl-C).

    Returns:
        (the JobState snapshot, the final checkpoint's contents, training seconds).
    """
    import ray

    servers: list[Any] = []
    try:
        metrics_port = None
        if config.metrics.enabled and not on_cluster:
            _check_ports(config)
        if config.metrics.enabled:
            prom = write_prometheus_files(config, run_dir)
            metrics_port = config.metrics.port
            log(f"metrics on {config.metrics.host}:{metrics_port}..; Prometheus config: {prom}")
        state = ray.remote(num_cpus=0)(JobState).remote()
        if config.cluster.parameter_servers:
            from jobs.ps import start_servers

            servers = start_servers(config, metrics_port, uuid.uuid4().hex[:8])
        loop_config = {"config": to_dict(config), "source": config.source, "data_path": str(data_path),
                       "run_dir": str(run_dir), "metrics_port": metrics_port, "state": state, "servers": servers,
                       "rpc_host": None if on_cluster else "127.0.0.1"}
        trainer = _trainer(config, loop_config, run_dir)
        log(f"training: {config.cluster.trainers} trainers, {config.cluster.parameter_servers} parameter servers "
            f"(Ray actors), {config.job.steps} steps per phase, passes {list(config.phases.passes)}")
        box: dict[str, Any] = {}
        t0 = time.perf_counter()
        state.event.remote("launcher: TorchTrainer.fit started")
        thread = threading.Thread(target=_fit, args=(trainer, box), daemon=True)
        thread.start()
        _follow(state, box, thread, show=not quiet and config.job.progress)
        if "error" in box:
            raise box["error"]
        train_seconds = time.perf_counter() - t0
        return ray.get(state.snapshot.remote()), _final_state(box["result"]), train_seconds
    finally:
        if servers:
            from jobs.ps import stop_servers

            stop_servers(servers)


def _final_state(result) -> dict[str, Any]:
    checkpoint = result.checkpoint
    if checkpoint is None:
        raise RuntimeError("the training run ended without a checkpoint; see Ray's logs "
                           "(/tmp/ray/session_latest/logs on the head node)")
    with checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, "state.pt"), map_location="cpu", weights_only=False)


def _restarts(snap: dict[str, Any]) -> int:
    """Worker-group restarts seen: starts of a phase beyond its first (every restart starts every phase)."""
    seen: dict[str, int] = {}
    for phase, _ in snap.get("starts", []):
        seen[phase] = seen.get(phase, 0) + 1
    return max((n - 1 for n in seen.values()), default=0)
