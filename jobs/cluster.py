"""Running a job on a Ray cluster: node addresses, network interfaces, placement and where things ran.

Every address a job uses comes from where a process actually runs, never from the launcher's host name:

- a server actor's socket (the ``socket`` transport, the default) binds on port 0 of ``127.0.0.1`` in a job on
  a local Ray session (the launcher's rule: neither ``[cluster] address`` nor ``$RAY_ADDRESS``, or a Ray session
  already started with one node; nothing of the job listens beyond loopback), and on a cluster on its node's Ray
  address (``ray.util.get_node_ip_address()``, the LAN address even for a local ``ray.init()``, hence the rule);
  over ``torch_rpc`` the ``torch.distributed.rpc`` rendezvous is hosted by trainer rank 0 there, on a port picked
  there (:class:`jobs.trainer.servers.ServerTables`);
- each metrics exporter binds on its own node (:func:`serve_exporter`): on ``127.0.0.1`` by default, or on
  the node's Ray address with ``[metrics] host = "node"``; it reports the (address, port) it really bound to
  (:func:`where`), and the launcher rewrites Prometheus' file-SD ``targets.json`` with them;
- gloo (DDP) and TensorPipe (the parameter-server RPC group) pick the address they listen on and advertise
  from ``GLOO_SOCKET_IFNAME`` / ``TP_SOCKET_IFNAME``; otherwise they resolve the host name, which on many
  hosts (and in network namespaces) gives ``127.0.0.1``, so remote peers connect to their own loopback.
  :func:`set_socket_ifnames` sets both to the interface that owns the node's Ray address. On a cluster the
  launcher passes it to ``ray.init`` as ``runtime_env={"worker_process_setup_hook": SETUP_HOOK}``, so every
  worker process (Ray Train's trainers included, whose gloo group exists before the train loop runs) sets
  them on start; the RPC group members also call it before joining a group whose rendezvous address is not
  loopback. On one host over loopback nothing is set.

Placement (``[cluster] placement``):

- ``"pack"`` (default): Ray Train's ``PACK`` placement group for the trainers; the parameter servers use
  Ray's default scheduling (which may put these zero-CPU actors on any node);
- ``"spread"``: the trainers' placement group is ``SPREAD`` (one trainer per node where possible); the
  servers go round-robin over the alive nodes, those that cannot hold a trainer (fewer CPUs / GPUs than one
  trainer reserves) first (:func:`server_nodes`), each sent there with Ray's node label selector
  (``label_selector={"ray.io/node-id": <id>}``) and a fallback to any node (``fallback_strategy``), so
  that Ray can restart it elsewhere when its node dies (:func:`server_options`). Measured with Ray 2.60
  on the 3-host test cluster: a soft ``NodeAffinitySchedulingStrategy`` sent zero-CPU actors to other
  nodes although the chosen node could run them, and a hard one makes the restart of an actor whose
  node died fail (``ActorUnschedulableError``); the selector with a fallback does neither.

Node failure: when a node dies (its raylet is gone; ``ray.nodes()`` says ``Alive: False``), its
processes die with it. Ray Train sees the worker group fail and restarts it from the last checkpoint
(``[job] max_failures``) on the nodes that remain, which must have room for every trainer; Ray restarts
each lost server actor (``max_restarts``) on another node through the fallback, and the new group's rank 0
waits for it before the group forms (:class:`jobs.trainer.servers.ServerGroup`). The checkpoints must therefore be on
storage every node reads (``[job] run_dir`` on a shared file system). The launcher's own actors (the
:class:`jobs.launcher.launch.JobState` and Ray Train's controller) are pinned to the launcher's node
(:func:`here_options`), so only the launcher's node must stay up. The launcher notes each node that ran a
trainer or server and died (:class:`NodeWatch`) in ``results.json`` (``nodes_lost``) and the table.

Source: Ray placement groups, scheduling strategies and label selectors (``label_selector``,
``fallback_strategy``; Ray Train pins its controller the same way); Ray runtime_env ``worker_process_setup_hook``;
torch.distributed's ``GLOO_SOCKET_IFNAME`` and TensorPipe's ``TP_SOCKET_IFNAME``; psutil.net_if_addrs.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from collections.abc import MutableMapping
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from jobs.records import MetricsTLS, NodeLost, Where
    from jobs.results import JobResults

__all__ = ["PLACEMENTS", "SETUP_HOOK", "NODE_ID_LABEL", "RayNode", "ActorPlacement", "interface_of", "is_loopback", "node_address",
           "set_socket_ifnames", "serve_exporter", "where", "server_nodes", "server_options", "here_options",
           "trainer_strategy", "placement_lines", "lost_nodes", "NodeWatch", "launcher_address",
           "loopback_elsewhere"]

PLACEMENTS = ("pack", "spread")
"""Values of ``[cluster] placement``."""
SETUP_HOOK = "jobs.cluster.set_socket_ifnames"
"""The ``worker_process_setup_hook`` the launcher gives ``ray.init`` on a cluster."""
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
NODE_ID_LABEL = "ray.io/node-id"
"""Ray's default node label holding the node id (what ``label_selector`` matches)."""


