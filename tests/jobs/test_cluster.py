"""``fxdist launch`` on a 3-host Ray cluster built on this machine with Linux network namespaces.

Each host is a network namespace ``<tag>h<i>`` with one veth interface (``fxeth0``, address 10.77.0.<i+1>/24)
plugged into a bridge in the root namespace that has no address: the hosts reach each other only through
the bridge, and their addresses exist nowhere else (no traffic leaves these namespaces). A host name that
resolves to loopback, the failure mode of a real cluster, is what every host here has. The head
(10.77.0.1, ``--num-cpus 0``) runs the Ray head and the launcher; the two others run Ray worker nodes with
one CPU each. The job (2 trainers, 1 parameter server, ``placement = "spread"``, ``[metrics] host =
"node"``) must put the trainers on the two worker hosts and the server on the head, form its gloo (DDP)
and TensorPipe (parameter-server RPC) groups across hosts, and tell where everything ran in results.json,
the table and Prometheus' file-SD ``targets.json``; a Prometheus in the head namespace scrapes every
exporter through that file.

Ray 2.60's token authentication: the head writes its token under the home directory, which the
namespaces share, and every process runs with ``RAY_AUTH_MODE=token`` so that it sends it.

Teardown always runs: every process in the test's namespaces is ended by its pid (``ray stop`` would stop
every Ray on the machine, not just these hosts), then the namespaces and the bridge are deleted. The test
skips when namespaces cannot be created (not root, no ``ip``, no permission).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from jobs.config import load_config
from jobs.launch import write_prometheus_files

pytestmark = pytest.mark.timeout(420)

ROOT = Path(__file__).resolve().parents[2]
HOSTS = 3
IFNAME = "fxeth0"
RAY_PORT = 6390
METRICS_PORT = 19400
JOB = [
    "job.steps=20", "job.batch_size=64", "job.checkpoint_every=10", "job.progress=false", "job.eval_epochs=0",
    "model.table_size=2000", "model.bottom_mlp=[32]", "model.top_mlp=[32]", "data.synthetic_rows=4000",
    "cluster.trainers=2", "cluster.parameter_servers=1", "cluster.cpus_per_trainer=1.0",
    'cluster.placement="spread"', 'metrics.host="node"', f"metrics.port={METRICS_PORT}",
    'phases.parity="warn"', "quant.enabled=false", 'job.name="fxdist-cluster"',
]


def _address(i: int) -> str:
    return f"10.77.0.{i + 1}"


def _sh(*args: str, check: bool = True, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited with {proc.returncode}:\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return proc


class NetnsCluster:
    """The namespaces, bridge and Ray nodes of one test run; :meth:`down` undoes all of it."""

    def __init__(self, tag: str, tmp: Path) -> None:
        self.tag, self.tmp = tag, tmp
        self.hosts = [f"{tag}h{i}" for i in range(HOSTS)]
        self.bridge = f"{tag}br"
        self.made_hosts: list[str] = []
        self.made_bridge = False
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "token",
                    "RAY_USAGE_STATS_ENABLED": "0"}
        self.env.pop("RAY_ADDRESS", None)

    def exec(self, host: int, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return _sh("ip", "netns", "exec", self.hosts[host], *args, env=self.env, **kwargs)

    def network(self) -> None:
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        self.made_bridge = True
        _sh("ip", "link", "set", self.bridge, "up")
        for i, ns in enumerate(self.hosts):
            _sh("ip", "netns", "add", ns)
            self.made_hosts.append(ns)
            veth = f"{self.tag}v{i}"
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            _sh("ip", "link", "set", veth, "master", self.bridge)
            _sh("ip", "link", "set", veth, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{_address(i)}/24", "dev", IFNAME)
            _sh("ip", "-n", ns, "link", "set", IFNAME, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def ray(self) -> None:
        ray = str(Path(sys.executable).with_name("ray"))
        common = ["--include-dashboard=false", "--disable-usage-stats"]
        self.exec(0, ray, "start", "--head", "--node-ip-address", _address(0), "--port", str(RAY_PORT),
                  "--num-cpus", "0", "--temp-dir", str(self.tmp / "r0"), *common, timeout=120)
        for i in range(1, HOSTS):
            self.exec(i, ray, "start", "--address", f"{_address(0)}:{RAY_PORT}", "--node-ip-address",
                      _address(i), "--num-cpus", "1", "--temp-dir", str(self.tmp / f"r{i}"),
                      "--disable-usage-stats", timeout=120)
        probe = (f"import ray; ray.init(address='{_address(0)}:{RAY_PORT}', log_to_driver=False); "
                 "print(sum(n['Alive'] for n in ray.nodes())); ray.shutdown()")
        deadline = time.monotonic() + 60
        while True:
            alive = self.exec(0, sys.executable, "-c", probe, timeout=60, check=False).stdout.strip().splitlines()
            if alive and alive[-1] == str(HOSTS):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray cluster did not reach {HOSTS} alive nodes: {alive}")
            time.sleep(1)

    def _pids(self, ns: str) -> list[int]:
        out = _sh("ip", "netns", "pids", ns, check=False).stdout
        return [int(p) for p in out.split()]

    def down(self) -> None:
        """End every process in the namespaces (by pid), delete namespaces and bridge; never raises."""
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            for ns in self.made_hosts:
                for pid in self._pids(ns):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(self._pids(ns) for ns in self.made_hosts):
                time.sleep(0.2)
        for i, ns in enumerate(self.made_hosts):
            _sh("ip", "netns", "del", ns, check=False)
            _sh("ip", "link", "del", f"{self.tag}v{i}", check=False)  # the root end, if still there
        if self.made_bridge:
            _sh("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _can_make_namespaces(tag: str) -> str | None:
    """None when a network namespace can be made here, else why not."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if not shutil.which("ip"):
        return "the `ip` command (iproute2) is missing: apt-get install -y iproute2"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"{tag}probe"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"cannot create a network namespace: {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _prometheus(cluster: NetnsCluster, run_dir: Path, tmp: Path) -> subprocess.Popen | None:
    """A Prometheus in the head namespace on 127.0.0.1:9090 with a 1 s scrape interval (None: not installed)."""
    binary = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
    if binary is None:
        return None
    config = load_config().replace(metrics={"port": METRICS_PORT, "host": "node"}, job={"name": "fxdist-cluster"},
                                   cluster={"placement": "spread"})
    prom_yml = write_prometheus_files(config, run_dir)  # the files `fxdist launch` writes, before it runs
    fast = tmp / "prometheus.yml"
    fast.write_text(re.sub(r"(scrape|evaluation|refresh)_interval: \d+s", r"\1_interval: 1s", prom_yml.read_text()))
    return subprocess.Popen(
        ["ip", "netns", "exec", cluster.hosts[0], binary, f"--config.file={fast}",
         f"--storage.tsdb.path={tmp / 'tsdb'}", "--web.listen-address=127.0.0.1:9090"],
        stdout=subprocess.DEVNULL, stderr=(tmp / "prometheus.log").open("w"),
    )


