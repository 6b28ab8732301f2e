"""The training loop without Ray: phases are comparable, eager fallback is opt-in, the report renders."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import fxdist
from jobs.config import JobConfig
from jobs.launcher.report import table, to_json, write
from jobs.stats import phase_summary
from jobs.trainer.evaluation import eval_step
from jobs.trainer.metrics import Exporter
from jobs.trainer.pipeline import run_phase
from jobs.trainer.workload import CriteoWorkload, LocalTables, build_model
from recsys.criteo_shard import CriteoShard
from recsys.criteo_synth import write_synthetic_criteo
from tests._planted import Planted

CONFIG = JobConfig().replace(job={"steps": 12, "batch_size": 32}, model={"table_size": 300, "bottom_mlp": [16],
                                                                          "top_mlp": [16]}, phases={"passes": ["dce"]})


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    """The built-in DLRM's workload on a synthetic shard (the trainer gets a workload, never a bare shard)."""
    path = write_synthetic_criteo(tmp_path_factory.mktemp("data") / "c.tsv", 500, seed=3)
    return CriteoWorkload(CONFIG, CriteoShard(path, 300))


def test_baseline_and_optimized_phases_train_the_same_model_on_the_same_batches(workload):
    torch.set_num_threads(1)
    runs = {}
    for phase in ("baseline", "optimized"):
        model = build_model(CONFIG)
        run, info, _ = run_phase(phase, model, LocalTables(), workload, CONFIG)
        runs[phase] = (run, info, model)
    base, opt = runs["baseline"][0], runs["optimized"][0]
    assert base.steps == opt.steps == 12 and base.samples == opt.samples == 12 * 32
    # same initial weights, same batches, a semantics-preserving pass: the same loss curve
    assert base.losses == pytest.approx(opt.losses, rel=1e-5, abs=1e-6)
    assert base.losses[-1] < base.losses[0]
    assert runs["baseline"][1]["passes"] == [] and [p["name"] for p in runs["optimized"][1]["passes"]] == ["dce"]
    summary = phase_summary([base], 32)
    assert summary["samples"] == 384 and summary["qps"] > 0 and summary["step_p50_ms"] > 0
    assert summary["lookup_p50_ms"] is None  # local tables: no fetches


def test_resume_mid_phase_continues_the_batch_sequence(workload):
    torch.set_num_threads(1)
    full, _, _ = run_phase("baseline", build_model(CONFIG), LocalTables(), workload, CONFIG)
    model = build_model(CONFIG)
    first, _, opt = run_phase("baseline", model, LocalTables(), workload, CONFIG.replace(job={"steps": 5}))
    rest, _, _ = run_phase("baseline", model, LocalTables(), workload, CONFIG, start_step=5,
                           optim_state=opt.state_dict())
    assert rest.start_step == 5 and rest.steps == 7
    assert first.losses + rest.losses == pytest.approx(full.losses, rel=1e-5, abs=1e-6)


class _Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.dlrm = build_model(CONFIG)

    def forward(self, dense, sparse):
        if dense.sum() > 0:  # data-dependent control flow: symbolic tracing fails here
            return self.dlrm(dense, sparse)
        return -self.dlrm(dense, sparse)


def test_untraceable_model_fails_unless_eager_fallback_is_allowed(workload):
    def model():
        return _Untraceable()

    with pytest.raises(fxdist.TraceError) as info:
        run_phase("optimized", model(), LocalTables(), workload, CONFIG)
    assert any("allow_eager_fallback" in note for note in info.value.__notes__)
    allowed = CONFIG.replace(job={"allow_eager_fallback": True})
    run, info, _ = run_phase("optimized", model(), LocalTables(), workload, allowed)
    assert run.steps == 12 and info["fallback"].startswith("TraceError")