class RayNode(TypedDict, total=False):
    """One node of ``ray.nodes()``: the keys read here (Ray's dict has more)."""

    NodeID: str
    Alive: bool
    Resources: dict[str, float]
    """Resource name (``CPU``, ``GPU``...) -> its total on the node."""


class ActorPlacement(TypedDict, total=False):
    """``.options(...)`` keyword arguments that place an actor (:func:`server_options`, :func:`here_options`)."""

    label_selector: dict[str, str]
    """Node label -> the value a node must have (:data:`NODE_ID_LABEL` -> a node id)."""
    fallback_strategy: list[dict[str, dict[str, str]]]
    """Where else the actor may go when no node matches: ``[{"label_selector": {}}]``, any node."""


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP address, or ``localhost``) is a loopback address."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def interface_of(address: str, interfaces: dict[str, list[Any]] | None = None) -> str | None:
    """The name of the network interface that holds IP ``address`` (``"eth0"``), or None.

    ``interfaces``: ``psutil.net_if_addrs()`` (read when None): name -> list of entries with ``.address``.
    """
    if interfaces is None:
        interfaces = _psutil().net_if_addrs()
    for name, addrs in interfaces.items():
        for entry in addrs:
            if entry.family in (socket.AF_INET, socket.AF_INET6) and entry.address.split("%")[0] == address:
                return name
    return None


def _psutil() -> Any:
    """psutil (requirements.txt); without it, the copy Ray vendors, which ``import ray`` puts on sys.path."""
    try:
        import psutil
    except ImportError:
        import psutil
        import ray  # noqa: F401  (adds ray/thirdparty_files to sys.path)
    return psutil


def node_address() -> str:
    """This process's Ray node address (``ray.util.get_node_ip_address()``)."""
    import ray.util

    return ray.util.get_node_ip_address()


