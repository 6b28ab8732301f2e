"""End-to-end jobs on Ray: a short default job scraped by a real Prometheus, which loses a trainer and a
parameter server mid-run and recovers; and a job that fails for good, whose server actor the launcher
still kills.

Both jobs share one Ray session (module fixture, 2 CPUs, no dashboard). The Prometheus server is
Debian's ``prometheus`` package (installed with apt-get when missing), on 127.0.0.1 with a temporary
config and storage folder; every PromQL expression of ``dashboards/rules.yml`` and of the Grafana
dashboard must return data through the HTTP API for the time range of the job.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from jobs.config import load_config
from jobs.launcher.cli import main
from jobs.launcher.prometheus import DASHBOARDS, write_prometheus_files
from jobs.trainer.metrics import free_port, free_port_block

pytestmark = pytest.mark.timeout(420)

SHORT = [
    "job.steps=40", "job.batch_size=64", "job.checkpoint_every=10", "job.progress=false", "job.eval_epochs=0.4",
    "model.table_size=2000", "model.bottom_mlp=[32]", "model.top_mlp=[32]",
    "cluster.cpus_per_trainer=0.5", "cluster.rpc_timeout_s=20.0",
    "quant.calibration_batches=2", "quant.eval_batch_size=128",
    "data.synthetic_rows=10000",  # without ../shared: data the size of the Criteo sample, so the same steps evaluate
]


def _prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary:
        return binary
    if not shutil.which("apt-get"):
        pytest.skip("prometheus is not installed and apt-get is unavailable to install it")
    proc = subprocess.run(["apt-get", "install", "-y", "prometheus"], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        subprocess.run(["apt-get", "update"], capture_output=True, timeout=300)
        proc = subprocess.run(["apt-get", "install", "-y", "prometheus"], capture_output=True, text=True,
                              timeout=600)
    binary = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
    if not binary:
        pytest.fail(f"apt-get install -y prometheus failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return binary


def _api(port: int, path: str, **params) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2)
            return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"prometheus not ready on 127.0.0.1:{port} after {timeout} s")


class _Listeners:
    """While a job runs, every 0.5 s, the listening TCP sockets (``psutil.net_connections(kind="inet")``) of the job's
    processes: those of this test's process tree (the Ray session it started) whose title names a trainer or a
    server actor (``ray::RayTrainWorker...``, ``ray::PSActor...``), not Ray's own daemons and agents. ``seen``:
    ``{(pid, address, port)}``."""

    JOB_TITLES = ("RayTrainWorker", "PSActor")

    def __init__(self) -> None:
        import psutil

        self.psutil, self.seen, self.job_pids = psutil, set(), set()
        self._all: set[tuple[int, str, int]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Listeners:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.seen = {entry for entry in self._all if entry[0] in self.job_pids}

    def _run(self) -> None:
        me = self.psutil.Process()
        while not self._stop.wait(0.5):
            for child in me.children(recursive=True):
                try:
                    if any(t in " ".join(child.cmdline()) for t in self.JOB_TITLES):
                        self.job_pids.add(child.pid)
                except self.psutil.Error:
                    continue
            self._all |= {(c.pid, c.laddr.ip, c.laddr.port) for c in self.psutil.net_connections(kind="inet")
                          if c.status == self.psutil.CONN_LISTEN and c.pid is not None}


@pytest.fixture(scope="module")
def scraped_job(ray_session, tmp_path_factory):
    """Run the default job, shortened, through the CLI while Prometheus scrapes it.

    In the optimized phase a trainer is killed at step 15 and the parameter server at step 33; Ray Train
    restarts the worker group from the last checkpoint each time (checkpoints every 10 steps).
    """
    binary = _prometheus_binary()
    tmp = tmp_path_factory.mktemp("job")
    run_dir = tmp / "run"
    base = free_port_block(3)
    overrides = [*SHORT, f"metrics.port={base}", 'job.name="fxdist-test"', "job.max_failures=3",
                 "faults.kill_trainer_at_step=15", "faults.kill_server_at_step=33"]  # jobs.trainer.faults
    args = ["launch", "--run-dir", str(run_dir)] + [a for o in overrides for a in ("--set", o)]
    # the same files `fxdist launch` writes, rendered with a 1 s scrape/evaluation interval
    config = load_config().replace(metrics={"port": base}, job={"name": "fxdist-test"})
    prom_yml = write_prometheus_files(config, run_dir)
    fast = tmp / "prometheus.yml"
    fast.write_text(re.sub(r"(scrape|evaluation)_interval: \d+s", r"\1_interval: 1s", prom_yml.read_text()))
    web = free_port()
    proc = subprocess.Popen(
        [binary, f"--config.file={fast}", f"--storage.tsdb.path={tmp / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{web}"],
        stdout=subprocess.DEVNULL, stderr=(tmp / "prometheus.log").open("w"),
    )
    try:
        _wait_ready(web, proc)
        start = time.time()
        with _Listeners() as listening:
            rc = main(args)
        time.sleep(3)  # a last scrape and rule evaluation
        end = time.time()
        results = json.loads((run_dir / "results.json").read_text()) if rc == 0 else None
        yield {"rc": rc, "results": results, "run_dir": run_dir, "prom": web, "start": start, "end": end,
               "listening": listening.seen}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_short_default_job_end_to_end(scraped_job, capsys):
    assert scraped_job["rc"] == 0
    r = scraped_job["results"]
    base, opt = r["phases"]["baseline"], r["phases"]["optimized"]
    # both phases resume from the same checkpoint and train the same batches, interleaved
    assert base["resumed_from_step"] == opt["resumed_from_step"] > 0
    assert base["samples"] == opt["samples"] == 2 * (40 - opt["resumed_from_step"]) * 64
    assert base["qps"] > 0 and opt["qps"] > 0 and r["gain_percent"] == r["gain"]["median_percent"]
    blocks = len(base["block_seconds"][0])
    assert blocks == len(opt["block_seconds"][1]) == len(r["gain"]["block_gain_percent"]) >= 1
    assert r["gain"]["min_percent"] <= r["gain"]["median_percent"] <= r["gain"]["max_percent"]
    # two trainers, step-ordered servers: the optimized phase trains exactly the baseline's model, also
    # across the trainer and server restarts
    assert r["parity"]["ok"] and r["parity"]["identical_losses"], r["parity"]
    assert base["loss_series"] == opt["loss_series"] and base["quality"]["auc"] == opt["quality"]["auc"]
    assert base["lookup_p50_ms"] is not None  # a parameter server served the embeddings
    # torchrec's DLRM, its 26 tables moved by the parameter_servers pass in both phases
    assert [p["name"] for p in base["optimize"]["passes"]] == ["parameter_servers"]
    assert opt["optimize"]["placement"].startswith("parameter_servers plan: 26 tables on 1 server,")
    # held-out AUC / log loss of the model after 0.4 epochs (step 29 of 40 on the Criteo sample; the
    # optimized phase evaluates between the two faults, so its result comes back from a checkpoint)
    expected = min(40, math.ceil(0.4 * r["data"]["parse"]["rank0_rows"] / 64))
    for p in (base, opt):
        assert p["quality_step"] == expected and 0 < p["quality"]["auc"] <= 1 and p["quality_end"]["rows"] > 0
    if r["data"]["path"].endswith("criteo/train_examples.txt"):
        # clearly above chance: measured 0.70-0.71 (step 29) and 0.73 (step 40); an untrained model
        # scores 0.42-0.60 (seeds 0-2), the default job's over-fitted model (5.7 epochs) about 0.60
        for p in (base, opt):
            assert p["quality"]["auc"] > 0.66 and p["quality_end"]["auc"] > 0.66, (p["quality"], p["quality_end"])
    names = [p["name"] for p in opt["optimize"]["passes"]]
    assert names == ["parameter_servers", *load_config().phases.passes] == ["parameter_servers", "async_rpc_prefetch"]
    assert opt["optimize"]["passes"][1]["modified"] and opt["optimize"]["fallback"] is None
    # with async_rpc_prefetch each push carries the next batch's lookup; the baseline never prefetches
    assert base["prefetched_lookups"] == 0 and opt["prefetched_lookups"] > 0
    assert r["data"]["parse"]["valid"] > 0
    inf = r["inference"]
    # quant.select_int8 quantizes only the layers that pay on this CPU; with none, fp32 is kept (speed-up 1.0)
    assert (inf["quantized_modules"] == 0) == inf["kept_fp32"] and inf["int8"]["qps"] > 0
    assert inf["speedup"] >= 1.0 and inf["isa"] and "select_int8" in inf["method"]
    # torchrec DLRM's layers: dense arch 13-32-16, over arch 367-32-1
    assert [x["target"] for x in inf["layers"]] == ["dense_arch.model._mlp.0._linear", "dense_arch.model._mlp.1._linear",
                                                   "over_arch.model.0._mlp.0._linear", "over_arch.model.1"]
    assert abs(inf["int8"]["auc"] - inf["fp32"]["auc"]) < 0.05
    # the model quantized is the one the table's AUC refers to (restored from a checkpoint after the
    # server fault when the evaluation came before it)
    assert inf["model_step"] == opt["quality_step"]
    assert inf["fp32"]["auc"] == pytest.approx(opt["quality"]["auc"], abs=1e-4)
    assert (scraped_job["run_dir"] / "qps.png").stat().st_size > 10_000


def test_printed_table(scraped_job, capfd):
    from jobs.launcher.report import table

    text = table(scraped_job["results"])
    assert re.search(r"QPS gain, optimized vs baseline: [+-]\d+\.\d % \(median of \d+ paired blocks", text)
    assert "parity of the optimized phase (async_rpc_prefetch): OK: per-step losses bit-identical" in text
    assert "int8 speed-up" in text
    assert re.search(r"^baseline\s+\d+\.\d", text, re.M) and re.search(r"^optimized\s+\d+\.\d", text, re.M)
    assert "restarts from checkpoint: 2" in text
    assert re.search(r"^AUC, logloss: \d+ held-out rows, model after step \d+ of 40 ", text, re.M)
    assert "at the phase end (step 40," in text and "metrics updates in the training loop" in text


NOT_IN_THE_DEFAULT_JOB = ("inserts", "evictions", "staleness")
"""Metrics the default job has no data for: dynamic tables' counters, and the staleness of lookups with
``max_staleness`` (its async_rpc_prefetch phase waits every push)."""


def _dashboard_expressions(job: str) -> list[str]:
    import yaml

    rules = yaml.safe_load((DASHBOARDS / "rules.yml").read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    dashboard = json.loads((DASHBOARDS / "grafana-fxdist.json").read_text())
    exprs += [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]  # rows have none
    return [e.replace("$job", job) for e in exprs if not any(word in e for word in NOT_IN_THE_DEFAULT_JOB)]


def test_every_dashboard_and_rule_expression_returns_data(scraped_job):
    assert scraped_job["rc"] == 0
    port = scraped_job["prom"]
    targets = _api(port, "targets")["activeTargets"]
    assert len(targets) == 3 and {t["labels"]["role"] for t in targets} == {"trainer", "parameter_server"}
    empty = []
    for expr in _dashboard_expressions("fxdist-test"):
        data = _api(port, "query_range", query=expr, start=scraped_job["start"], end=scraped_job["end"], step="1s")
        values = [v for series in data["result"] for _, v in series["values"] if v not in ("NaN", "+Inf", "-Inf")]
        if not values:
            empty.append(expr)
    assert not empty, f"no data for: {empty}"


def test_trainer_and_server_killed_mid_run_recover_from_checkpoints(scraped_job):
    r = scraped_job["results"]
    assert sorted(r["faults_fired"]) == ["server", "trainer"]
    assert r["restarts"] == 2
    # each restart resumed from the newest checkpoint written before its fault: mid-phase (a restore of
    # dense weights and server tables), or the previous phase's final checkpoint (the phase restarts)
    starts = [step for phase, step in r["starts"] if phase == "optimized"]
    assert len(starts) == 3 and starts[0] == 0
    assert starts[1] in (0, 10) and starts[2] in (20, 30) and starts[1] <= starts[2]
    restores = [(x["phase"], x["step"]) for x in r["restores"]]
    assert restores == [(p, s) for s in starts[1:] if s > 0 for p in ("baseline", "optimized")]
    # ... with exactly the dense weights and server tables that checkpoint saved
    saved = {(c["phase"], c["step"]): c for c in r["checkpoints"]}
    for restore in r["restores"]:
        checkpoint = saved[(restore["phase"], restore["step"])]
        assert restore["model"] == checkpoint["model"]
        assert restore["tables"] == checkpoint["tables"]
    assert r["phases"]["optimized"]["resumed_from_step"] == r["phases"]["baseline"]["resumed_from_step"] == starts[2]


def test_launcher_owns_the_server_actors(scraped_job, ray_session):
    """The servers outlive trainer restarts: the same process rejoins after the trainer fault, Ray
    restarts the killed server's actor, and the launcher kills the actors when the job ends."""
    joins = scraped_job["results"]["server_joins"]
    assert len(joins) == 3 and all(len(j) == 1 for j in joins)
    (first,), (after_trainer,), (after_server,) = joins
    assert first["group"] == 1 and after_trainer == {"pid": first["pid"], "group": 2, "address": first["address"]}
    assert after_server["pid"] != first["pid"] and after_server["group"] == 1
    # over sockets (the default transport): the same socket after the trainer fault; after the server's, the new
    # process listens anew (the OS may give it the old port again, so the address may be the same) and serves: the
    # launcher's statistics at the end of the job came from it, and it holds the tables the trainers created on it
    # after the restart (a restarted server starts empty), so they reached it
    ps0 = scraped_job["results"]["processes"]["ps0"]
    assert ps0["pid"] == after_server["pid"] and ps0["rows"] > 0
    assert after_server["address"].rpartition(":")[2].isdigit()
    alive = [a["name"] for a in ray_session.util.list_named_actors(all_namespaces=True)]
    assert not [name for name in alive if name.startswith("fxdist-test-ps")], alive


