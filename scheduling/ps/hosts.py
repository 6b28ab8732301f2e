"""Where parameter servers run (the host axis of a server group): child processes or Ray actors.

A server group (:mod:`scheduling.ps.lifecycle`) is cut along two axes: the *transport* (``torch_rpc`` or
``ray``: how the group meets, joins and leaves, how clients reach the servers; :class:`~scheduling.ps.lifecycle.TorchRPCServers`,
:class:`~scheduling.ps.transport.ray_transport.RayServers`) and the *host* here: :class:`ProcessHost` (child processes
of this process, a ``LocalCluster`` with ``torch_rpc``) or :class:`scheduling.ps.transport.ray_transport.ActorHost` (Ray
actors, a ``LocalCluster`` with ``ray`` and every job; there, since only the Ray modules of ``scheduling`` import
Ray, docs/CONTRACTS.md). Both have ``kill(index)`` and ``kill_all()``. Every kill goes through a host: :meth:`kill` is a crash of one server (restarted
where the host restarts it: a Ray actor with ``max_restarts`` left), :meth:`kill_all` ends every server for
good. A server actor's answer to a reset or join is a :class:`ServerAnswer`.

Source: ``multiprocessing.Process.kill`` (SIGKILL); ``ray.kill(actor, no_restart=...)``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, TypedDict

__all__ = ["ProcessHost", "ServerAnswer"]


class ServerAnswer(TypedDict, total=False):
    """A server actor's answer to a reset or join (``PSActor.reset`` / ``reset_socket`` / ``join``)."""

    pid: int
    """The server's process id."""
    group: int
    """Resets and joins of the server so far."""
    address: str
    """The ``"host:port"`` its socket listens on (``socket`` transport)."""


class ProcessHost:
    """Servers as child processes of this process (never restarted: a killed one stays dead).

    Attributes: ``processes``, the started ``multiprocessing`` processes, in server order.
    """

    kind = "process"

    def __init__(self) -> None:
        self.processes: list[Any] = []

    def start(self, ctx: Any, target: Any, args: Sequence[tuple], names: Sequence[str]) -> None:
        """Start one daemon process per ``args[i]`` (``target(*args[i])``, named ``fxdist-<names[i]>``)."""
        for name, a in zip(names, args):
            proc = ctx.Process(target=target, args=a, daemon=True, name=f"fxdist-{name}")
            proc.start()
            self.processes.append(proc)

    def alive(self) -> list[bool]:
        """Per server, whether its process still runs."""
        return [p.is_alive() for p in self.processes]

    def kill(self, index: int) -> None:
        """SIGKILL server ``index``'s process (a crash: no goodbye to its group) and reap it (10 s at most)."""
        proc = self.processes[index]
        proc.kill()
        proc.join(timeout=10)

    def kill_all(self) -> None:
        """SIGKILL every server process still alive, reap them and forget them."""
        for proc in self.processes:
            if proc.is_alive():
                proc.kill()
        for proc in self.processes:
            proc.join(timeout=10)

    def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds in all for the processes to end by themselves."""
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
