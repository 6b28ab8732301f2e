"""Fault injection (``[faults]``): kill a trainer, kill a parameter server, or pause rank 0, once per job, at a
configured step of the optimized phase (:func:`maybe_inject_faults`).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from jobs.config import JobConfig
from jobs.trainer.pipeline import PHASES

REGISTER_WAIT_S = 3.0
"""Seconds a victim waits before a fault: Ray Train registers a reported checkpoint at its next health check."""


def maybe_inject_faults(config: JobConfig, phase: str, step: int, rank: int, world: int, state: Any,
                        servers: Any) -> None:
    """Fire the configured faults once per job (the JobState actor remembers which fired): kill a trainer,
    kill a server, or pause rank 0 (a window for an outside fault; the pause's start is a timeline event).

    ``state``: the launcher's JobState actor; ``servers``: the worker group's parameter servers
    (:class:`jobs.trainer.servers.ServerGroup`, whose lifecycle kills one), or None when the tables are local
    (no server to kill). ``step``: the step just trained (1 .. ``[job] steps``).

    Before a fault the victim waits ``REGISTER_WAIT_S``: Ray Train registers a reported checkpoint at
    its next health check (every 2 s), and a fault timed right after a checkpoint would otherwise roll
    back to the one before, which real faults are not timed to do.
    """
    import ray

    faults = config.faults
    if phase != PHASES[1]:
        return
    if step == faults.kill_trainer_at_step and rank == world - 1:
        if ray.get(state.fire.remote("trainer")):
            time.sleep(REGISTER_WAIT_S)
            state.event.remote(f"fault: killing trainer rank {rank} (pid {os.getpid()}) at step {step}")
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
    if step == faults.pause_at_step and rank == 0:
        if ray.get(state.fire.remote("pause")):
            time.sleep(REGISTER_WAIT_S)
            ray.get(state.event.remote(f"fault: pausing trainer rank 0 (pid {os.getpid()}) for "
                                       f"{faults.pause_seconds} s at step {step}"))
            time.sleep(faults.pause_seconds)
    if step == faults.kill_server_at_step and rank == 0 and servers is not None:
        if ray.get(state.fire.remote("server")):
            time.sleep(REGISTER_WAIT_S)
            state.event.remote(f"fault: killing parameter server 0 at step {step}")
            servers.kill(0)

