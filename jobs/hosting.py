"""Where a job's parameter servers run: separate processes (Ray actors) or inside the trainers' processes.

``[cluster] servers_in_trainers`` = ``false`` | ``true`` | ``"auto"`` (the default):

- ``false``: every server is a Ray actor of its own (:func:`jobs.trainer.servers.start_servers`), so ``T`` trainers
  and ``N`` servers are ``T + N`` processes;
- ``true``: trainer ``i``'s process also serves server ``i`` for ``i < N`` (:mod:`scheduling.ps.in_trainers`,
  :class:`jobs.trainer.in_trainers.InTrainerServers`): ``T`` processes, no server actor. ``[cluster]
  parameter_servers`` keeps its meaning, the number of table shards, and must be ``<= trainers`` (trainers
  ``N .. T-1`` serve nothing); a trainer's requests to its own shard skip RPC. With ``[cluster] transport =
  "socket"`` server ``i`` listens on a socket of trainer ``i``'s process instead of joining an RPC group
  (:class:`jobs.trainer.in_trainers.InTrainerSocketServers`);
- ``"auto"``: separate processes over the ``socket`` transport, the default (in the trainers over sockets the job
  with 2 servers on 2 cores ran as fast as with separate servers, 0.96-1.00x: ``true`` asks for it). Over
  ``torch_rpc``: in the trainers when every trainer would host one server (``parameter_servers == trainers``) and
  the CPUs the job can use (Ray's ``CPU`` resources) are fewer than separate servers need to have a core each:
  ``ceil(trainers * cpus_per_trainer) + parameter_servers + 1`` (the ``+ 1``: the launcher, Ray's own processes
  and the RPC threads). Else separate processes; also when the config needs server processes
  (:func:`needs_separate`).

The rule comes from ``benchmarks/peer.py`` (2 trainers, 2 servers, ratio of QPS to torchrec's DMP): on 2 cores
the servers in the trainers gave 0.99 / 1.02 (tables 1e4 x 64 / 1e6 x 16) against 0.92 / 0.98 for separate server
processes; on 12 cores 0.93 against 1.11, slower there: with cores to spare a separate server answers the other
trainer's requests on its own core, while in a trainer its RPC threads compete with that trainer's compute. The
threshold between 2 and 12 cores is not measured; it only asks that each process has a core of its own. The
balance condition comes from the default job on 2 cores (measured under load, alternating runs): with 2 servers
in 2 trainers both phases were faster than with 2 server processes in both pairs of runs, with 1 server in trainer
0 (which then serves every lookup of trainer 1 besides training) slower in both pairs.

Source: torchrec ``DistributedModelParallel`` table-wise sharding (torchrec/distributed/sharding/tw_sharding.py: a
table lives in the trainer that owns it); Ray's ``ray.cluster_resources()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from jobs.records import HostingRecord

__all__ = ["AUTO", "Hosting", "cpus_needed", "needs_separate", "in_trainer_errors", "choose_hosting", "job_cpus"]

AUTO = "auto"
"""The value of ``[cluster] servers_in_trainers`` that lets the job choose (:func:`choose_hosting`)."""
KEY = "[cluster] servers_in_trainers"


@dataclass(frozen=True)
class Hosting:
    """The job's choice: ``in_trainers`` (servers inside the trainers' processes), the ``setting`` it came from
    (``true`` / ``false`` / ``"auto"``), ``reason`` (one sentence) and ``cpus`` (the job's CPUs, None when not
    consulted)."""

    in_trainers: bool
    setting: bool | str
    reason: str
    cpus: float | None = None

    def to_json(self) -> HostingRecord:
        """results.json's ``servers_in_trainers``: ``{"chosen", "setting", "reason", "cpus"}``."""
        return {"chosen": self.in_trainers, "setting": self.setting, "reason": self.reason, "cpus": self.cpus}


def cpus_needed(cluster: Any) -> int:
    """CPUs for separate server processes with a core each: ``ceil(trainers * cpus_per_trainer) +
    parameter_servers + 1`` (``cluster``: the ``[cluster]`` section)."""
    return math.ceil(cluster.trainers * cluster.cpus_per_trainer) + cluster.parameter_servers + 1


