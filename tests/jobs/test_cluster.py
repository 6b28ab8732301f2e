"""``fxdist launch`` on a 3-host Ray cluster built on this machine with Linux network namespaces, and
the same job again losing a host mid-phase.

Each host is a network namespace ``<tag>h<i>`` with one veth interface (``fxeth0``, address 10.77.0.<i+1>/24)
plugged into a bridge in the root namespace that has no address: the hosts reach each other only through
the bridge, and their addresses exist nowhere else (no traffic leaves these namespaces). A host name that
resolves to loopback, the failure mode of a real cluster, is what every host here has. The head
(10.77.0.1, ``--num-cpus 0``) runs the Ray head and the launcher; the two others run Ray worker nodes with
two CPUs each (one trainer's, and room for the trainer of a host that dies). The job (2 trainers, 2
parameter servers, ``placement = "spread"``, ``[metrics] host = "node"``) must put one trainer on each
worker host, server 0 on the head and server 1 on a worker host, form its gloo (DDP) group across hosts, reach
the servers over authenticated socket connections in TLS (``[cluster] tls``), and tell where everything ran in
results.json, the table and Prometheus' file-SD ``targets.json``; a Prometheus in the head namespace scrapes every
exporter through that file.

Node failure: the same job runs again with a pause of trainer rank 0 in the optimized phase, after its
first checkpoint (``[faults] pause_at_step``: a window, so the kill lands mid-phase whatever the machine's
load). When the timeline says the pause began, the test kills the raylet of the worker host that runs
server 1 and a trainer; the host's Ray node dies (the GCS's health checks are tightened to notice in about
3 s). The job must restart the lost trainer and server on the remaining hosts from the checkpoint and
finish with no lost update: the dense weights and tables it restored equal the checkpoint's (digests), and
its end state and per-step losses equal the uninterrupted run's bit for bit.

Ray 2.60's token authentication: the head writes its token under the home directory, which the
namespaces share, and every process runs with ``RAY_AUTH_MODE=token`` so that it sends it.

Teardown always runs, also after the raylet kill: every process in the test's namespaces is ended by its
pid (``ray stop`` would stop every Ray on the machine, not just these hosts), then the namespaces and the
bridge are deleted. The test skips when namespaces cannot be created (not root, no ``ip``, no permission).
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
from jobs.launcher.prometheus import write_prometheus_files

# per test, with its fixtures (a loaded 2-core machine needs 3-4 min a job); its Ray cluster runs in the Ray lane
pytestmark = [pytest.mark.timeout(900), pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]
HOSTS = 3
IFNAME = "fxeth0"
RAY_PORT = 6390
METRICS_PORT = 19400
JOB = [
    "job.steps=20", "job.batch_size=64", "job.checkpoint_every=10", "job.progress=false", "job.eval_epochs=0",
    "model.table_size=2000", "model.bottom_mlp=[32]", "model.top_mlp=[32]", "data.synthetic_rows=4000",
    "cluster.trainers=2", "cluster.parameter_servers=2", "cluster.cpus_per_trainer=1.0", "cluster.rpc_timeout_s=60",
    'cluster.placement="spread"', 'metrics.host="node"', "metrics.expose=true", f"metrics.port={METRICS_PORT}",
    'phases.parity="warn"', "quant.enabled=false",
    "cluster.servers_in_trainers=false",  # server actors of their own, placed by "spread"
    "cluster.tls=true",  # the parameter-server traffic between hosts in TLS, with the job's own authority
    # 200 ms per lookup: the trainers train for seconds, not half of one (Prometheus applies new targets at most
    # every 5 s, and the trainers' exporters must be scraped while they live)
    "cluster.server_fetch_delay_ms=200",
]
PAUSE_AT, CHECKPOINT = 15, 10  # the node dies after the optimized phase's checkpoint of step 10
# the second run needs no 200 ms lookups (nothing scrapes it); the latency changes no number it trains
NODE_FAILURE = ["job.max_failures=2", f"faults.pause_at_step={PAUSE_AT}", "faults.pause_seconds=45",
                "cluster.server_fetch_delay_ms=1"]
GCS_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}


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

    def exec(self, host: int, *args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
        return _sh("ip", "netns", "exec", self.hosts[host], *args, env={**self.env, **(env or {})}, **kwargs)

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
        self._start(0, ray, "start", "--head", "--node-ip-address", _address(0), "--port", str(RAY_PORT),
                    "--num-cpus", "0", "--temp-dir", str(self.tmp / "r0"), *common, env=GCS_HEALTH)
        for i in range(1, HOSTS):
            self._start(i, ray, "start", "--address", f"{_address(0)}:{RAY_PORT}", "--node-ip-address",
                        _address(i), "--num-cpus", "2", "--temp-dir", str(self.tmp / f"r{i}"), "--disable-usage-stats")
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

    def _start(self, host: int, *args: str, env: dict[str, str] | None = None, attempts: int = 2) -> None:
        """``ray start`` on ``host``; on a busy machine it can give up waiting for its raylet after 30 s
        ("timed out during startup"): then end what it started there and try again."""
        for attempt in range(attempts):
            try:
                self.exec(host, *args, env=env, timeout=120)
                return
            except (RuntimeError, subprocess.TimeoutExpired):
                if attempt == attempts - 1:
                    raise
                self._end(self.hosts[host], signal.SIGKILL, 10.0)

    def _signal(self, ns: str, sig: int) -> None:
        for pid in self._pids(ns):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def _end(self, ns: str, sig: int, wait: float) -> None:
        self._signal(ns, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and self._pids(ns):
            time.sleep(0.2)

    def _pids(self, ns: str) -> list[int]:
        out = _sh("ip", "netns", "pids", ns, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_raylet(self, host: int) -> int:
        """SIGKILL the raylet of ``host`` (its Ray node dies; its worker processes exit on their own)."""
        for pid in self._pids(self.hosts[host]):
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == "raylet":
                    os.kill(pid, signal.SIGKILL)
                    return pid
            except (FileNotFoundError, ProcessLookupError):
                continue
        raise RuntimeError(f"no raylet runs in {self.hosts[host]}")

    def down(self) -> None:
        """End every process in the namespaces (by pid), delete namespaces and bridge; never raises."""
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):  # some Ray process outlives SIGTERM
            for ns in self.made_hosts:
                self._signal(ns, sig)
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
    config = load_config().replace(metrics={"port": METRICS_PORT, "host": "node", "expose": True}, job={"name": "fxdist-cluster"},
                                   cluster={"placement": "spread", "parameter_servers": 2})
    prom_yml = write_prometheus_files(config, run_dir)  # the files `fxdist launch` writes, before it runs
    fast = tmp / "prometheus.yml"
    fast.write_text(re.sub(r"(scrape|evaluation|refresh)_interval: \d+s", r"\1_interval: 1s", prom_yml.read_text()))
    return subprocess.Popen(
        ["ip", "netns", "exec", cluster.hosts[0], binary, f"--config.file={fast}",
         f"--storage.tsdb.path={tmp / 'tsdb'}", "--web.listen-address=127.0.0.1:9090"],
        stdout=subprocess.DEVNULL, stderr=(tmp / "prometheus.log").open("w"),
    )


def _ready(cluster: NetnsCluster, prom: subprocess.Popen, timeout_s: float = 90.0) -> None:
    """Wait until the head's Prometheus is ready (``/-/ready``): on 2 busy cores it takes seconds to start, and the
    job's trainers may train for less than that (it picks up their targets, written at launch, within 1 s)."""
    code = "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9090/-/ready', timeout=5)"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and prom.poll() is None:
        if cluster.exec(0, sys.executable, "-c", code, check=False, timeout=30).returncode == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"the head's Prometheus was not ready within {timeout_s:.0f} s (exit {prom.poll()})")