def set_socket_ifnames(address: str | None = None) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` and ``TP_SOCKET_IFNAME`` to the interface that owns ``address``.

    ``address``: default this node's Ray address (:func:`node_address`). Nothing is set for a loopback
    address, for an address no local interface holds, or for a variable that is already set (the user's
    choice wins). Safe to call more than once. Ray calls it with no argument as a
    ``worker_process_setup_hook`` (:data:`SETUP_HOOK`).

    Returns:
        The interface name, or None when nothing was set.
    """
    address = address or node_address()
    if is_loopback(address):
        return None
    name = interface_of(address)
    if name is None:
        return None
    for var in IFNAME_VARS:
        os.environ.setdefault(var, name)
    return name


def serve_exporter(exporter: Any, host: str, port: int, tls: MetricsTLS | None = None) -> tuple[str, int]:
    """Serve ``exporter`` (:class:`jobs.trainer.metrics.Exporter`) on this node and return the (address, port) bound.

    ``host``: ``[metrics] host``; ``"node"`` means this node's Ray address. ``port`` is tried first; when
    it is taken on this node (the launcher checked only its own), a free port of this node is used instead.
    ``tls``: :func:`jobs.trainer.metrics.tls_options` (HTTPS), or None.
    """
    address = node_address() if host == "node" else host
    try:
        bound = exporter.serve(port, address, tls)
    except OSError:
        bound = exporter.serve(0, address, tls)
    return address, bound


def where(metrics: tuple[str, int] | None = None) -> Where:
    """Where this process runs: ``{"node_id", "address", "hostname", "pid", "metrics": [address, port] | None,
    "ifnames": {"GLOO_SOCKET_IFNAME": ..., "TP_SOCKET_IFNAME": ...}}`` (the variables that are set)."""
    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "address": node_address(),
            "hostname": socket.gethostname(), "pid": os.getpid(),
            "metrics": list(metrics) if metrics is not None else None,
            "ifnames": {var: os.environ[var] for var in IFNAME_VARS if var in os.environ}}


TRAIN_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
"""Ray Train's environment variable for the seconds between its controller's polls of the worker group."""
TRAIN_POLL_S = 0.5
"""The poll interval a launch gives Ray Train's controller unless ``$RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` is set
(:func:`set_train_poll`)."""


def set_train_poll(environ: MutableMapping[str, str] | None = None) -> float:
    """Set Ray Train's controller poll interval (``$RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``) to :data:`TRAIN_POLL_S`
    unless it is set already; returns the interval in force, seconds. ``environ``: :data:`os.environ` when None.

    The controller polls the workers every 2 s by default (Ray Train 2.60, ``DEFAULT_HEALTH_CHECK_INTERVAL_S``), and
    only a poll tells it that training ended, a worker died or a checkpoint was reported: each job's end, each
    restart and each checkpoint's registration waited up to that long. A poll is a small actor task per trainer; a
    poll that outlasts the interval is awaited by the next one (a worker is declared dead only after
    ``$RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S``), so a loaded machine only sees late polls. Ray Train passes the
    variable on from the launcher's environment to its controller and workers.
    """
    env = os.environ if environ is None else environ
    env.setdefault(TRAIN_POLL_ENV, f"{TRAIN_POLL_S:g}")
    return float(env[TRAIN_POLL_ENV])


def trainer_strategy(placement: str) -> str:
    """Ray Train's ``ScalingConfig(placement_strategy=...)`` for ``[cluster] placement``."""
    return {"pack": "PACK", "spread": "SPREAD"}[placement]


def server_nodes(nodes: list[RayNode], count: int, cpus_per_trainer: float, use_gpu: bool) -> list[str]:
    """Node ids for ``count`` parameter servers under ``placement = "spread"``: round-robin over the alive
    nodes, those that cannot hold a trainer first (fewer CPUs than ``cpus_per_trainer``, or no GPU with
    ``use_gpu``), then by fewer CPUs and node id (a stable order).

    ``nodes``: ``ray.nodes()`` (dicts with ``Alive``, ``NodeID``, ``Resources``).

    Raises:
        RuntimeError: no alive node.
    """
    alive = [n for n in nodes if n.get("Alive")]
    if not alive:
        raise RuntimeError("placement: Ray reports no alive node")

    def key(n: RayNode) -> tuple[bool, float, str]:
        res = n.get("Resources", {})
        fits = res.get("CPU", 0.0) >= cpus_per_trainer and (not use_gpu or res.get("GPU", 0.0) >= 1)
        return fits, res.get("CPU", 0.0), n["NodeID"]

    order = [n["NodeID"] for n in sorted(alive, key=key)]
    return [order[i % len(order)] for i in range(count)]


def server_options(config: Any, nodes: list[RayNode] | None = None) -> list[ActorPlacement]:
    """``.options(...)`` keyword arguments of each server actor for ``[cluster] placement`` (empty for pack).

    ``"spread"``: the node of :func:`server_nodes` as a label selector, with a fallback to any node (where
    Ray restarts the actor once that node has died). ``nodes``: ``ray.nodes()`` (read when None).
    """
    c = config.cluster
    if c.placement != "spread":
        return [{} for _ in range(c.parameter_servers)]
    if nodes is None:
        import ray

        nodes = ray.nodes()
    ids = server_nodes(nodes, c.parameter_servers, c.cpus_per_trainer, c.use_gpu)
    return [{"label_selector": {NODE_ID_LABEL: node_id}, "fallback_strategy": [{"label_selector": {}}]}
            for node_id in ids]


