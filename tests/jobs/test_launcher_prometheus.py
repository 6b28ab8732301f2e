"""jobs.launcher.prometheus: the job's Prometheus targets follow where the exporters really run."""

from __future__ import annotations

import json

import jobs.cluster as cluster
from jobs.config import load_config
from jobs.launcher.prometheus import write_prometheus_files
from tests.jobs._placement import where_info as _where


def test_targets_follow_the_reported_addresses(tmp_path, monkeypatch):
    config = load_config().replace(metrics={"port": 19000}, job={"name": "t"})
    write_prometheus_files(config, tmp_path)
    groups = json.loads((tmp_path / "prometheus" / "targets.json").read_text())
    assert [g["targets"] for g in groups] == [["127.0.0.1:19000"], ["127.0.0.1:19001"], ["127.0.0.1:19002"]]
    assert [g["labels"]["role"] for g in groups] == ["trainer", "trainer", "parameter_server"]
    # what the processes reported: trainer1 moved to another port, the server is on another node
    monkeypatch.setattr(cluster, "node_address", lambda: "10.0.0.1")
    placement = {"trainer0": _where("10.0.0.1", ("127.0.0.1", 19000)),
                 "trainer1": _where("10.0.0.1", ("127.0.0.1", 40000)),
                 "ps0": _where("10.0.0.2", ("127.0.0.1", 19002))}
    write_prometheus_files(config, tmp_path, placement)
    groups = json.loads((tmp_path / "prometheus" / "targets.json").read_text())
    # ps0's exporter listens on its own node's loopback: unreachable from here, left out
    assert [(g["targets"], g["labels"]["node"]) for g in groups] == [
        (["127.0.0.1:19000"], "10.0.0.1"), (["127.0.0.1:40000"], "10.0.0.1")]
    assert cluster.loopback_elsewhere(placement, "10.0.0.1") == ["ps0"]
    node = config.replace(metrics={"host": "node", "expose": True})
    write_prometheus_files(node, tmp_path)  # addresses not known yet
    assert json.loads((tmp_path / "prometheus" / "targets.json").read_text()) == []
    placement["ps0"] = _where("10.0.0.2", ("10.0.0.2", 19002))
    write_prometheus_files(node, tmp_path, {"ps0": placement["ps0"]})
    groups = json.loads((tmp_path / "prometheus" / "targets.json").read_text())
    assert groups == [{"targets": ["10.0.0.2:19002"], "labels": {"fxdist_job": "t", "role": "parameter_server",
                                                                 "node": "10.0.0.2"}}]


def test_servers_in_the_trainers_get_no_target_of_their_own(tmp_path):
    """Their trainer's exporter exports them (``rank="ps<i>"``): a ps target would only be down."""
    config = load_config().replace(metrics={"port": 19000}, job={"name": "t"})
    write_prometheus_files(config, tmp_path, in_trainers=True)
    groups = json.loads((tmp_path / "prometheus" / "targets.json").read_text())
    assert [(g["targets"], g["labels"]["role"]) for g in groups] == [(["127.0.0.1:19000"], "trainer"),
                                                                    (["127.0.0.1:19001"], "trainer")]
    placement = {"ps0": {**_where("10.0.0.1", None), "in": "trainer0"}}  # as a trainer hosting ps0 reports it
    write_prometheus_files(config, tmp_path, placement)
    assert len(json.loads((tmp_path / "prometheus" / "targets.json").read_text())) == 2


def test_https_exporters_are_scraped_over_https(tmp_path):
    """[metrics] certfile: the scrape job uses HTTPS and trusts that certificate; plain HTTP otherwise."""
    config = load_config().replace(metrics={"port": 19000, "certfile": "/etc/fx/c.pem", "keyfile": "/etc/fx/k.pem"})
    text = write_prometheus_files(config, tmp_path).read_text()
    assert '    honor_labels: true\n    scheme: https\n    tls_config:\n      ca_file: "/etc/fx/c.pem"\n' in text
    assert "scheme" not in write_prometheus_files(load_config(), tmp_path / "plain").read_text()