def _query(cluster: NetnsCluster, expr: str) -> list[dict]:
    """Run a PromQL instant query against the head namespace's Prometheus."""
    code = ("import json, sys, urllib.parse, urllib.request; "
            "u = 'http://127.0.0.1:9090/api/v1/query?' + urllib.parse.urlencode({'query': sys.argv[1]}); "
            "print(urllib.request.urlopen(u, timeout=10).read().decode())")
    body = json.loads(cluster.exec(0, sys.executable, "-c", code, expr, timeout=30).stdout)
    assert body["status"] == "success", body
    return body["data"]["result"]


def _launch(cluster: NetnsCluster, run_dir: Path, overrides: list[str], log: Path) -> subprocess.Popen:
    """``fxdist launch`` from the head namespace; stdout and stderr go to ``log``.{out,err}."""
    args = ["-c", "import sys; from jobs.launcher.cli import main; sys.exit(main(sys.argv[1:]))", "launch",
            "--run-dir", str(run_dir)] + [a for o in overrides for a in ("--set", o)]
    env = {**cluster.env, "RAY_ADDRESS": f"{_address(0)}:{RAY_PORT}"}
    return subprocess.Popen(["ip", "netns", "exec", cluster.hosts[0], sys.executable, *args], env=env, cwd=ROOT,
                            stdout=log.with_suffix(".out").open("w"), stderr=log.with_suffix(".err").open("w"))