def test_report_table_json_and_plot(tmp_path):
    phase = {"qps": 1000.0, "step_p50_ms": 5.0, "step_p99_ms": 9.0, "lookup_p50_ms": None, "lookup_p99_ms": None,
             "loss": 0.45, "quality": {"auc": 0.7, "log_loss": float("nan")}, "qps_series": [(0.5, 900.0), (1.0, 1100.0)],
             "loss_series": [0.7, 0.5], "optimize": {"passes": [{"name": "async_rpc", "nodes_added": 2,
                                                                  "nodes_erased": 1}], "fallback": None}}
    results = {"job": "demo", "config": {"cluster": {"trainers": 2, "parameter_servers": 1},
                                         "job": {"steps": 2, "batch_size": 8}},
               "phases": {"baseline": phase, "optimized": {**phase, "qps": 1250.0}},
               "data": {"parse": {"valid": 10, "malformed": {"field_count": 2}}}}
    assert write(results, tmp_path).gain_percent == pytest.approx(25.0)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["phases"]["baseline"]["quality"]["log_loss"] is None  # NaN -> null (strict JSON)
    assert (tmp_path / "qps.png").read_bytes()[:4] == b"\x89PNG"
    text = table(results)
    assert "QPS gain, optimized vs baseline: +25.0 %" in text
    assert "passes run: async_rpc (2 graph nodes added, 1 removed)" in text
    assert "10 valid lines, 2 malformed skipped (field_count: 2)" in text
    assert "AUC, logloss" not in text  # no evaluation step recorded: no note
    for name in ("baseline", "optimized"):
        results["phases"][name].update(quality_step=1, quality_epochs=1.0, quality_end={"auc": 0.6, "log_loss": 0.5},
                                       epochs=2.0, metrics_percent=0.02)
    text = table(results)
    assert "AUC, logloss: None held-out rows, model after step 1 of 2 (1.00 epochs over each trainer's shard)" in text
    assert "at the phase end (step 2, 2.0 epochs): baseline AUC 0.6000 logloss 0.5000, optimized AUC 0.6000" in text
    assert "metrics updates in the training loop (largest trainer share of phase time): baseline 0.020 %" in text
    assert to_json({"a": (1.0, math.inf)}) == {"a": [1.0, None]}


def test_eval_step_is_one_pass_over_the_shard_capped_at_the_phase_end():
    config = JobConfig().replace(job={"steps": 200, "batch_size": 128})
    assert eval_step(config, 4500) == 36  # ceil(4500 / 128): the default job on the Criteo sample
    assert eval_step(config.replace(job={"eval_epochs": 0.5}), 4500) == 18
    assert eval_step(config.replace(job={"eval_epochs": 10.0}), 4500) == 200
    assert eval_step(config.replace(job={"eval_epochs": 0.0}), 4500) == 200
    assert eval_step(config.replace(job={"eval_epochs": 1e-6}), 4500) == 1
    assert eval_step(config, 0) == 200  # a stream ([data] follow) has no epochs: at the phase end


def test_metrics_updates_are_timed_in_the_training_loop(workload):
    run, _, _ = run_phase("baseline", build_model(CONFIG), LocalTables(), workload, CONFIG,
                          exporter=Exporter("t", 0))
    assert 0 < run.metrics_seconds < run.wall_seconds
    summary = phase_summary([run], CONFIG.job.batch_size)
    assert summary["metrics_percent"] == pytest.approx(100 * run.metrics_seconds / run.wall_seconds)
    plain, _, _ = run_phase("baseline", build_model(CONFIG), LocalTables(), workload, CONFIG)
    assert plain.metrics_seconds == 0.0


def test_interleaved_blocks_train_each_phase_as_one_uninterrupted_run(workload):
    from jobs.trainer.phases import block_ends
    from jobs.trainer.pipeline import TrainPipeline

    torch.set_num_threads(1)
    whole, _, _ = run_phase("optimized", build_model(CONFIG), LocalTables(), workload, CONFIG)
    trainers = {p: TrainPipeline(p, build_model(CONFIG), LocalTables(), workload, CONFIG) for p in ("baseline", "optimized")}
    ends = block_ends(0, 12, 5, 0)
    assert ends == [5, 10, 12]
    for b, end in enumerate(ends):
        for phase in (list(trainers) if b % 2 == 0 else list(trainers)[::-1]):
            trainers[phase].train(end)
    for t in trainers.values():
        assert t.step == 12 and t.run.steps == 12
        assert t.run.losses == pytest.approx(whole.losses, rel=1e-5, abs=1e-6)
        assert len(t.run.blocks) == 3 and t.run.wall_seconds == pytest.approx(sum(t.run.blocks))
        assert t.run.times == sorted(t.run.times) and t.run.times[-1] <= t.run.wall_seconds


