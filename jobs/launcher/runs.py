"""Run folders: which folder a launch writes to, its ``results.json`` status, and resuming.

A run folder holds a run once it has ``results.json`` or Ray Train's storage ``ray/``. Its
``results.json`` has a ``"status"``:

- ``"running"``: written when training starts (with the config and the launcher's pid and host), and
  again each time a phase finishes or a checkpoint is written, so a launcher killed outright still leaves
  its finished phases;
- ``"completed"``: the job finished (the full results, :class:`jobs.results.JobResults`);
- ``"interrupted"``: Ctrl-C / SIGINT (exit status 130): the phases finished so far, the progress of the
  one running, and its checkpoints;
- ``"failed"``: the job failed (exit status 1 or 2), with ``"error"`` and the phases finished so far.

A results.json without a status (written before statuses existed) is a completed run.

Folder rules (:func:`choose`): ``fxdist launch`` never overwrites a run. Without ``--run-dir`` it makes
``<[job] run_dir>/<name>-<UTC timestamp>/``; ``--run-dir DIR`` must not hold a run yet (an empty or
absent folder, or one holding only other files, e.g. a Prometheus config). ``--resume DIR`` continues an
interrupted or failed run from its last checkpoint (Ray Train restores it from ``DIR/ray``), with the
run's own config (:func:`load_config`); a completed run continues only for more steps (``--set job.steps=N``, N
larger than its own); one still running is refused. ``--set cluster.parameter_servers=M`` continues on ``M``
servers (the tables are resharded).

Source: Ray Train ``RunConfig(storage_path, name)`` (a run restores from the checkpoint manager snapshot
found in its storage folder).
"""

from __future__ import annotations

import json
import os
import socket
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from jobs.config import ConfigError, JobConfig, parse_config, to_dict
from jobs.results import JobResults, ResultsError, strict_json

__all__ = ["RESULTS", "RESUMABLE_KEYS", "choose", "read", "read_results", "write", "load_config",
           "check_resume_changes", "holds_run", "status_of"]

RESULTS = "results.json"
RESUMABLE_KEYS = frozenset({
    "job.max_failures", "job.progress", "job.checkpoint_every", "job.run_dir", "job.allow_eager_fallback",
    "cluster.address", "cluster.rpc_timeout_s", "cluster.cpus_per_trainer", "cluster.use_gpu",
    "metrics.enabled", "metrics.host", "metrics.port", "metrics.expose", "metrics.certfile", "metrics.keyfile",
    "metrics.client_cafile", "metrics.client_auth_required", "cluster.allow_unauthenticated", "cluster.tls",
    "quant.enabled", "quant.calibration_batches", "quant.eval_batch_size", "data.reader_workers",
    "faults.kill_trainer_at_step", "faults.kill_server_at_step",
    "cluster.parameter_servers", "job.steps", "cluster.servers_in_trainers",
})
"""Keys that ``--resume`` may change with ``--set``; every other key shapes the checkpoints or the
comparison between phases, so it keeps the run's value. ``cluster.parameter_servers`` may go from one positive
count to another (the tables are resharded onto the new servers: :func:`jobs.launcher.plan.reshard_plan`), and
``job.steps`` may only grow (a completed run continues for the steps added)."""


def holds_run(run_dir: Path) -> bool:
    """``run_dir`` has a results.json or Ray Train storage (``ray/``)."""
    return (run_dir / RESULTS).is_file() or (run_dir / "ray").exists()


def read(run_dir: Path) -> dict[str, Any] | None:
    """The run's results.json as a plain dict (any results.json: its status, launcher and config), or None when
    absent (:func:`read_results` reads it as :class:`jobs.results.JobResults`).

    Raises:
        ConfigError: it exists but is not a JSON object.
    """
    path = run_dir / RESULTS
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def read_results(run_dir: Path) -> JobResults | None:
    """The run's results.json as :class:`jobs.results.JobResults` (a resumed run's record), or None when absent.

    Raises:
        ConfigError: it is not a JSON object, or not the results schema (the message names the key).
    """
    data = read(run_dir)
    try:
        return None if data is None else JobResults.from_json(data)
    except ResultsError as e:
        raise ConfigError(f"{run_dir / RESULTS}: {e}") from None


def status_of(results: JobResults | dict[str, Any] | None) -> str:
    """The run's status ("completed" for a results.json written before statuses existed)."""
    if results is None:
        return "unknown (no results.json)"
    return str(results.get("status", "completed"))


def write(run_dir: Path, results: JobResults | dict[str, Any]) -> Path:
    """Write ``results.json`` atomically (a temporary file, then a rename): strict JSON
    (:func:`jobs.results.strict_json`: typed results by their ``to_json``, NaN as null); other values JSON cannot
    hold are written as text."""
    path = run_dir / RESULTS
    tmp = path.with_name(f".{RESULTS}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(strict_json(results), indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def _still_running(results: dict[str, Any]) -> int | None:
    """The pid of the launcher of a "running" run when it is alive on this host, else None."""
    launcher = results.get("launcher") or {}
    pid = launcher.get("pid")
    if results.get("status") != "running" or launcher.get("host") != socket.gethostname() or not pid:
        return None
    if pid == os.getpid():
        return None
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError):
        return None
    return int(pid)