def test_a_local_jobs_servers_listen_on_loopback_only(scraped_job):
    """A job on a local Ray session binds its own servers on 127.0.0.1 (jobs.cluster): the server actors' sockets
    (also the restarted one's) and every metrics exporter, as read from the kernel while the job ran; no process of
    the job listens on a non-loopback address of its own. (The wildcard listeners left are not the job's: each Ray
    worker's gRPC server and the torch.distributed store of Ray Train's gloo group.)"""
    r, listening = scraped_job["results"], scraped_job["listening"]
    joins = [j for group in r["server_joins"] for j in group]
    assert joins and all(j["address"].startswith("127.0.0.1:") for j in joins), joins
    sockets = {(j["pid"], int(j["address"].rpartition(":")[2])) for j in joins}
    exporters = {p["metrics"][1] for p in r["placement"].values() if p.get("metrics")}
    assert len(exporters) == 3  # 2 trainers, 1 server
    ours = {(pid, ip, port) for pid, ip, port in listening if (pid, port) in sockets or port in exporters}
    assert {(pid, port) for pid, _, port in ours} >= sockets, (sockets, sorted(listening))  # each seen listening
    assert {port for _, _, port in ours} >= exporters, (exporters, sorted(listening))
    assert {ip for _, ip, _ in ours} == {"127.0.0.1"}, sorted(ours)
    own_addresses = sorted((pid, ip, port) for pid, ip, port in listening if ip not in ("127.0.0.1", "::1", "::",
                                                                                         "0.0.0.0"))
    assert not own_addresses, own_addresses


