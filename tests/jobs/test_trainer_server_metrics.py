"""Parameter-server metrics read at scrape time (:mod:`jobs.trainer.server_metrics`), and a real Prometheus scraping a
server actor's exporter (``scheduling.ps.PSActor`` with the job's ``ServerHooks``, in process)."""

from __future__ import annotations

import asyncio
import collections
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch

from jobs.trainer.metrics import Exporter, free_port
from jobs.trainer.server_metrics import SERVER_METRICS, split_namespace
from scheduling.ps.dynamic import DynamicSpec
from scheduling.ps.server import PSServer
from scheduling.ps.shard_plan import TableSpec, plan_shards

NS = "fxdist-job-optimized:sparse.ebc"
TABLES = [TableSpec("fixed", 20, 4, ("fa",)),
          TableSpec("dyn", 10, 4, ("fb",), dynamic=DynamicSpec(capacity=3, min_count=1))]


def _batch(step: int):
    """Batch size 2; the dynamic table (capacity 3) sees 4 new ids each step."""
    return ("fa", "fb"), torch.cat([torch.tensor([1, 2, 3]), torch.arange(4) + 100 * step]), torch.tensor([2, 1, 2, 2]), None


def _server() -> PSServer:
    srv = PSServer("ps0")
    srv.configure(NS, plan_shards(TABLES, 1), 0, "rowwise_adagrad", {"lr": 0.5}, seed=3)
    return srv


def test_namespace_gives_phase_and_module():
    assert split_namespace(NS) == ("optimized", "sparse.ebc")
    assert split_namespace("fxdist-job-baseline") == ("baseline", "")
    assert split_namespace("emb") == ("emb", "")


def test_server_metrics_per_table_and_request_read_at_scrape():
    from scheduling.ps.endpoints import ServerEndpoints

    srv, e = _server(), Exporter("j", "ps0")
    e.watch_server(srv)
    get = e.registry.get_sample_value
    ends = ServerEndpoints(srv)
    for step in range(2):
        out = ends.lookup(NS, _batch(step))
        ends.push(NS, _batch(step), torch.ones_like(out))
    server = {"job": "j", "rank": "ps0", "phase": "optimized", "module": "sparse.ebc"}
    assert get("fxdist_ps_server_lookup_seconds_count", server) == 2
    assert get("fxdist_ps_server_push_seconds_count", server) == 2
    assert get("fxdist_ps_server_lookup_seconds_bucket", {**server, "le": "+Inf"}) == 2
    assert get("fxdist_ps_server_push_seconds_sum", server) > 0
    fixed, dyn = {**server, "table": "fixed"}, {**server, "table": "dyn"}
    counters = srv.shards[f"{NS}/dyn@0"].dynamic.stats()
    assert get("fxdist_ps_rows", fixed) == 20 and get("fxdist_ps_rows", dyn) == counters["rows"] == 3
    assert get("fxdist_ps_bytes", fixed) == 20 * 4 * 4 + 20 * 4
    assert get("fxdist_ps_inserts_total", dyn) == counters["inserts"] == 8
    assert get("fxdist_ps_evictions_total", dyn) == counters["evictions"] == 3
    assert get("fxdist_ps_inserts_total", fixed) is None       # fixed tables have no such counters
    assert get("fxdist_ps_pending_requests", {"job": "j", "rank": "ps0"}) == 0
    # a new server of the same process (a reset, a new RPC group) replaces the old one from the next scrape
    e.watch_server(PSServer("ps0"))
    assert get("fxdist_ps_rows", fixed) is None and get("fxdist_ps_server_lookup_seconds_count", server) is None


def test_refused_socket_connections_are_counted_per_reason():
    """A socket listener's refusals (``ServerStats.reject``, called by ``scheduling.ps.transport.socket_server``)
    are ``fxdist_ps_rejected_connections_total{reason}``, every reason from 0."""
    import socket as socket_module

    from scheduling.ps.endpoints import ServerEndpoints
    from scheduling.ps.server_stats import REJECT_REASONS
    from scheduling.ps.transport.socket_server import SocketServer

    srv, e = _server(), Exporter("j", "ps0")
    e.watch_server(srv)
    listener = SocketServer(ServerEndpoints(srv), handshake_timeout_s=5.0).start()
    try:
        host, _, port = listener.address.rpartition(":")
        with socket_module.create_connection((host, int(port))) as sock:
            sock.recv(48)
            sock.sendall(bytes(64))                      # a wrong proof
            sock.settimeout(5.0)
            assert sock.recv(1) == b""
        deadline = time.monotonic() + 5.0
        while not listener.rejected and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        listener.close()
    get = e.registry.get_sample_value
    labels = {"job": "j", "rank": "ps0"}
    assert get("fxdist_ps_rejected_connections_total", {**labels, "reason": "bad_auth"}) == 1
    assert all(get("fxdist_ps_rejected_connections_total", {**labels, "reason": r}) == 0
               for r in REJECT_REASONS if r != "bad_auth")