def _finish(proc: subprocess.Popen, log: Path, timeout: float) -> dict:
    """Wait for the launcher (killed after ``timeout`` seconds); its exit status and output."""
    try:
        proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return {"returncode": proc.returncode, "stdout": log.with_suffix(".out").read_text(),
            "stderr": log.with_suffix(".err").read_text()}


def _results(run_dir: Path) -> dict | None:
    path = run_dir / "results.json"
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


@pytest.fixture(scope="module")
def netns_cluster(tmp_path_factory):
    """The 3-host cluster (network namespaces, bridge, Ray head and two worker nodes); torn down at the end."""
    tag = "fx" + uuid.uuid4().hex[:4]
    reason = _can_make_namespaces(tag)
    if reason:
        pytest.skip(reason)
    cluster = NetnsCluster(tag, Path("/tmp") / tag)  # short: Ray's socket paths live under the temp dir
    try:
        cluster.network()
        cluster.ray()
        yield cluster
    finally:
        cluster.down()


@pytest.fixture(scope="module")
def cluster_job(netns_cluster, tmp_path_factory):
    """Run the job from the head with a Prometheus scraping it."""
    cluster, tmp = netns_cluster, tmp_path_factory.mktemp("cluster")
    prom = None
    try:
        run_dir = tmp / "run"
        prom = _prometheus(cluster, run_dir, tmp)
        if prom is not None:
            _ready(cluster, prom)
        log = tmp / "launch"
        proc = _finish(_launch(cluster, run_dir, [*JOB, 'job.name="fxdist-cluster"'], log), log, 420)
        time.sleep(2)  # a last scrape
        results = _results(run_dir)
        up = _query(cluster, "max_over_time(up[10m])") if prom is not None and prom.poll() is None else None
        yield {"proc": proc, "results": results, "run_dir": run_dir, "up": up, "prometheus": prom is not None}
    finally:
        if prom is not None:
            prom.terminate()
            try:
                prom.wait(timeout=20)
            except subprocess.TimeoutExpired:
                prom.kill()


@pytest.fixture(scope="module")
def node_failure_job(netns_cluster, cluster_job, tmp_path_factory):
    """The same job again; once trainer rank 0 pauses after the optimized phase's checkpoint of step 10, kill
    the raylet of the worker host that runs server 1 (and a trainer). Runs after :func:`cluster_job`."""
    cluster, tmp = netns_cluster, tmp_path_factory.mktemp("nodefail")
    run_dir, log = tmp / "run", tmp / "launch"
    proc = _launch(cluster, run_dir, [*JOB, *NODE_FAILURE, 'job.name="fxdist-nodefail"'], log)
    deadline = time.monotonic() + 480
    before, victim, why = None, None, "the launcher ended before the pause"
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            r = _results(run_dir) or {}
            if any(what.startswith("fault: pausing") for _, what in r.get("timeline", [])):
                before = r["placement"]
                hosts = [i for i in range(1, HOSTS) if before.get("ps1", {}).get("address") == _address(i)]
                if not hosts:
                    why = f"server 1 is not on a worker host: {before}"
                    break
                victim = hosts[0]
                cluster.kill_raylet(victim)
                break
            time.sleep(0.3)
        else:
            why = "no pause in the timeline before the deadline"
    finally:
        proc_out = _finish(proc, log, deadline - time.monotonic())
    yield {"proc": proc_out, "results": _results(run_dir), "before": before, "victim": victim, "why": why}


