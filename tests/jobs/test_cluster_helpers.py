"""Cluster helpers without Ray (:mod:`jobs.cluster`): interfaces, server placement, exporter binding, the
file-SD targets rewritten with the addresses the processes reported, and the results-table line.

The end-to-end check on a 3-host cluster is tests/jobs/test_cluster.py.
"""

from __future__ import annotations

import socket
import urllib.request
from collections import namedtuple

import pytest

import jobs.cluster as cluster
from jobs.config import ConfigError, load_config, parse_config
from jobs.launcher.launch import JobState
from jobs.results import JobResults
from jobs.trainer.metrics import Exporter
from tests.jobs._placement import where_info as _where

Addr = namedtuple("Addr", "family address")


def _results(**fields) -> JobResults:
    """A run's results with a spread placement config and ``fields`` (placement, nodes_lost)."""
    return JobResults(job=None, config={"cluster": {"placement": "spread"}}, phases={}, **fields)


def test_interface_of_finds_the_interface_holding_an_address():
    fake = {"lo": [Addr(socket.AF_INET, "127.0.0.1")],
            "eth1": [Addr(socket.AF_PACKET, "aa:bb:cc:dd:ee:ff"), Addr(socket.AF_INET, "10.77.0.2"),
                     Addr(socket.AF_INET6, "fe80::1%eth1")]}
    assert cluster.interface_of("10.77.0.2", fake) == "eth1"
    assert cluster.interface_of("fe80::1", fake) == "eth1"
    assert cluster.interface_of("10.77.0.3", fake) is None
    assert cluster.interface_of("127.0.0.1") is not None  # this machine's loopback, through psutil


def _non_loopback_ipv4() -> tuple[str, str] | None:
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET and not cluster.is_loopback(a.address):
                return name, a.address
    return None


def test_set_socket_ifnames(monkeypatch):
    for var in cluster.IFNAME_VARS:
        monkeypatch.delenv(var, raising=False)
    assert cluster.set_socket_ifnames("127.0.0.1") is None  # one host over loopback: nothing changes
    assert cluster.set_socket_ifnames("192.0.2.55") is None  # an address no interface here holds
    assert not any(var in __import__("os").environ for var in cluster.IFNAME_VARS)
    found = _non_loopback_ipv4()
    if found is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    name, address = found
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine")  # the user's choice is kept
    assert cluster.set_socket_ifnames(address) == name
    import os

    assert os.environ["TP_SOCKET_IFNAME"] == name and os.environ["GLOO_SOCKET_IFNAME"] == "mine"


def _node(node_id: str, cpus: float | None, alive: bool = True, gpus: float = 0) -> dict:
    res = {"memory": 1e9}
    if cpus is not None:
        res["CPU"] = cpus
    if gpus:
        res["GPU"] = gpus
    return {"NodeID": node_id, "Alive": alive, "Resources": res}


def test_server_nodes_prefers_nodes_without_room_for_a_trainer():
    nodes = [_node("c", 4), _node("a", 2), _node("head", None), _node("dead", 0, alive=False)]
    assert cluster.server_nodes(nodes, 1, 1.0, False) == ["head"]
    assert cluster.server_nodes(nodes, 4, 1.0, False) == ["head", "a", "c", "head"]
    # a node too small for one trainer comes first; with use_gpu, any node without a GPU
    assert cluster.server_nodes([_node("big", 8), _node("small", 1)], 2, 2.0, False) == ["small", "big"]
    assert cluster.server_nodes([_node("gpu", 8, gpus=1), _node("cpu", 16)], 1, 1.0, True) == ["cpu"]
    with pytest.raises(RuntimeError, match="no alive node"):
        cluster.server_nodes([_node("dead", 1, alive=False)], 1, 1.0, False)


def test_placement_is_checked_and_mapped_to_ray_train():
    assert load_config().cluster.placement == "pack"
    assert cluster.trainer_strategy("pack") == "PACK" and cluster.trainer_strategy("spread") == "SPREAD"
    with pytest.raises(ConfigError, match=r'\[cluster\] placement = \'ring\': must be "pack" or "spread"'):
        parse_config({"cluster": {"placement": "ring"}})


def test_serve_exporter_falls_back_to_a_free_port_of_its_node():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        e = Exporter("demo", "0")
        try:
            address, bound = cluster.serve_exporter(e, "127.0.0.1", port)
            assert address == "127.0.0.1" and bound != port
            body = urllib.request.urlopen(f"http://127.0.0.1:{bound}/metrics", timeout=5).read().decode()
            assert "fxdist_samples_total" in body or "fxdist_loss" in body
        finally:
            e.close()