def _query(cluster: NetnsCluster, expr: str) -> list[dict]:
    """Run a PromQL instant query against the head namespace's Prometheus."""
    code = ("import json, sys, urllib.parse, urllib.request; "
            "u = 'http://127.0.0.1:9090/api/v1/query?' + urllib.parse.urlencode({'query': sys.argv[1]}); "
            "print(urllib.request.urlopen(u, timeout=10).read().decode())")
    body = json.loads(cluster.exec(0, sys.executable, "-c", code, expr, timeout=30).stdout)
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture(scope="module")
def cluster_job(tmp_path_factory):
    """Build the 3-host cluster, run the job from the head with a Prometheus scraping it, tear down."""
    tag = "fx" + uuid.uuid4().hex[:4]
    reason = _can_make_namespaces(tag)
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("cluster")
    cluster = NetnsCluster(tag, Path("/tmp") / tag)  # short: Ray's socket paths live under the temp dir
    prom = None
    try:
        cluster.network()
        cluster.ray()
        run_dir = tmp / "run"
        prom = _prometheus(cluster, run_dir, tmp)
        args = ["-c", "import sys; from jobs.cli import main; sys.exit(main(sys.argv[1:]))", "launch",
                "--run-dir", str(run_dir)] + [a for o in JOB for a in ("--set", o)]
        env = {**cluster.env, "RAY_ADDRESS": f"{_address(0)}:{RAY_PORT}"}
        proc = subprocess.run(["ip", "netns", "exec", cluster.hosts[0], sys.executable, *args], env=env,
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        time.sleep(2)  # a last scrape
        results = json.loads((run_dir / "results.json").read_text()) if (run_dir / "results.json").exists() else None
        up = _query(cluster, "max_over_time(up[10m])") if prom is not None and prom.poll() is None else None
        yield {"proc": proc, "results": results, "run_dir": run_dir, "up": up, "prometheus": prom is not None}
    finally:
        if prom is not None:
            prom.terminate()
            try:
                prom.wait(timeout=20)
            except subprocess.TimeoutExpired:
                prom.kill()
        cluster.down()


def test_spread_job_runs_across_hosts_and_reports_placement(cluster_job):
    proc, r = cluster_job["proc"], cluster_job["results"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert r["status"] == "completed"
    assert r["phases"]["baseline"]["qps"] > 0 and r["phases"]["optimized"]["fetch_p50_ms"] is not None
    placed = r["placement"]
    assert set(placed) == {"trainer0", "trainer1", "ps0"}
    # spread: one trainer per worker host; the server on the head, which has no CPU for a trainer
    assert {placed["trainer0"]["address"], placed["trainer1"]["address"]} == {_address(1), _address(2)}
    assert placed["ps0"]["address"] == _address(0)
    assert len({p["node_id"] for p in placed.values()}) == 3
    # every process bound gloo and TensorPipe to its host's interface: the trainers through Ray's
    # worker_process_setup_hook, the server before joining the RPC group
    for name, p in placed.items():
        assert p["ifnames"].get("TP_SOCKET_IFNAME") == IFNAME, (name, p)
    for name in ("trainer0", "trainer1"):
        assert placed[name]["ifnames"].get("GLOO_SOCKET_IFNAME") == IFNAME, placed[name]
    assert [j[0]["pid"] for j in r["server_joins"]] == [placed["ps0"]["pid"]]  # one group, joined once
    # [metrics] host = "node": each exporter bound on its own host's address, listed in targets.json
    for p in placed.values():
        assert p["metrics"][0] == p["address"]
    groups = json.loads((cluster_job["run_dir"] / "prometheus" / "targets.json").read_text())
    targets = {t: g["labels"]["node"] for g in groups for t in g["targets"]}
    assert targets == {f"{p['metrics'][0]}:{p['metrics'][1]}": p["address"] for p in placed.values()}


def test_table_says_where_each_process_ran(cluster_job):
    from jobs.report import table

    r = cluster_job["results"]
    assert r is not None, cluster_job["proc"].stderr[-4000:]
    line = next(x for x in table(r).splitlines() if x.startswith("placement"))
    assert line.startswith("placement (spread, 3 nodes): ")
    for name, p in r["placement"].items():
        assert f"{name} {p['address']} (node {p['node_id'][:8]})" in line
    assert line in cluster_job["proc"].stdout  # the launcher printed it


def test_prometheus_on_the_head_scraped_every_exporter(cluster_job):
    if not cluster_job["prometheus"]:
        pytest.skip("prometheus is not installed (apt-get install -y prometheus)")
    r = cluster_job["results"]
    assert r is not None and cluster_job["up"] is not None
    scraped = {s["metric"]["instance"] for s in cluster_job["up"] if float(s["value"][1]) == 1.0}
    expected = {f"{p['metrics'][0]}:{p['metrics'][1]}" for p in r["placement"].values()}
    assert scraped == expected
