"""``fxdist launch`` refuses what cannot succeed before Ray starts, and never leaves or loses a run folder.

Every test here goes through the CLI (``jobs.launcher.cli.main``) and checks the exit status, the message, and
that nothing was started (``_join_ray`` fails the test if reached) or left behind (no run folder).
The Ray-backed tests (a deterministic error stops on the first attempt; an interrupted run is marked and
resumed) are at the end.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from jobs.config import ConfigError, JobConfig, to_dict
from jobs.launcher import checks, runs
from jobs.launcher.cli import main
from jobs.trainer.metrics import free_port_block
from recsys.criteo_format import NUM_DENSE, NUM_SPARSE

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_ray(monkeypatch):
    """Fail the test if the launcher gets as far as joining Ray."""
    import jobs.launcher.launch

    def refuse(*args, **kwargs):
        raise AssertionError("the launcher reached Ray although a cheap check should have failed")

    monkeypatch.setattr(jobs.launcher.launch, "_join_ray", refuse)


def _launch(tmp_path: Path, *sets: str, run_dir: Path | None = None) -> int:
    args = ["launch", "--quiet", "--set", f'job.run_dir="{tmp_path / "runs"}"']
    for s in sets:
        args += ["--set", s]
    if run_dir is not None:
        args += ["--run-dir", str(run_dir)]
    return main(args)


def _criteo_line(label: str = "1") -> str:
    return "\t".join([label, *["1"] * NUM_DENSE, *["68fd1e64"] * NUM_SPARSE]) + "\n"


@pytest.mark.parametrize(
    "sets, message",
    [
        (['phases.passes=["async_rpc", "asyncrpc"]'],
         "[phases] passes: unknown pass 'asyncrpc'; known passes: async_rpc, async_rpc_prefetch, dce"),
        (["job.max_failures=-1"], "[job] max_failures = -1: must be an integer in 0..1_000"),
        (["job.lr=nan"], "[job] lr = nan: must be a finite number in (0, 10]"),
        (["metrics.port=65535"], "[metrics] port = 65535: the exporters use ports 65535..65537"),
        (['job.name="../../etc/x"'], "[job] name = '../../etc/x': it names the run folder"),
        (["model.bottom_mlp=[]"], "[model] bottom_mlp = []: must be a list of 1 to 16 items"),
    ],
)
def test_bad_config_exits_2_before_anything_starts(tmp_path, capsys, no_ray, sets, message):
    assert _launch(tmp_path, *sets) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda p: p, "no such file"),
        (lambda p: p.mkdir(), "the directory holds no data file"),  # a directory of files is read (day_0 ..)
        (lambda p: p.write_bytes(b""), "the file is empty"),
        (lambda p: p.write_text("x\ty\n"), "none of the first 1 non-blank lines is a valid Criteo line"),
        (lambda p: p.write_bytes(b"\x28\xb5\x2f\xfdzstd"), "is zstd-compressed, which is not supported"),
    ],
)
def test_unusable_data_file_exits_2_before_ray_and_leaves_no_folder(tmp_path, capsys, no_ray, make, reason):
    data = tmp_path / "data.tsv"
    make(data)
    run_dir = tmp_path / "run"
    assert _launch(tmp_path, f'data.path="{data}"', run_dir=run_dir) == 2
    err = capsys.readouterr().err
    assert f"[data] path = '{data}': {reason}" in err
    assert not run_dir.exists() and not (tmp_path / "runs").exists()


def test_gzip_data_passes_the_checks(tmp_path):
    data = tmp_path / "data.txt"  # gzip content, no .gz suffix
    with gzip.open(data, "wt") as f:
        f.write(_criteo_line() * 10)
    config = JobConfig().replace(data={"path": str(data)}, metrics={"enabled": False})
    assert checks.check(config, local=False) == data


def test_taken_port_exits_2_and_leaves_no_folder(tmp_path, capsys, no_ray):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert _launch(tmp_path, f"metrics.port={port}", run_dir=tmp_path / "run") == 2
    assert f"127.0.0.1:{port} is in use" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("table_size, servers", [(10**8, 1), (10**9, 1), (10**8, 0)])
def test_tables_that_do_not_fit_in_memory_exit_2(tmp_path, capsys, no_ray, table_size, servers):
    assert _launch(tmp_path, f"model.table_size={table_size}", f"cluster.parameter_servers={servers}",
                   "metrics.enabled=false") == 2
    err = capsys.readouterr().err
    tables_gib = 26 * table_size * (16 + (1 if servers else 0)) * 4 / 2**30
    assert f"[model] table_size = {table_size}, embedding_dim = 16: the job needs about" in err
    assert "One copy of the 26 tables" in err and f"is {tables_gib:.2f} GiB" in err
    assert "GiB this machine has available" in err
    assert not (tmp_path / "runs").exists()


def test_memory_estimate_counts_tables_optimizer_state_and_copies():
    config = JobConfig().replace(model={"table_size": 1000, "embedding_dim": 8})
    est = checks.estimate_memory(config)  # 1 parameter server: weights + row-wise Adagrad state
    # two phases side by side: a table set each on the servers and in each checkpoint, plus two transients
    assert est.tables_bytes == 26 * 1000 * (8 + 1) * 4 and est.table_copies == 2 + 2
    assert est.server_bytes == 2 * est.tables_bytes  # fp32 storage: the servers hold one copy per phase
    one = checks.estimate_memory(config.replace(phases={"baseline": False}))
    assert one.table_copies == 1 + 2 and one.server_bytes == est.tables_bytes and one.dense_bytes * 2 == est.dense_bytes
    small = checks.estimate_memory(config.replace(model={"server_storage": "fused8bit"}))
    assert small.server_bytes == 2 * 26 * 1000 * ((8 + 8) + 4)  # D + 8 bytes a row, plus the fp32 Adagrad state
    assert small.total_bytes < est.total_bytes
    local = checks.estimate_memory(config.replace(cluster={"parameter_servers": 0, "trainers": 3}))
    assert local.tables_bytes == 26 * 1000 * 8 * 4 and local.table_copies == 2 * 3 * 2 + 1
    # dense parameters: 13-512-256-8 bottom, (8 + 351)-512-256-1 top
    bottom = 13 * 512 + 512 + 512 * 256 + 256 + 256 * 8 + 8
    top = 359 * 512 + 512 + 512 * 256 + 256 + 256 + 1
    assert checks.dense_parameters(config) == bottom + top
    fits = checks.check_memory(config, available=est.total_bytes)
    assert fits == est
    # 4 processes, and the int8 comparison's tables in the launcher: the checkpoint's pages and the rebuilt model
    assert est.fixed_bytes == 4 * checks.PROCESS_BASE_BYTES + 2 * 26 * 1000 * 8 * 4
    no_int8 = checks.estimate_memory(config.replace(quant={"enabled": False}))
    assert no_int8.processes["launcher"] == checks.PROCESS_BASE_BYTES
    assert est.total_bytes == sum(est.processes.values()) and sorted(est.processes) == ["launcher", "ps0", "trainer0", "trainer1"]
    with pytest.raises(ConfigError, match=r"needs about 2\.0 GiB, more than the 2\.0 GiB this machine has available"):
        checks.check_memory(config, available=est.total_bytes - 1)
    with open("/proc/meminfo") as f:  # psutil's figure and the kernel's estimate agree within a moving margin
        kernel = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert abs(checks.available_memory_bytes() - kernel) < 512 * 2**20


def _fake_run(run_dir: Path, status: str | None, *, checkpoint: bool = True, **extra) -> None:
    run_dir.mkdir(parents=True)
    results = {"job": "x", "config": to_dict(JobConfig()), "phases": {"baseline": {"qps": 1.0}}, **extra}
    if status is not None:
        results["status"] = status
    (run_dir / "results.json").write_text(json.dumps(results))
    if checkpoint:
        (run_dir / "ray" / "train").mkdir(parents=True)


@pytest.mark.parametrize("status", ["completed", None, "interrupted", "failed"])
def test_a_run_is_never_overwritten(tmp_path, capsys, no_ray, status):
    run_dir = tmp_path / "run"
    _fake_run(run_dir, status)
    before = (run_dir / "results.json").read_bytes()
    assert _launch(tmp_path, run_dir=run_dir) == 2
    err = capsys.readouterr().err
    assert f"already holds a run (status: {status or 'completed'})" in err
    assert f"fxdist launch --resume {run_dir}" in err
    assert (run_dir / "results.json").read_bytes() == before


def test_run_dir_with_only_other_files_is_used(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "prometheus").mkdir(parents=True)  # e.g. a Prometheus config written beforehand
    assert runs.choose(JobConfig(), run_dir) == run_dir.resolve()
    first = runs.choose(JobConfig().replace(job={"run_dir": str(tmp_path)}), None)
    first.mkdir()
    second = runs.choose(JobConfig().replace(job={"run_dir": str(tmp_path)}), None)
    assert second != first and second.parent == first.parent  # same second: a suffix, never the same folder


@pytest.mark.parametrize(
    "setup, args, message",
    [
        (lambda d: _fake_run(d, "completed"), [], "the run completed; there is nothing to resume"),
        (lambda d: _fake_run(d, None), [], "the run completed; there is nothing to resume"),
        (lambda d: d.mkdir(), [], "no run there"),
        (lambda d: _fake_run(d, "running", launcher={"pid": os.getppid(), "host": socket.gethostname()}), [],
         "the run is still running"),
        (lambda d: _fake_run(d, "interrupted"), ["--set", "model.table_size=100"],
         "[model] table_size cannot change when resuming (the run used 20000, --set gives 100)"),
        (lambda d: _fake_run(d, "interrupted"), ["jobs/default.toml"], "--resume uses the config the run was"),
    ],
)
def test_resume_refusals(tmp_path, capsys, no_ray, setup, args, message):
    run_dir = tmp_path / "run"
    setup(run_dir)
    assert main(["launch", "--quiet", "--resume", str(run_dir), *args]) == 2
    assert message in capsys.readouterr().err


def test_resume_uses_the_saved_config_with_allowed_overrides(tmp_path):
    run_dir = tmp_path / "run"
    _fake_run(run_dir, "failed")
    saved = runs.load_config(run_dir)
    assert saved.job.steps == JobConfig().job.steps and saved.source.endswith("results.json")
    changed = saved.replace(metrics={"port": 9700}, job={"max_failures": 5})
    runs.check_resume_changes(saved, changed)  # allowed: no exception


# ---- with Ray ------------------------------------------------------------------------------------------

SMALL = ["job.steps=12", "job.batch_size=32", "job.checkpoint_every=4", "job.progress=false", "job.eval_epochs=0",
         "model.table_size=500", "model.bottom_mlp=[16]", "model.top_mlp=[16]", "cluster.cpus_per_trainer=0.5",
         "cluster.rpc_timeout_s=20.0", "quant.calibration_batches=1", "quant.eval_batch_size=64"]


def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@pytest.mark.timeout(400)
def test_deterministic_data_error_stops_on_the_first_attempt(ray_session, tmp_path, capsys):
    """One valid line and two trainers: rank 1's shard is empty. The trainer's DataError is recorded and
    not retried although max_failures = 2; exit 2 with the worker's message; results.json says failed."""
    data = tmp_path / "one.tsv"
    data.write_text(_criteo_line() + "bad line\n")
    run_dir = tmp_path / "run"
    rc = main(["launch", "--quiet", "--run-dir", str(run_dir), *_sets(SMALL),
               *_sets([f'data.path="{data}"', "data.eval_fraction=0.0", "metrics.enabled=false",
                       "job.max_failures=2", "cluster.parameter_servers=0", "quant.enabled=false"])])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "trainer rank 1: DataError: CriteoShard:" in err and "has no valid train line for rank 1 of 2" in err
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "failed" and "has no valid train line" in results["error"]
    assert results["phases"] == {}
    # the loop ran at most once: a retried attempt returns before loading data (no second "loop started";
    # rank 0 may not even log its start before rank 1's error ends the first attempt on a loaded machine)
    started = [what for _, what in results["timeline"] if what == "rank 0: training loop started"]
    assert len(started) <= 1, results["timeline"]
    errors = [what for _, what in results["timeline"] if "DataError" in what]
    assert len(errors) == 1 and errors[0].startswith("rank 1: DataError"), results["timeline"]


