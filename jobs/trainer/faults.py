"""Fault injection (``[faults]``): kill a trainer, kill a parameter server, or pause rank 0, once per job, at a
configured step of the optimized phase (:func:`maybe_inject_faults`).

A fault is timed after the last checkpoint written before it: the victim first waits until Ray Train has
registered that checkpoint (:func:`wait_registered`), so the restart resumes from it, as it would from a real
fault that came that long after the checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

from jobs.config import JobConfig
from jobs.trainer.pipeline import PHASES

REGISTER_WAIT_S = 3.0
"""Seconds a victim waits before a fault when it cannot read Ray Train's checkpoint record
(:func:`registered_step`): Ray Train registers a reported checkpoint at its controller's next poll of the
workers (every 2 s by default)."""
REGISTER_TIMEOUT_S = 60.0
"""Longest wait, seconds, for Ray Train to register the checkpoint before a fault (the fault then fires anyway)."""


def expected_checkpoint(step: int, checkpoint_every: int) -> int:
    """The step of the last checkpoint written before a fault at ``step`` (checkpoints every ``checkpoint_every``
    steps; the one at ``step`` itself comes after the fault), or 0 when there is none.

    >>> expected_checkpoint(13, 10), expected_checkpoint(10, 10), expected_checkpoint(6, 0)
    (10, 0, 0)
    """
    return (step - 1) // checkpoint_every * checkpoint_every if checkpoint_every > 0 else 0


def registered_step(snapshot: str | Path) -> int | None:
    """The step of the newest checkpoint Ray Train has registered: ``latest_checkpoint_result.metrics.step`` of
    its checkpoint manager's snapshot (``checkpoint_manager_snapshot.json`` in the run's Ray Train storage,
    written at each registration; the checkpoints' metrics are :func:`jobs.trainer.checkpoints.save_checkpoint`'s
    ``{"step", "final"}``); 0 before the first one, None when the file is absent or unreadable (not written yet,
    or caught mid-write)."""
    try:
        latest = json.loads(Path(snapshot).read_text()).get("latest_checkpoint_result")
    except (OSError, ValueError, AttributeError):
        return None
    if latest is None:
        return 0
    try:
        return int(latest["metrics"]["step"])
    except (KeyError, TypeError, ValueError):
        return None


def wait_registered(step: int, snapshot: str | Path | None, *, timeout_s: float = REGISTER_TIMEOUT_S,
                    poll_s: float = 0.05, sleep: Callable[[float], None] = time.sleep,
                    clock: Callable[[], float] = time.monotonic) -> float:
    """Wait until Ray Train has registered a checkpoint of ``step`` or later (:func:`registered_step` of
    ``snapshot``); returns the seconds waited. Nothing to wait for when ``step`` is 0. Without a readable snapshot
    (``snapshot`` None, or never written) it waits :data:`REGISTER_WAIT_S`, the poll interval's bound; it gives up
    after ``timeout_s``. ``sleep`` and ``clock``: :func:`time.sleep` and :func:`time.monotonic` (tests pass their own)."""
    if step <= 0:
        return 0.0
    start = clock()
    while True:
        seen = registered_step(snapshot) if snapshot is not None else None
        waited = clock() - start
        if seen is not None and seen >= step:
            return waited
        if waited >= (REGISTER_WAIT_S if seen is None else timeout_s):
            return waited
        sleep(poll_s)


def _snapshot_path() -> str | None:
    """Where this run's Ray Train checkpoint manager writes its snapshot, or None outside a Ray Train worker."""
    try:
        import ray.train

        return str(ray.train.get_context().get_storage().checkpoint_manager_snapshot_path)
    except Exception:  # noqa: BLE001 - a storage context of another form: wait the poll interval's bound instead
        return None


def _registered(checkpoint: int, waited: float) -> str:
    """The timeline's note of the wait before a fault (none without a checkpoint to wait for)."""
    return f" (waited {waited:.2f} s for Ray Train to register the step-{checkpoint} checkpoint)" if checkpoint else ""


def maybe_inject_faults(config: JobConfig, phase: str, step: int, rank: int, world: int, state: Any,
                        servers: Any) -> None:
    """Fire the configured faults once per job (the JobState actor remembers which fired): kill a trainer,
    kill a server, or pause rank 0 (a window for an outside fault; the pause's start is a timeline event).

    ``state``: the launcher's JobState actor; ``servers``: the worker group's parameter servers
    (:class:`jobs.trainer.servers.ServerGroup`, whose lifecycle kills one), or None when the tables are local
    (no server to kill). ``step``: the step just trained (1 .. ``[job] steps``).

    Before a fault the victim waits until Ray Train has registered the last checkpoint written before it
    (:func:`wait_registered`; the controller registers a reported checkpoint at its next poll of the workers):
    a fault timed right after a checkpoint would otherwise roll back to the one before, which real faults are
    not timed to do.
    """
    import ray

    faults = config.faults
    if phase != PHASES[1]:
        return
    checkpoint = expected_checkpoint(step, config.job.checkpoint_every)
    if step == faults.kill_trainer_at_step and rank == world - 1:
        if ray.get(state.fire.remote("trainer")):
            waited = wait_registered(checkpoint, _snapshot_path())
            state.event.remote(f"fault: killing trainer rank {rank} (pid {os.getpid()}) at step {step}"
                               f"{_registered(checkpoint, waited)}")
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
    if step == faults.pause_at_step and rank == 0:
        if ray.get(state.fire.remote("pause")):
            waited = wait_registered(checkpoint, _snapshot_path())
            ray.get(state.event.remote(f"fault: pausing trainer rank 0 (pid {os.getpid()}) for "
                                       f"{faults.pause_seconds} s at step {step}{_registered(checkpoint, waited)}"))
            time.sleep(faults.pause_seconds)
    if step == faults.kill_server_at_step and rank == 0 and servers is not None:
        if ray.get(state.fire.remote("server")):
            waited = wait_registered(checkpoint, _snapshot_path())
            state.event.remote(f"fault: killing parameter server 0 at step {step}{_registered(checkpoint, waited)}")
            servers.kill(0)