def test_spread_job_runs_across_hosts_and_reports_placement(cluster_job):
    proc, r = cluster_job["proc"], cluster_job["results"]
    assert proc["returncode"] == 0, proc["stderr"][-4000:]
    assert r["status"] == "completed" and r["restarts"] == 0 and r["nodes_lost"] == []
    assert r["phases"]["baseline"]["qps"] > 0 and r["phases"]["optimized"]["lookup_p50_ms"] is not None
    placed = r["placement"]
    assert set(placed) == {"trainer0", "trainer1", "ps0", "ps1"}
    # spread: one trainer per worker host; the servers round-robin, first on the head, which has no CPU
    # for a trainer, then on a worker host
    assert {placed["trainer0"]["address"], placed["trainer1"]["address"]} == {_address(1), _address(2)}
    assert placed["ps0"]["address"] == _address(0) and placed["ps1"]["address"] in (_address(1), _address(2))
    assert len({p["node_id"] for p in placed.values()}) == 3
    # every process bound gloo and TensorPipe to its host's interface: the trainers through Ray's
    # worker_process_setup_hook, the server before joining the RPC group
    for name, p in placed.items():
        assert p["ifnames"].get("TP_SOCKET_IFNAME") == IFNAME, (name, p)
    for name in ("trainer0", "trainer1"):
        assert placed[name]["ifnames"].get("GLOO_SOCKET_IFNAME") == IFNAME, placed[name]
    assert [[x["pid"] for x in j] for j in r["server_joins"]] == [[placed["ps0"]["pid"], placed["ps1"]["pid"]]]
    # on a cluster each server listens on its own host's address (TLS inside: [cluster] tls), not on loopback
    assert r["config"]["cluster"]["tls"] is True
    assert [x["address"].rpartition(":")[0] for x in r["server_joins"][0]] == [placed["ps0"]["address"],
                                                                             placed["ps1"]["address"]]
    # [metrics] host = "node": each exporter bound on its own host's address, listed in targets.json
    for p in placed.values():
        assert p["metrics"][0] == p["address"]
    groups = json.loads((cluster_job["run_dir"] / "prometheus" / "targets.json").read_text())
    targets = {t: g["labels"]["node"] for g in groups for t in g["targets"]}
    assert targets == {f"{p['metrics'][0]}:{p['metrics'][1]}": p["address"] for p in placed.values()}


def test_table_says_where_each_process_ran(cluster_job):
    from jobs.launcher.report import table

    r = cluster_job["results"]
    assert r is not None, cluster_job["proc"]["stderr"][-4000:]
    line = next(x for x in table(r).splitlines() if x.startswith("placement"))
    assert line.startswith("placement (spread, 3 nodes): ")
    for name, p in r["placement"].items():
        assert f"{name} {p['address']} (node {p['node_id'][:8]})" in line
    assert line in cluster_job["proc"]["stdout"]  # the launcher printed it


def test_prometheus_on_the_head_scraped_every_exporter(cluster_job):
    if not cluster_job["prometheus"]:
        pytest.skip("prometheus is not installed (apt-get install -y prometheus)")
    r = cluster_job["results"]
    assert r is not None and cluster_job["up"] is not None
    scraped = {s["metric"]["instance"] for s in cluster_job["up"] if float(s["value"][1]) == 1.0}
    expected = {f"{p['metrics'][0]}:{p['metrics'][1]}" for p in r["placement"].values()}
    assert scraped == expected