def test_job_state_records_placement_and_the_table_line():
    state = JobState()
    state.placed("trainer0", _where("10.0.0.1", None))
    state.placed("ps0", _where("10.0.0.2", None))
    state.placed("trainer1", _where("10.0.0.3", None))
    placed = state.snapshot()["placement"]
    assert set(placed) == {"trainer0", "trainer1", "ps0"}
    line = cluster.placement_lines(_results(placement=placed))
    assert line == ["placement (spread, 3 nodes): trainer0 10.0.0.1 (node node-10.), trainer1 10.0.0.3 "
                    "(node node-10.), ps0 10.0.0.2 (node node-10.)"]
    assert cluster.placement_lines(JobResults(job=None, config={}, phases={})) == []


def test_spread_servers_prefer_their_node_and_may_restart_elsewhere():
    nodes = [_node("w1", 2), _node("head", None), _node("w2", 2)]
    config = load_config().replace(cluster={"placement": "spread", "parameter_servers": 2})
    options = cluster.server_options(config, nodes)
    assert [o["label_selector"] for o in options] == [{cluster.NODE_ID_LABEL: "head"}, {cluster.NODE_ID_LABEL: "w1"}]
    # the fallback lets Ray restart the actor on any node once its own has died
    assert all(o["fallback_strategy"] == [{"label_selector": {}}] for o in options)
    assert cluster.server_options(config.replace(cluster={"placement": "pack"}), nodes) == [{}, {}]


def test_lost_nodes_names_each_dead_node_once_with_what_ran_there():
    seen = [("trainer0", _where("10.0.0.2", None)), ("ps1", _where("10.0.0.2", None)),
            ("trainer1", _where("10.0.0.3", None)), ("ps0", _where("10.0.0.1", None)),
            ("trainer0", _where("10.0.0.3", None))]  # trainer0 moved after 10.0.0.2 died
    nodes = [_node("node-10.0.0.1", 0), _node("node-10.0.0.2", 2, alive=False), _node("node-10.0.0.3", 2)]
    assert cluster.lost_nodes(seen, nodes) == [{"node_id": "node-10.0.0.2", "address": "10.0.0.2",
                                               "ran": ["ps1", "trainer0"]}]
    assert cluster.lost_nodes(seen, nodes, known={"node-10.0.0.2"}) == []
    # a node Ray no longer lists counts as dead
    assert [x["address"] for x in cluster.lost_nodes(seen, nodes[:1])] == ["10.0.0.2", "10.0.0.3"]


def test_node_watch_reports_a_node_once_also_after_its_processes_moved(monkeypatch):
    import ray

    alive = {"node-10.0.0.1": True, "node-10.0.0.2": True}
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": n, "Alive": a} for n, a in alive.items()])
    watch = cluster.NodeWatch(every_s=0.0)
    assert watch.poll({"trainer0": _where("10.0.0.2", None), "ps0": _where("10.0.0.1", None)}) == []
    alive["node-10.0.0.2"] = False
    moved = {"trainer0": _where("10.0.0.1", None), "ps0": _where("10.0.0.1", None)}  # restarted elsewhere
    assert watch.poll(moved) == [{"node_id": "node-10.0.0.2", "address": "10.0.0.2", "ran": ["trainer0"]}]
    assert watch.poll(moved) == []


def test_placement_lines_tell_the_lost_nodes():
    results = _results(placement={"trainer0": _where("10.0.0.3", None)},
                       nodes_lost=[{"node_id": "node-10.0.0.2", "address": "10.0.0.2", "ran": ["ps1", "trainer1"]}])
    assert cluster.placement_lines(results)[1] == ("node lost: 10.0.0.2 (node node-10.), which ran ps1, trainer1; "
                                                   "they restarted on the remaining nodes")


def test_a_launch_shortens_ray_trains_poll_unless_it_is_set():
    env: dict[str, str] = {}
    assert cluster.set_train_poll(env) == cluster.TRAIN_POLL_S == 0.5
    assert env == {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
    env = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "3"}  # the user's value stays
    assert cluster.set_train_poll(env) == 3.0 and env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "3"
    from ray.train.v2._internal.constants import ENV_VARS_TO_PROPAGATE, HEALTH_CHECK_INTERVAL_S_ENV_VAR

    # Ray Train reads this variable and passes it from the launcher's environment to its controller and workers
    assert cluster.TRAIN_POLL_ENV == HEALTH_CHECK_INTERVAL_S_ENV_VAR and cluster.TRAIN_POLL_ENV in ENV_VARS_TO_PROPAGATE