def _checkpoint_on_rank(rank: int, store: str, out: str) -> None:
    """One of 2 gloo ranks saving a checkpoint; rank 0's report (Ray Train's upload) takes a second."""
    import time
    from pathlib import Path

    import ray.train
    import torch.distributed as dist

    from jobs.trainer import checkpoints

    def slow_report(metrics, checkpoint=None):
        if rank == 0:
            time.sleep(1.0)
            Path(out, "report_done").write_text(repr(time.time()))

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        ray.train.report = slow_report
        checkpoints.save_checkpoint(10, {}, {}, rank, final=False)
        Path(out, f"returned{rank}").write_text(repr(time.time()))
    finally:
        dist.destroy_process_group()


def test_no_rank_leaves_a_checkpoint_before_rank_0_has_saved_it(tmp_path):
    """Otherwise rank 1's next timed block waits for rank 0's save in DDP's all-reduce, and that phase's QPS
    takes the whole checkpoint (seconds with Criteo Kaggle-size tables)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_checkpoint_on_rank, args=(r, str(tmp_path / "store"), str(tmp_path)))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    done = float((tmp_path / "report_done").read_text())
    assert float((tmp_path / "returned1").read_text()) >= done


def _restored_from(folder: Path, monkeypatch) -> dict | None:
    """What the trainers' resume path (Ray Train's ``get_checkpoint()``, as ``fxdist launch --resume DIR`` restores
    it from ``DIR/ray``) reads from the checkpoint folder ``folder``."""
    import ray.train

    from jobs.trainer import checkpoints

    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: ray.train.Checkpoint.from_directory(str(folder)))
    return checkpoints.load_checkpoint()


def test_resume_loads_a_checkpoint_the_job_wrote(tmp_path, monkeypatch):
    """save_checkpoint's state.pt (dense weights, optimizer state, the evaluated model) loads weights-only."""
    import ray.train

    from jobs.trainer import checkpoints

    model = build_model(CONFIG)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    kept = tmp_path / "kept"

    def report(metrics, checkpoint=None):
        if checkpoint is not None:
            shutil.copytree(checkpoint.path, kept)

    monkeypatch.setattr(ray.train, "report", report)
    early = {"optimized": {"step": 4, "quality": {"auc": 0.5}, "model": model.state_dict(),
                           "optim": optimizer.state_dict()}}
    checkpoints.save_checkpoint(4, {}, early, 0, final=False)
    restored = _restored_from(kept, monkeypatch)
    assert restored["step"] == 4 and restored["eval"]["optimized"]["quality"] == {"auc": 0.5}
    assert checkpoints.digest(restored["eval"]["optimized"]["model"]) == checkpoints.digest(model.state_dict())


def test_resume_refuses_a_checkpoint_that_would_run_code(tmp_path, monkeypatch):
    """A state.pt holding a pickle that calls a function is not loaded: the error names the file and the function,
    the function never runs, and the trainers stop without a retry (a deterministic error)."""
    from jobs.trainer.loop import _deterministic_errors
    from scheduling.ps.safe_load import CheckpointRefused

    folder, marker = tmp_path / "checkpoint_000001", tmp_path / "marker"
    folder.mkdir()
    torch.save({"step": 4, "final": False, "models": {}, "tables": {}, "optim": {},
                "eval": {"baseline": {"hook": Planted(marker)}}}, folder / "state.pt")
    with pytest.raises(CheckpointRefused) as refused:
        _restored_from(folder, monkeypatch)
    assert refused.value.types == ["tests._planted.write_marker"]
    assert str(refused.value).startswith(f"{folder / 'state.pt'}: checkpoint not loaded: it holds tests._planted.write_marker")
    assert not marker.exists()
    assert _deterministic_errors()[CheckpointRefused] == "job"