def _ran_on(placement: dict, address: str) -> set[str]:
    return {name for name, p in placement.items() if p["address"] == address}


def test_a_host_dies_mid_phase_and_its_trainer_and_server_restart_on_the_others(node_failure_job):
    job = node_failure_job
    assert job["victim"] is not None, f"{job['why']}:\n{job['proc']['stderr'][-4000:]}"
    proc, r = job["proc"], job["results"]
    assert proc["returncode"] == 0, proc["stderr"][-4000:]
    assert r["status"] == "completed" and r["faults_fired"] == ["pause"]
    victim, survivor = _address(job["victim"]), _address(3 - job["victim"])
    lost = _ran_on(job["before"], victim)  # a trainer and server 1
    assert "ps1" in lost and len(lost) == 2 and len(lost & {"trainer0", "trainer1"}) == 1, job["before"]
    # the launcher saw the node die (ray.nodes(): Alive false); Ray Train restarted the worker group
    assert [(x["address"], set(x["ran"])) for x in r["nodes_lost"]] == [(victim, lost)]
    assert r["restarts"] >= 1
    # every process now runs on a remaining host: both trainers on the other worker, server 1 restarted
    # (a new process) on the head or that worker, server 0 still on the head
    placed = r["placement"]
    assert {n: p["address"] for n, p in placed.items() if n.startswith("trainer")} == {"trainer0": survivor,
                                                                                       "trainer1": survivor}
    assert placed["ps1"]["address"] in (_address(0), survivor) and placed["ps1"]["pid"] != job["before"]["ps1"]["pid"]
    assert placed["ps0"] == job["before"]["ps0"]
    assert all(victim not in str(g["targets"]) for g in json.loads(
        (Path(r["run_dir"]) / "prometheus" / "targets.json").read_text()))
    from jobs.launcher.report import table

    text = table(r)
    assert f"restarts from checkpoint: {r['restarts']}" in text
    assert f"node lost: {victim} (node {r['nodes_lost'][0]['node_id'][:8]}), which ran {', '.join(sorted(lost))}" in text
    assert text.splitlines()[-1] in proc["stdout"]


def test_no_update_is_lost_across_the_node_failure(node_failure_job, cluster_job):
    r, uninterrupted = node_failure_job["results"], cluster_job["results"]
    assert r is not None and uninterrupted is not None
    # the last restart resumed both phases from the optimized phase's checkpoint of step 10, which the
    # pause came after, and restored exactly the dense weights and tables that checkpoint saved
    starts = [step for phase, step in r["starts"] if phase == "optimized"]
    assert starts[0] == 0 and starts[-1] == CHECKPOINT, r["starts"]
    saved = {(c["phase"], c["step"]): c for c in r["checkpoints"]}
    assert [(x["phase"], x["step"]) for x in r["restores"]][-2:] == [("baseline", CHECKPOINT), ("optimized", CHECKPOINT)]
    for restore in r["restores"]:
        checkpoint = saved[(restore["phase"], restore["step"])]
        assert (restore["model"], restore["tables"]) == (checkpoint["model"], checkpoint["tables"])
    # ... and trained on to the same end as the uninterrupted run: the same per-step losses after the
    # checkpoint, and the same dense weights and tables at the end, bit for bit
    steps = r["config"]["job"]["steps"]
    final = {c["phase"]: c for c in uninterrupted["checkpoints"] if c["step"] == steps}
    for phase in ("baseline", "optimized"):
        assert r["phases"][phase]["resumed_from_step"] == CHECKPOINT
        assert r["phases"][phase]["loss_series"] == uninterrupted["phases"][phase]["loss_series"][CHECKPOINT:]
        assert (saved[(phase, steps)]["model"], saved[(phase, steps)]["tables"]) == (
            final[phase]["model"], final[phase]["tables"])
    assert r["parity"]["ok"] and r["parity"]["identical_losses"], r["parity"]
