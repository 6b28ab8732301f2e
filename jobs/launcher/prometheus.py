"""Prometheus for a job: the file-based service discovery of its exporters and the scrape config.

The launcher writes ``<run>/prometheus/prometheus.yml`` (rendered from ``dashboards/prometheus.yml``, with the
alerting rules of ``dashboards/rules.yml``) and ``<run>/prometheus/targets.json``, one target group per metrics
exporter (each trainer, each parameter server). Once the processes report where their exporters really bound
(:func:`jobs.cluster.where`, recorded by ``JobState.placed``), the launcher rewrites the targets with those
addresses (:func:`retarget`); Prometheus re-reads the file without a restart.

Source: Prometheus' ``file_sd_configs`` (Prometheus documentation, "Configuration": file-based service
discovery).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from jobs.cluster import launcher_address, loopback_elsewhere

if TYPE_CHECKING:
    from jobs.records import Where

__all__ = ["DASHBOARDS", "FileSDGroup", "write_prometheus_files", "file_sd_groups", "retarget"]

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
"""The repository's Prometheus and Grafana files."""


class FileSDGroup(TypedDict):
    """One target group of ``targets.json`` (Prometheus' file-based service discovery)."""

    targets: list[str]
    """``"address:port"`` of the exporter."""
    labels: dict[str, str]
    """``fxdist_job``, ``role`` and, once known, ``node``."""


def write_prometheus_files(config: Any, run_dir: Path, placement: dict[str, Where] | None = None, *,
                           in_trainers: bool = False) -> Path:
    """Write ``prometheus/targets.json`` (file-based service discovery) and ``prometheus/prometheus.yml``.

    Targets, one group each, with labels ``fxdist_job``, ``role`` (trainer | parameter_server) and, once
    known, ``node`` (the node's Ray address): the (address, port) each exporter reported in ``placement``
    (``JobState.placed``, :func:`jobs.cluster.serve_exporter`); until then the configured ones, trainer rank
    r at ``host:port + r`` and parameter server i at ``host:port + trainers + i`` (left out with
    ``[metrics] host = "node"``, whose address is known only once the exporter runs). An exporter bound to
    loopback on another node than the launcher's cannot be scraped from here: it is left out (see
    :func:`file_sd_groups`). With ``[metrics] certfile`` the scrape job uses HTTPS and trusts that certificate. Servers inside the trainers (``in_trainers``, :mod:`jobs.hosting`) have no exporter of
    their own: their trainer's exports their metrics. The file is replaced atomically (Prometheus re-reads it).
    Returns the prometheus.yml path.
    """
    out = run_dir / "prometheus"
    out.mkdir(parents=True, exist_ok=True)
    groups = file_sd_groups(config, placement or {}, in_trainers=in_trainers)
    tmp = out / "targets.json.tmp"
    tmp.write_text(json.dumps(groups, indent=2) + "\n")
    tmp.replace(out / "targets.json")
    template = (DASHBOARDS / "prometheus.yml").read_text()
    rendered = template.replace("{{TARGETS_DIR}}", str(out)).replace("{{RULES}}", str(DASHBOARDS / "rules.yml"))
    if config.metrics.certfile:  # the exporters serve HTTPS: trust their certificate (itself, when self-signed)
        tls = f'    scheme: https\n    tls_config:\n      ca_file: "{config.metrics.certfile}"\n'
        if config.metrics.client_cafile:
            tls += "      # cert_file, key_file: a client certificate signed by [metrics] client_cafile\n"
        rendered = rendered.replace("    honor_labels: true\n", "    honor_labels: true\n" + tls)
    (out / "prometheus.yml").write_text(rendered)
    return out / "prometheus.yml"


def file_sd_groups(config: Any, placement: dict[str, Where], *, in_trainers: bool = False) -> list[FileSDGroup]:
    """Prometheus file-SD target groups of a job, one per exporter (see :func:`write_prometheus_files`).

    A process in ``placement`` (``JobState.placed``: :func:`where`) is listed at the (address, port) its
    exporter reported, with label ``node``; one not reported yet at the configured ``host:port + offset``
    (trainer rank r: r; server i: trainers + i), or not at all with ``[metrics] host = "node"``. Exporters
    on loopback of another node than the launcher's (:func:`jobs.cluster.loopback_elsewhere`) are left out, and so
    are servers inside the trainers (``in_trainers``, or a placement saying ``"in"``: their trainer exports them).
    """
    m, c = config.metrics, config.cluster
    host = "127.0.0.1" if m.host in ("", "0.0.0.0") else m.host
    away = set(loopback_elsewhere(placement, launcher_address(placement)))
    names = [(f"trainer{r}", "trainer", m.port + r) for r in range(c.trainers)]
    names += [(f"ps{i}", "parameter_server", m.port + c.trainers + i) for i in range(c.parameter_servers)]
    groups: list[FileSDGroup] = []
    for name, role, port in names:
        labels = {"fxdist_job": config.job.name, "role": role}
        info: Where = placement.get(name) or {}
        if role == "parameter_server" and (in_trainers or info.get("in")):
            continue
        if metrics := info.get("metrics"):
            addr, port = metrics
            labels["node"] = info.get("address", "")
        elif m.host == "node":
            continue
        else:
            addr = host
        if name not in away:
            groups.append({"targets": [f"{addr}:{port}"], "labels": labels})
    return groups


def retarget(config: Any, run_dir: Path, placement: dict[str, Where], log: Any, warned: set[str], *,
             in_trainers: bool = False) -> None:
    """Rewrite targets.json with the exporters' real addresses; warn about unreachable ones once each."""
    write_prometheus_files(config, run_dir, placement, in_trainers=in_trainers)
    for name in loopback_elsewhere(placement, launcher_address(placement)):
        if name not in warned:
            warned.add(name)
            log(f"{name}'s metrics exporter listens on 127.0.0.1 of node {placement[name].get('address')}: "
                'left out of targets.json (set [metrics] host = "node" and expose = true to scrape it from another '
                "host)")