AT_A_TERMINAL = ("import os, signal, sys; signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
                 "signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
"""``python -c AT_A_TERMINAL ARGS...`` runs ``python ARGS...`` in the same process with SIGINT unblocked and at its
default action, as under a shell at a terminal, whatever this test process inherited or was left with by the tests
before it (a blocked or ignored SIGINT passes to a child, and Python then installs no KeyboardInterrupt handler)."""


def _sigint_state() -> str:
    """This process's SIGINT state from /proc (blocked, ignored), for a failure's message."""
    bit = 1 << (signal.SIGINT - 1)
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return ", ".join(f"{k} {'has' if int(fields[k], 16) & bit else 'lacks'} SIGINT" for k in ("SigBlk", "SigIgn"))
    except (OSError, KeyError, ValueError):
        return "unknown"


def _wait_for(predicate, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the job ended early with {proc.returncode}:\n{proc.stderr.read()}")
        time.sleep(0.5)
    raise AssertionError("timed out waiting for the job")


def test_job_state_keeps_the_fuller_phase_result():
    """A restart between a phase's end and its final checkpoint re-runs the phase's last steps: the
    result that covers the whole phase is kept; seeds from a resumed run carry over, errors do not."""
    from jobs.launcher.launch import JobState
    from jobs.results import JobResults, PhaseResult

    def phase(steps: int, start: int) -> PhaseResult:
        return PhaseResult(qps=1.0, step_p50_ms=1.0, step_p99_ms=1.0, lookup_p50_ms=None, lookup_p99_ms=None, loss=0.5,
                           steps=steps, resumed_from_step=start)

    state = JobState(JobResults(job="x", config={}, phases={"baseline": phase(10, 0)}, status="interrupted",
                                faults_fired=["trainer"], starts=[["baseline", 0]], error="old"))
    state.phase_done("baseline", phase(2, 8))
    assert state.results["baseline"].steps == 10 and "done again (from step 8)" in state.events[-1][1]
    state.phase_done("optimized", phase(10, 0))
    assert not state.fire("trainer") and state.fire("server") and state.failure() is None
    state.fail("data", "DataError", "empty shard", 1)
    state.fail("job", "TraceError", "later", 0)
    assert state.snapshot()["error"] == {"kind": "data", "type": "DataError", "message": "empty shard", "rank": 1}
    for waiting in ("d/ has no more line", None, "d/ has no more line"):  # [data] follow: two waits of rank 1
        state.wait_for_data(1, waiting)
    assert state.snapshot()["waiting"] == {1: "d/ has no more line"}
    assert [e for _, e in state.events if "waiting" in e] == ["rank 1: waiting for data: d/ has no more line"]
    state.wait_for_data(1, None)
    assert state.snapshot()["waiting"] == {}


PAUSE_AT = 9
"""Optimized step at which trainer rank 0 pauses in test_interrupted_run_is_marked_and_resumed: after the checkpoint
of step 8 (SMALL checkpoints every 4 steps), when both phases have reported progress (every 5 steps): the blocks
end at 4, 8, 10, 12 and alternate, so steps 9-10 are the baseline's first and it is at step 10."""


@pytest.mark.timeout(500)
def test_interrupted_run_is_marked_and_resumed(ray_session, tmp_path, capsys):
    """SIGINT after a mid-run checkpoint: exit 130 and results.json "interrupted" with both phases' progress;
    --resume continues both (interleaved) phases from that checkpoint; the finished run is then refused.

    The window for the SIGINT is a pause of trainer rank 0 at optimized step 9 (``[faults] pause_at_step``, 45 s),
    after the checkpoint of step 8, rather than many steps: the job stays 12 steps long whatever the load."""
    pytest.importorskip("ray")
    run_dir = tmp_path / "run"
    base = free_port_block(3)
    args = [sys.executable, "-c", AT_A_TERMINAL, "-m", "jobs.launcher.cli", "launch", "--run-dir", str(run_dir), *_sets(SMALL),
            *_sets([f"metrics.port={base}", "quant.enabled=false", "cluster.rpc_timeout_s=60.0",
                    f"faults.pause_at_step={PAUSE_AT}", "faults.pause_seconds=45"])]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    results_path = run_dir / "results.json"

    def checkpointed_mid_run() -> bool:
        """Ray Train has registered a mid-run checkpoint (its checkpoint manager snapshot)."""
        try:
            snapshot = json.loads((run_dir / "ray" / "train" / "checkpoint_manager_snapshot.json").read_text())
        except (OSError, ValueError):
            return False
        metrics = (snapshot.get("latest_checkpoint_result") or {}).get("metrics", {})
        return metrics.get("step", 0) >= 4 and not metrics.get("final", True)

    def pausing() -> bool:
        """The timeline says rank 0's pause began (the JobState actor records the fault as fired)."""
        try:
            timeline = json.loads(results_path.read_text()).get("timeline", [])
        except (OSError, ValueError):
            return False
        return any(what.startswith("fault: pausing") for _, what in timeline)

    try:
        _wait_for(lambda: checkpointed_mid_run() and pausing(), proc, 300)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    status = json.loads(results_path.read_text()).get("status") if results_path.exists() else None
    assert rc == 130, f"exit {rc}, results.json status {status!r}; this test process: {_sigint_state()}\n{err}"
    assert "fxdist: interrupted" in err and f"fxdist launch --resume {run_dir}" in err
    interrupted = json.loads(results_path.read_text())
    assert interrupted["status"] == "interrupted" and interrupted["phases"] == {}
    assert set(interrupted["progress"]) == {"baseline", "optimized"}
    assert all(0 < step < 12 for step in interrupted["progress"].values()), interrupted["progress"]
    assert interrupted["faults_fired"] == ["pause"]  # the SIGINT came during the pause

    # metrics.port may change on resume (a fresh block: ports are shared with other jobs on this machine)
    assert main(["launch", "--quiet", "--resume", str(run_dir), "--set", f"metrics.port={free_port_block(3)}"]) == 0
    done = json.loads(results_path.read_text())
    assert done["status"] == "completed" and done["resumes"] == 1
    resumed = {p: done["phases"][p]["resumed_from_step"] for p in ("baseline", "optimized")}
    assert resumed["baseline"] == resumed["optimized"] >= 4
    for phase, step in resumed.items():
        assert done["phases"][phase]["steps"] == 12 - step
        assert (phase, step) in [(r["phase"], r["step"]) for r in done["restores"]]
    assert done["parity"]["ok"]

    capsys.readouterr()
    assert main(["launch", "--quiet", "--resume", str(run_dir)]) == 2
    assert "the run completed; there is nothing to resume" in capsys.readouterr().err
    before = results_path.read_bytes()
    assert main(["launch", "--quiet", "--run-dir", str(run_dir)]) == 2
    assert results_path.read_bytes() == before


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _FakeState:
    """The JobState actor's methods as ``.remote`` calls (``ray.get`` is patched to return its argument)."""

    def __init__(self, error=None):
        from jobs.launcher.launch import JobState

        self.actor = JobState()
        self.actor.error = error
        self.failure = _Remote(self.actor.failure)
        self.fail = _Remote(self.actor.fail)


@pytest.mark.parametrize("world", [1, 2])
def test_train_loop_records_deterministic_errors_and_never_repeats_them(monkeypatch, world):
    import ray
    import ray.train

    import jobs.trainer.loop
    from fxdist.errors import TraceError
    from recsys.criteo_format import DataError

    class Context:
        def get_world_rank(self):
            return world - 1

        def get_world_size(self):
            return world

    monkeypatch.setattr(ray, "get", lambda x, **kw: x)
    monkeypatch.setattr(ray.train, "get_context", lambda: Context())
    calls = []

    def failing(spec):
        calls.append(spec)
        raise spec.error

    def loop_config(state, error):  # train_loop reads only the spec's JobState actor (and config) itself
        return {"spec": SimpleNamespace(state=state, error=error, config=None)}

    monkeypatch.setattr(jobs.trainer.loop, "_train_loop", failing)
    state = _FakeState()
    error = DataError("x.tsv has no valid train line")
    if world == 1:  # one trainer: return normally, so fit() ends without a retry
        jobs.trainer.loop.train_loop(loop_config(state, error))
    else:  # more: re-raise, so Ray Train tears down the ranks waiting in a collective
        with pytest.raises(DataError):
            jobs.trainer.loop.train_loop(loop_config(state, error))
    assert state.actor.error == {"kind": "data", "type": "DataError", "message": str(error), "rank": world - 1}
    # the retried attempt returns at once, without running the loop
    jobs.trainer.loop.train_loop(loop_config(state, AssertionError("not reached")))
    assert len(calls) == 1
    # a trace error is recorded as a job error; a process-level failure is Ray Train's to retry
    state = _FakeState()
    with pytest.raises(ConnectionResetError, match="connection reset"):
        jobs.trainer.loop.train_loop(loop_config(state, ConnectionResetError("connection reset")))
    assert state.actor.error is None
    try:
        jobs.trainer.loop.train_loop(loop_config(state, TraceError("control flow")))
    except TraceError:
        assert world > 1
    assert state.actor.error["kind"] == "job"


@pytest.mark.parametrize(
    "error, code, message",
    [
        ({"kind": "config", "type": "ConfigError", "message": "bad key", "rank": 0}, 2, "trainer rank 0: ConfigError: bad key"),
        ({"kind": "data", "type": "DataError", "message": "empty shard", "rank": 1}, 2, "trainer rank 1: DataError: empty shard"),
        ({"kind": "job", "type": "TraceError", "message": "control flow", "rank": 0}, 1,
         "job failed: JobFailed: trainer rank 0: TraceError: control flow (stopped on the first attempt)"),
    ],
)
def test_recorded_errors_map_to_exit_codes(monkeypatch, capsys, error, code, message):
    import jobs.launcher.launch

    def launch(*args, **kwargs):
        raise jobs.launcher.launch._recorded_error(error)

    monkeypatch.setattr(jobs.launcher.launch, "launch", launch)
    assert main(["launch", "--quiet"]) == code
    assert message in capsys.readouterr().err


def test_interrupt_exit_code_and_notes(monkeypatch, capsys):
    import jobs.launcher.launch

    def launch(*args, **kwargs):
        e = KeyboardInterrupt()
        e.add_note("run folder: /x (interrupted); continue it with `fxdist launch --resume /x`")
        raise e

    monkeypatch.setattr(jobs.launcher.launch, "launch", launch)
    assert main(["launch", "--quiet"]) == 130
    err = capsys.readouterr().err
    assert "fxdist: interrupted" in err and "fxdist launch --resume /x" in err


@pytest.mark.parametrize("trainers, eval_fraction", [(2, 0.0), (3, 0.5), (5, 0.3), (2, 0.1)])
def test_synthetic_rows_check_matches_what_the_shards_need(tmp_path, trainers, eval_fraction):
    """The smallest synthetic_rows the check accepts is the smallest that gives every shard a line."""
    from recsys.criteo_format import DataError
    from recsys.criteo_shard import CriteoShard
    from recsys.criteo_synth import write_synthetic_criteo

    def shards_ok(rows: int) -> bool:
        path = write_synthetic_criteo(tmp_path / "s.tsv", rows)
        try:
            for r in range(trainers):
                CriteoShard(path, 100, rank=r, world_size=trainers, eval_fraction=eval_fraction)
            if eval_fraction > 0:
                CriteoShard(path, 100, eval_fraction=eval_fraction, split="eval")
        except DataError:
            return False
        return True

    def check_ok(rows: int) -> bool:
        config = JobConfig().replace(cluster={"trainers": trainers},
                                     data={"eval_fraction": eval_fraction, "synthetic_rows": rows})
        try:
            checks.check_synthetic_rows(config)
        except ConfigError as e:
            assert "[data] synthetic_rows" in str(e)
            return False
        return True

    first = next(rows for rows in range(1, 30) if check_ok(rows))
    assert shards_ok(first) and not shards_ok(first - 1) and not check_ok(first - 1)