def here_options() -> ActorPlacement:
    """``.options(...)`` keyword arguments that keep an actor on this process's node (no fallback): the
    launcher's own actors, which must outlive any other node (as Ray Train pins its controller)."""
    import ray

    return {"label_selector": {NODE_ID_LABEL: ray.get_runtime_context().get_node_id()}}


def lost_nodes(seen: list[tuple[str, Where]], nodes: list[RayNode],
               known: AbstractSet[str] = frozenset()) -> list[NodeLost]:
    """The nodes that ran a process of the job and are now dead, leaving out node ids in ``known``.

    Args:
        seen: ``(name, where(...))`` pairs (``JobState.placed`` reports): a process that moved appears once
            per node it ran on.
        nodes: ``ray.nodes()`` (dicts with ``NodeID``, ``Alive``); a node missing from it counts as dead.
        known: node ids already reported.

    Returns:
        ``[{"node_id", "address", "ran": [names]}]``, sorted by address.
    """
    alive = {n["NodeID"] for n in nodes if n.get("Alive")}
    lost: dict[str, NodeLost] = {}
    for name, info in sorted(seen, key=lambda x: x[0]):
        node = info.get("node_id")
        if node and node not in alive and node not in known:
            entry = lost.setdefault(node, {"node_id": node, "address": info.get("address"), "ran": []})
            if name not in entry["ran"]:
                entry["ran"].append(name)
    return sorted(lost.values(), key=lambda x: (str(x["address"]), x["node_id"]))


class NodeWatch:
    """The launcher's watch for dead nodes: :meth:`poll` gets the latest placement at every progress poll and,
    at most every ``every_s`` seconds, asks Ray which nodes are alive; it returns each node that ran a process
    of the job and died, once (:func:`lost_nodes`)."""

    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s, self.next_check = every_s, 0.0
        self.seen: dict[tuple[str, str], Where] = {}
        self.reported: set[str] = set()

    def poll(self, placement: dict[str, Where]) -> list[NodeLost]:
        for name, info in placement.items():
            self.seen[(name, str(info.get("node_id")))] = info
        now = time.monotonic()
        if now < self.next_check or not self.seen:
            return []
        self.next_check = now + self.every_s
        import ray

        lost = lost_nodes([(name, info) for (name, _), info in self.seen.items()], ray.nodes(), self.reported)
        self.reported.update(x["node_id"] for x in lost)
        return lost


def placement_lines(results: JobResults) -> list[str]:
    """The results table's lines on where each trainer and server ran last (``results["placement"]``), and
    on each node lost during the job (``results["nodes_lost"]``)."""
    placed: dict[str, Where] = results.get("placement") or {}
    if not placed:
        return []
    mode = ((results.get("config") or {}).get("cluster") or {}).get("placement", "pack")
    nodes = {p.get("node_id") for p in placed.values()}
    where_ = ", ".join(f"{name} {p.get('address')} (node {str(p.get('node_id'))[:8]}"
                       f"{', in ' + p['in'] if p.get('in') else ''})"
                       for name, p in sorted(placed.items(), key=lambda kv: (kv[0].startswith("ps"), kv[0])))
    lines = [f"placement ({mode}, {len(nodes)} node{'s' if len(nodes) != 1 else ''}): {where_}"]
    nodes_lost: list[NodeLost] = results.get("nodes_lost") or []
    for lost in nodes_lost:
        lines.append(f"node lost: {lost.get('address')} (node {str(lost.get('node_id'))[:8]}), which ran "
                     f"{', '.join(lost.get('ran', []))}; they restarted on the remaining nodes")
    return lines


def launcher_address(placement: dict[str, Where]) -> str | None:
    """The launcher's Ray node address when some process reported a placement and Ray runs, else None."""
    if not placement:
        return None
    try:
        return node_address()
    except Exception:  # Ray not initialised: every address counts as reachable
        return None


def loopback_elsewhere(placement: dict[str, Where], here: str | None) -> list[str]:
    """Names of the processes whose exporter listens on loopback on another node than ``here``."""
    return sorted(name for name, info in placement.items()
                  if (metrics := info.get("metrics")) and is_loopback(metrics[0]) and here is not None
                  and info.get("address") != here)