def choose(config: JobConfig, run_dir: str | Path | None, *, resume: bool = False) -> Path:
    """The run folder of this launch (not created yet; see the module docstring for the rules).

    Raises:
        ConfigError: ``run_dir`` already holds a run (without ``resume``), or cannot be resumed (with it).
    """
    if resume:
        if run_dir is None:
            raise ConfigError("--resume needs the run folder to resume")
        return _check_resumable(Path(run_dir).resolve(), config.job.steps)
    if run_dir is not None:
        path = Path(run_dir).resolve()
        if path.exists() and not path.is_dir():
            raise ConfigError(f"--run-dir {path}: exists and is not a folder")
        if holds_run(path):
            raise ConfigError(
                f"--run-dir {path} already holds a run (status: {status_of(read(path))}); a run is never "
                f"overwritten. Continue an interrupted or failed one with `fxdist launch --resume {path}`, "
                "or pick a new --run-dir (without it, each launch makes <[job] run_dir>/<name>-<UTC timestamp>/)")
        return path
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    base = (Path(config.job.run_dir) / f"{config.job.name}-{stamp}").resolve()
    path, n = base, 1
    while path.exists():  # two launches in the same second
        path, n = base.with_name(f"{base.name}-{n}"), n + 1
    return path


def _check_resumable(path: Path, steps: int | None = None, *, completed_ok: bool = False) -> Path:
    """``path`` if it holds a run that can be resumed (a completed one only when ``steps`` is more than it ran, or
    with ``completed_ok``).

    Raises:
        ConfigError: no run there, a completed run without more ``steps``, a run still running, no saved config.
    """
    if not holds_run(path):
        raise ConfigError(f"--resume {path}: no run there (no {RESULTS}, no ray/ checkpoints) to resume")
    results = read(path)
    status = status_of(results)
    ran = ((results or {}).get("config") or {}).get("job", {}).get("steps")
    if status == "completed" and not completed_ok and (steps is None or ran is None or steps <= ran):
        raise ConfigError(f"--resume {path}: the run completed; there is nothing to resume (its results are in "
                          f"{path / RESULTS}); continue it for more steps with --set job.steps=N, N > {ran}, or "
                          "start a new run without --resume")
    pid = _still_running(results) if results else None
    if pid is not None:
        raise ConfigError(f"--resume {path}: the run is still running (launcher pid {pid} on this host)")
    if results is None or "config" not in results:
        raise ConfigError(f"--resume {path}: {RESULTS} with the run's config is missing, so the run cannot "
                          "be resumed with the config its checkpoints were made with")
    return path


def load_config(run_dir: str | Path) -> JobConfig:
    """The config a run was started with (from its results.json), for ``--resume`` (a completed run's too: whether
    the new ``[job] steps`` continue it is checked by :func:`choose`).

    Raises:
        ConfigError: the folder cannot be resumed (see :func:`choose`) or its config is invalid.
    """
    path = _check_resumable(Path(run_dir).resolve(), completed_ok=True)
    results = read(path) or {}
    return parse_config(results["config"], source=str(path / RESULTS))


def check_resume_changes(saved: JobConfig, config: JobConfig) -> None:
    """Refuse ``--set`` changes that ``--resume`` cannot honour (keys outside RESUMABLE_KEYS, ``[cluster]
    parameter_servers`` to or from 0, fewer ``[job] steps``).

    Raises:
        ConfigError: naming the first such key, its saved and its new value.
    """
    old, new = to_dict(saved), to_dict(config)
    servers = (old["cluster"]["parameter_servers"], new["cluster"]["parameter_servers"])
    if servers[0] != servers[1] and 0 in servers:
        raise ConfigError(f"--resume: [cluster] parameter_servers can change only between positive counts (the run "
                          f"used {servers[0]}, --set gives {servers[1]}): with 0 the tables live in the trainers, "
                          "a checkpoint of another form")
    if new["job"]["steps"] < old["job"]["steps"]:
        raise ConfigError(f"--resume: [job] steps can only grow (the run used {old['job']['steps']}, --set gives "
                          f"{new['job']['steps']})")
    for table, values in new.items():
        for key, value in values.items():
            if value != old[table][key] and f"{table}.{key}" not in RESUMABLE_KEYS:
                raise ConfigError(
                    f"--resume: [{table}] {key} cannot change when resuming (the run used {old[table][key]!r}, "
                    f"--set gives {value!r}): its checkpoints and finished phases depend on it. Keys that may "
                    f"change: {', '.join(sorted(RESUMABLE_KEYS))}")