def test_failed_job_still_kills_its_server_actors(ray_session, tmp_path, monkeypatch):
    """A trainer dies with no restarts left: launch() raises, and the server actor it started is gone."""
    import jobs.trainer.servers
    from jobs.launcher.launch import launch

    started = []

    def recording(*args, **kwargs):
        started.extend(start_servers(*args, **kwargs))
        return started

    start_servers = jobs.trainer.servers.start_servers
    monkeypatch.setattr(jobs.trainer.servers, "start_servers", recording)
    config = load_config().replace(
        job={"steps": 4, "batch_size": 32, "checkpoint_every": 0, "max_failures": 0, "progress": False,
             "name": "fxdist-fail"},
        model={"table_size": 200, "bottom_mlp": [8], "top_mlp": [8]}, phases={"baseline": False},
        cluster={"cpus_per_trainer": 0.5, "rpc_timeout_s": 20.0, "servers_in_trainers": False},
        metrics={"enabled": False}, quant={"enabled": False}, faults={"kill_trainer_at_step": 2})
    with pytest.raises(Exception, match="(?i)fail|died|error"):
        launch(config, run_dir=tmp_path / "run", quiet=True)
    assert len(started) == 1
    deadline = time.monotonic() + 15
    while True:  # ray.kill lands asynchronously: a call right after launch() may still reach the actor
        try:
            ray_session.get(started[0].leave.remote(), timeout=30)
        except ray_session.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "the server actor still answers 15 s after launch() returned"
        time.sleep(0.5)
    deadline = time.monotonic() + 15  # the name is released once the GCS has processed the kill
    while True:
        alive = [a["name"] for a in ray_session.util.list_named_actors(all_namespaces=True)]
        if not [name for name in alive if name.startswith("fxdist-fail-ps")] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not [name for name in alive if name.startswith("fxdist-fail-ps")], alive