def test_staleness_histogram_per_phase_from_the_clients_counts():
    e = Exporter("j", "1")
    counts = {"optimized": collections.Counter({0: 3, 1: 5, 5: 1}), "baseline": collections.Counter()}
    e.watch_staleness(lambda: counts)
    get = e.registry.get_sample_value
    opt = {"job": "j", "phase": "optimized", "rank": "1"}
    assert get("fxdist_ps_staleness_steps_count", opt) == 9 and get("fxdist_ps_staleness_steps_sum", opt) == 10
    assert [get("fxdist_ps_staleness_steps_bucket", {**opt, "le": le}) for le in ("0.0", "1.0", "4.0", "8.0", "+Inf")] \
        == [3, 8, 8, 9, 9]
    assert get("fxdist_ps_staleness_steps_count", {**opt, "phase": "baseline"}) is None  # no lookups counted
    e.watch_staleness(lambda: {"optimized": collections.Counter({2: 1})})  # a later source replaces it
    assert get("fxdist_ps_staleness_steps_count", opt) == 1


# ---- a real Prometheus ------------------------------------------------------------------------------------------
def _prometheus() -> str:
    binary = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
    if binary is None:
        pytest.skip("the prometheus binary is not installed (scripts/bootstrap.sh installs Debian's prometheus)")
    return binary


def _query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.timeout(120)
def test_prometheus_scrapes_the_new_metrics_from_a_server_actors_exporter(tmp_path):
    from jobs.trainer.servers import ServerHooks
    from scheduling.ps.transport.ray_transport import PSActor

    binary = _prometheus()
    actor = PSActor("ps0", num_threads=None, serve_at_start=False,
                    hooks=ServerHooks("fxdist-prom", "ps0", ("127.0.0.1", free_port())))
    web = free_port()
    proc = None
    try:
        actor.reset()                                            # the server the job's trainers then configure
        actor.configure(NS, plan_shards(TABLES, 1), 0, "rowwise_adagrad", {"lr": 0.5}, 3)

        async def train() -> None:
            for step in range(3):
                out = await actor.lookup(NS, _batch(step), None, ("prom-client", 2 * step, 10.0))
                await actor.push(NS, _batch(step), torch.ones_like(out), ("prom-client", 2 * step + 1, 10.0))

        asyncio.run(train())
        config = tmp_path / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: ps\n    honor_labels: true\n"
                          f"    static_configs:\n      - targets: ['127.0.0.1:{actor.hooks.metrics[1]}']\n")
        proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{web}"],
                                stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"))
        names = list(SERVER_METRICS)
        exprs = {n: f'{{__name__=~"{n}(_count)?", job="fxdist-prom", rank="ps0"}}' for n in names}
        found: dict[str, list[dict]] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(found) < len(exprs):
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited with {proc.returncode}: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
            for name, expr in exprs.items():
                try:
                    result = _query(web, expr)
                except OSError:                                   # not listening yet
                    break
                if result:
                    found[name] = result
            time.sleep(0.5)
        assert sorted(found) == sorted(names), f"no samples for {sorted(set(names) - set(found))}"
        lookups = [r for r in found["fxdist_ps_server_lookup_seconds"] if r["metric"]["__name__"].endswith("_count")]
        assert [float(r["value"][1]) for r in lookups] == [3.0]
        assert lookups[0]["metric"]["phase"] == "optimized" and lookups[0]["metric"]["module"] == "sparse.ebc"
        assert {r["metric"]["table"] for r in found["fxdist_ps_rows"]} == {"fixed", "dyn"}
        assert {r["metric"]["table"] for r in found["fxdist_ps_evictions_total"]} == {"dyn"}
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        actor.close()