def needs_separate(config: Any) -> str | None:
    """Why ``config`` needs servers in processes of their own, or None: the ``ray`` transport (the trainers call
    the server actors' methods), ``[faults] kill_server_at_step`` (it kills a server process), or more servers
    than trainers (each trainer hosts at most one)."""
    c = config.cluster
    if c.transport == "ray":
        return '[cluster] transport = "ray" calls the server actors\' methods, so the servers are actors'
    if config.faults.kill_server_at_step != -1:
        return "[faults] kill_server_at_step kills a server process"
    if c.parameter_servers > c.trainers:
        return (f"[cluster] parameter_servers = {c.parameter_servers} > trainers = {c.trainers} (a trainer hosts at "
                "most one server)")
    return None


def in_trainer_errors(config: Any) -> list[str]:
    """The config errors of ``servers_in_trainers``: a value other than true, false or "auto"; with ``true``, no
    servers or a config that needs separate ones (:func:`needs_separate`)."""
    setting = config.cluster.servers_in_trainers
    if isinstance(setting, str) and setting != AUTO:
        return [f'{KEY} = {setting!r}: must be true, false or "auto"']
    if setting is not True:
        return []
    if config.cluster.parameter_servers == 0:
        return [f"{KEY} = true needs [cluster] parameter_servers >= 1 (with 0 the tables are DDP parameters of the "
                "trainers already)"]
    why = needs_separate(config)
    if why is not None:
        return [f"{KEY} = true: {why}; set {KEY} = false (or \"auto\", which then picks separate servers)"]
    return []


def choose_hosting(config: Any, cpus: float | None) -> Hosting:
    """Where ``config``'s servers run (see the module docstring), given the job's ``cpus`` (Ray's ``CPU``
    resources; consulted only for ``"auto"``, None = unknown: separate processes).

    >>> from jobs.config import JobConfig
    >>> choose_hosting(JobConfig().replace(cluster={"parameter_servers": 2, "transport": "torch_rpc"}), 2.0).reason
    '[cluster] servers_in_trainers = "auto": 2 CPUs < 5 (2 trainers x 1 CPU + 2 servers + 1): the servers run in the trainers, 2 processes instead of 4'
    """
    c = config.cluster
    setting = c.servers_in_trainers
    if c.parameter_servers == 0:
        return Hosting(False, setting, "no parameter servers ([cluster] parameter_servers = 0)")
    if setting is True or setting is False:
        where = "in the trainers" if setting else "in processes of their own"
        return Hosting(setting, setting, f"{KEY} = {str(setting).lower()}: the servers run {where}")
    why = needs_separate(config)
    if why is None and c.parameter_servers != c.trainers:
        why = (f"[cluster] parameter_servers = {c.parameter_servers} < trainers = {c.trainers} (the trainers hosting a "
               "server would also serve the others' lookups: measured slower)")
    if why is None and c.transport == "socket":
        why = ('[cluster] transport = "socket" (servers in the trainers over sockets: only with true; the job with 2 '
               "servers measured as fast either way)")
    if why is not None:
        return Hosting(False, setting, f'{KEY} = "auto": {why}: separate server processes')
    if cpus is None:
        return Hosting(False, setting, f'{KEY} = "auto": the job\'s CPU count is unknown: separate server processes')
    need, t, n = cpus_needed(c), c.trainers, c.parameter_servers
    rule = (f"({t} trainer{'s' if t != 1 else ''} x {c.cpus_per_trainer:g} CPU + {n} server{'s' if n != 1 else ''} "
            "+ 1)")
    if cpus < need:
        return Hosting(True, setting, f'{KEY} = "auto": {cpus:g} CPUs < {need} {rule}: the servers run in the '
                                      f"trainers, {t} processes instead of {t + n}", cpus)
    return Hosting(False, setting, f'{KEY} = "auto": {cpus:g} CPUs >= {need} {rule}: each server process has a '
                                   "core of its own", cpus)


def job_cpus() -> float | None:
    """The CPUs the job can use: Ray's ``CPU`` resources over the cluster (Ray must be initialised); None when Ray
    reports none."""
    import ray

    cpus = ray.cluster_resources().get("CPU")
    return float(cpus) if cpus else None