def test_rank0_waits_for_a_server_actor_ray_is_restarting(ray_session):
    """After a server's process (or node) died, the next worker group's rank 0 gets where the restarted
    actor runs before asking it to join (jobs.trainer.servers.wait_for_servers); an actor with no restarts left raises."""
    from jobs.trainer.servers import server_actor, wait_for_servers
    from scheduling.ps import server_actor_class

    actor = server_actor(server_actor_class(1), "ps0", job="fxdist-wait", metrics=None, fetch_delay_s=0.0,
                         timeout_s=5.0)
    (first,) = wait_for_servers([actor], 60)
    _kill_and_wait(ray_session, actor, first["pid"], restart=True)
    (again,) = wait_for_servers([actor], 60)
    assert again["pid"] != first["pid"] and again["node_id"] == first["node_id"]
    _kill_and_wait(ray_session, actor, again["pid"], restart=False)
    with pytest.raises(ray_session.exceptions.RayActorError):
        wait_for_servers([actor], 10)


def _kill_and_wait(ray, actor, pid: int, restart: bool) -> None:
    """ray.kill returns before the actor's process is gone: wait (up to 30 s) until it is."""
    ray.kill(actor, no_restart=not restart)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)


# ---- the faults' wait for Ray Train's checkpoint record (jobs.trainer.faults) ------------------------------------

def _snapshot(path: Path, step: int | None, text: str | None = None) -> Path:
    """A checkpoint manager snapshot as Ray Train 2.60 writes it (only the keys read), latest at ``step``."""
    latest = None if step is None else {"version": 0, "checkpoint_dir_name": "checkpoint_x",
                                        "metrics": {"step": step, "final": False}}
    path.write_text(text if text is not None else json.dumps({"ray_version": "2.60.0",
                                                              "latest_checkpoint_result": latest}))
    return path


def test_a_fault_waits_for_the_checkpoint_written_before_it(tmp_path):
    from jobs.trainer.faults import expected_checkpoint, registered_step

    assert [expected_checkpoint(s, 10) for s in (1, 10, 11, 13, 20, 33)] == [0, 0, 10, 10, 10, 30]
    assert expected_checkpoint(8, 5) == 5 and expected_checkpoint(6, 4) == 4 and expected_checkpoint(15, 0) == 0
    assert registered_step(_snapshot(tmp_path / "a.json", 10)) == 10
    assert registered_step(_snapshot(tmp_path / "b.json", None)) == 0          # nothing registered yet
    assert registered_step(tmp_path / "absent.json") is None
    assert registered_step(_snapshot(tmp_path / "c.json", 0, text='{"latest_checkp')) is None  # caught mid-write
    assert registered_step(_snapshot(tmp_path / "d.json", 0, text="[1]")) is None


def test_the_wait_ends_when_ray_train_registers_the_checkpoint(tmp_path):
    """The victim polls the snapshot until it names the checkpoint (or a later one); without a snapshot it waits
    REGISTER_WAIT_S (the controller's poll bound) and goes on; with an older one, up to the timeout."""
    import jobs.trainer.faults as faults

    clock = [0.0]
    now = lambda: clock[0]  # noqa: E731
    path = _snapshot(tmp_path / "s.json", 4)
    polls: list[float] = []

    def sleep(seconds: float) -> None:  # the controller registers step 10 after 0.5 s of polling
        polls.append(seconds)
        clock[0] += seconds
        if clock[0] >= 0.5:
            _snapshot(path, 10)

    assert faults.wait_registered(10, path, poll_s=0.1, sleep=sleep, clock=now) == pytest.approx(0.5)
    assert len(polls) == 5
    assert faults.wait_registered(10, path, sleep=sleep, clock=now) == 0.0 and len(polls) == 5  # there: no poll
    assert faults.wait_registered(0, None, sleep=sleep, clock=now) == 0.0  # no checkpoint to wait for
    tick = lambda s: clock.__setitem__(0, clock[0] + s)  # noqa: E731
    clock[0] = 0.0
    assert faults.wait_registered(10, None, poll_s=0.5, sleep=tick, clock=now) == faults.REGISTER_WAIT_S
    clock[0] = 0.0
    assert faults.wait_registered(20, path, timeout_s=2.0, poll_s=0.5, sleep=tick, clock=now) == 2.0
