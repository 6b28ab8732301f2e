"""``fxdist launch`` with your own model and batches (``[model] factory``, ``[data] batches``, ``[train] loss``).

The model and the batches below live only in this file, which the project's code never names: the job finds
them through the entry points ``tests.jobs.test_user_model:make_model`` / ``:batches`` (the Ray workers import
this module too: they inherit the test process's ``PYTHONPATH``). Two Ray jobs share one Ray session: this
model with 2 trainers and 1 parameter server (its torchrec EBC and nn.EmbeddingBag tables moved by the
``parameter_servers`` pass; a trainer killed mid-run; its Linear layers quantized afterwards), and the bundled MovieLens-100K example. The other
tests check bad entry points before Ray starts (exit status 2).
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from jobs.launcher.cli import main
from jobs.trainer.metrics import free_port_block

pytestmark = pytest.mark.timeout(420)

REPO = Path(__file__).resolve().parents[2]
HERE = "tests.jobs.test_user_model"


class TinyRecommender(nn.Module):
    """A click model of our own: dense features, a torchrec EmbeddingBagCollection over a jagged feature and an
    nn.EmbeddingBag over 3 tags per sample, plus a 20-row slot embedding at ``torch.arange(3)`` (under ``[model]
    local_below_rows``: it stays on the trainers). Shapes: ``dense (B, 4)``, ``features`` KJT with key "cat",
    ``tags (B, 3)`` -> logits ``(B,)``."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
            name="t_cat", embedding_dim=dim, num_embeddings=100, feature_names=["cat"])])
        self.tags = nn.EmbeddingBag(50, dim, mode="sum")
        self.slot = nn.Embedding(20, dim)
        self.dense = nn.Linear(4, dim)
        self.top = nn.Linear(3 * dim, 1)

    def forward(self, dense: torch.Tensor, features, tags: torch.Tensor) -> torch.Tensor:
        pooled = self.ebc(features).values()
        x = torch.cat([torch.relu(self.dense(dense)), pooled, self.tags(tags)], dim=1)
        return self.top(x + self.slot(torch.arange(3)).reshape(1, -1)).squeeze(1)


def make_model(config) -> nn.Module:
    return TinyRecommender(config.model.embedding_dim)


def batches(ctx) -> list[dict]:
    """Deterministic synthetic batches whose clicks depend on the features (learnable: AUC > 0.5)."""
    from torchrec import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(1000 * ctx.seed + (10_000 if ctx.split == "eval" else ctx.rank))
    effect = torch.Generator().manual_seed(7)
    cat_effect, tag_effect = torch.randn(100, generator=effect), torch.randn(50, generator=effect)
    out = []
    for _ in range(8 if ctx.split == "eval" else 12):
        b = ctx.batch_size
        lengths = torch.randint(1, 3, (b,), generator=gen)
        values = torch.randint(0, 100, (int(lengths.sum()),), generator=gen)
        tags = torch.randint(0, 50, (b, 3), generator=gen)
        dense = torch.randn(b, 4, generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        cat = torch.stack([cat_effect[values[offsets[i]:offsets[i + 1]]].sum() for i in range(b)])
        logit = cat + tag_effect[tags].sum(1) + dense[:, 0]
        labels = (torch.rand(b, generator=gen) < torch.sigmoid(logit)).float()
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["cat"], values=values, lengths=lengths)
        out.append({"dense": dense, "features": kjt, "tags": tags, "labels": labels})
    return out


def train_step(model, batch: dict) -> torch.Tensor:
    """Our own step: the forward and the loss as a training loop would write them (the job runs backward and the
    optimizer step)."""
    logits = model(batch["dense"], batch["features"], batch["tags"])
    return nn.functional.binary_cross_entropy_with_logits(logits, batch["labels"])


def l2_step(model, batch: dict) -> torch.Tensor:
    """``train_step`` plus an L2 penalty on the dense layers' weights."""
    penalty = sum((p * p).sum() for name, p in model.named_parameters() if name.endswith("weight"))
    return train_step(model, batch) + 0.1 * penalty


def vector_step(model, batch: dict) -> torch.Tensor:
    return model(batch["dense"], batch["features"], batch["tags"])


def no_labels(ctx) -> list[dict]:
    return [{"dense": torch.zeros(2, 4)}]


def not_a_module(config) -> str:
    return "a string"


USER_JOB = f"""
[job]
name = "user-model"
steps = 20
batch_size = 32
eval_epochs = 0
checkpoint_every = 10
max_failures = 2
progress = false
lr = 0.05

[model]
factory = "{HERE}:make_model"
embedding_dim = 8

[data]
batches = "{HERE}:batches"

[train]
train_step = "{HERE}:train_step"

[cluster]
trainers = 2
parameter_servers = 1
servers_in_trainers = false
cpus_per_trainer = 0.5
rpc_timeout_s = 20.0

[phases]
block_steps = 5

[faults]
kill_trainer_at_step = 13
"""


@pytest.fixture(scope="module")
def user_job(ray_session, tmp_path_factory):
    """The model above through ``fxdist launch CONFIG``, trained by our ``train_step``: 2 trainers, 1 server,
    trainer rank 1 killed at step 13 of the optimized phase (restart from the step-10 checkpoint)."""
    tmp = tmp_path_factory.mktemp("user")
    config = tmp / "user.toml"
    config.write_text(USER_JOB)
    run_dir = tmp / "run"
    out = tmp / "stdout.txt"
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        rc = main(["launch", str(config), "--run-dir", str(run_dir), "--set", f"metrics.port={free_port_block(3)}"])
    out.write_text(buffer.getvalue())
    results = json.loads((run_dir / "results.json").read_text())
    return {"rc": rc, "results": results, "stdout": buffer.getvalue()}


def test_user_model_trains_on_parameter_servers_with_parity(user_job):
    assert user_job["rc"] == 0, user_job["results"].get("error")
    r = user_job["results"]
    base, opt = r["phases"]["baseline"], r["phases"]["optimized"]
    # the baseline gets only the parameter_servers pass (blocking lookups), the optimized phase the passes too
    assert [p["name"] for p in base["optimize"]["passes"]] == ["parameter_servers"]
    assert [p["name"] for p in opt["optimize"]["passes"]] == ["parameter_servers", "async_rpc_prefetch"]
    # both tables are looked up on the server; prefetch (next_features, next_tags, added to train_step's call of
    # the model) answers lookups
    assert base["lookup_p50_ms"] is not None and base["prefetched_lookups"] == 0 and opt["prefetched_lookups"] > 0
    # step-ordered servers: the two phases train bit-identically, also across the restart
    assert r["parity"]["ok"] and r["parity"]["identical_losses"] and r["parity"]["metrics"] == ["auc"]
    assert base["loss_series"] == opt["loss_series"] and base["quality"]["auc"] == opt["quality"]["auc"]
    assert 0.5 < base["quality"]["auc"] <= 1 and base["quality"]["rows"] == 8 * 32
    assert r["gain"]["blocks"] >= 1 and r["gain_percent"] == r["gain"]["median_percent"]
    # fp32 vs int8: the model the table's AUC refers to, rebuilt in the launcher with the servers' tables; its two
    # nn.Linear layers measured by quant.select_int8 (int8 only where it pays; else fp32 kept, speed-up 1.0)
    inf = r["inference"]
    assert [x["target"] for x in inf["layers"]] == ["dense", "top"] and inf["isa"]
    assert (inf["quantized_modules"] == 0) == inf["kept_fp32"]
    # the speed-up is the measured int8 / fp32 QPS: exactly 1 with fp32 kept (int8 repeats fp32), else a real gain
    assert inf["speedup"] == inf["int8"]["qps"] / inf["fp32"]["qps"]
    assert inf["int8"] == inf["fp32"] if inf["kept_fp32"] else inf["speedup"] > 1.0
    assert inf["rows"] == 8 * 32 and "select_int8" in inf["method"]
    assert inf["fp32"]["auc"] == pytest.approx(opt["quality"]["auc"], abs=1e-4) and inf["model_step"] == 20
    assert abs(inf["int8"]["auc"] - inf["fp32"]["auc"]) < 0.05
    assert opt["optimize"]["placement"].startswith("parameter_servers plan: 2 tables on 1 server,")
    assert opt["optimize"]["placement"].endswith("\n  kept local: slot (20 rows < local_below_rows=32)")
    # per lookup: prefetched, and where the model looks it up
    lookups = opt["optimize"]["prefetch"]
    assert {k: (v["prefetched"], v["reason"], v["servers"]) for k, v in lookups.items()} == {
        "ebc": (True, None, [0]), "tags": (True, None, [0])}
    line = TinyRecommender.forward.__code__.co_firstlineno
    assert lookups["ebc"]["where"].endswith(f"test_user_model.py:{line + 1}")
    assert lookups["tags"]["where"].endswith(f"test_user_model.py:{line + 2}")
    assert "prefetch" not in base["optimize"]


def test_user_model_restarts_from_its_checkpoint(user_job):
    """The killed trainer's group restarts from the step-10 checkpoint: the tables the pass moved are written
    back to the (rejoined, empty) server exactly as saved."""
    r = user_job["results"]
    assert r["faults_fired"] == ["trainer"] and r["restarts"] == 1
    saved = {(c["phase"], c["step"]): c for c in r["checkpoints"]}
    assert [(x["phase"], x["step"]) for x in r["restores"]] == [("baseline", 10), ("optimized", 10)]
    for restore in r["restores"]:
        assert restore["tables"] == saved[(restore["phase"], 10)]["tables"]
        assert restore["model"] == saved[(restore["phase"], 10)]["model"]
    assert r["phases"]["optimized"]["resumed_from_step"] == 10


def test_user_model_leaves_a_model_folder_that_loads_into_a_fresh_model(user_job):
    """``RUN_DIR/model/``: the state dict under TinyRecommender's own names (its two server tables gathered) loads
    strictly into a model from ``make_model``; the exported program (KJT input) scores the held-out sample as the
    loaded model, bit for bit; model.json names the entry point and the int8 stage's outcome."""
    from jobs.config import parse_config
    from jobs.launcher.model_export import load_sample_input

    folder = Path(user_job["results"]["run_dir"]) / "model"
    record = json.loads((folder / "model.json").read_text())
    assert record["entry_point"]["factory"] == f"{HERE}:make_model" and record["step"] == 20
    assert record["metrics"]["held_out"]["auc"] == user_job["results"]["phases"]["optimized"]["quality"]["auc"]
    model = make_model(parse_config(user_job["results"]["config"])).eval()  # embedding_dim = 8
    state = torch.load(folder / "state_dict.pt", weights_only=True)
    model.load_state_dict(state, strict=True)
    assert set(state) == {"ebc.embedding_bags.t_cat.weight", "tags.weight", "slot.weight", "dense.weight",
                          "dense.bias", "top.weight", "top.bias"}
    assert record["exports"]["fp32"]["max_abs_diff"] == 0.0
    sample = load_sample_input(folder / "sample_input.pt")
    with torch.no_grad():
        assert torch.equal(torch.export.load(folder / "model.pt2").module()(*sample), model(*sample))
    int8 = record["exports"]["int8"]
    if user_job["results"]["inference"]["kept_fp32"]:
        assert int8["error"]["type"] == "no int8 model" and "model_int8.pt2" not in record["files"]
    else:  # FBGEMM's packed weights are TorchScript objects torch.export cannot trace (torch 2.13)
        assert ("file" in int8) == ("model_int8.pt2" in record["files"]), int8


def test_user_model_results_table(user_job):
    text = user_job["stdout"]
    assert re.search(r"^phase .* loss\s+AUC\s+logloss$", text, re.M)
    assert re.search(r"^baseline\s+\d+\.\d", text, re.M) and re.search(r"^optimized\s+\d+\.\d", text, re.M)
    assert re.search(r"QPS gain, optimized vs baseline: [+-]\d+\.\d %", text)
    assert "parity of the optimized phase (async_rpc_prefetch): OK: per-step losses bit-identical" in text
    assert re.search(r"^inference on 256 held-out rows .*select_int8", text, re.M)
    assert "int8 layer selection on this CPU" in text and "int8 speed-up" in text
    assert "parameter_servers plan: 2 tables on 1 server," in text  # the optimized phase's plan
    assert re.search(r"^  t_cat +ebc +100 x 8 +table_wise +ps0", text, re.M)
    assert re.search(r"^  tags +tags +50 x 8 +table_wise +ps0", text, re.M)
    assert re.search(r"^  kept local: slot \(20 rows < local_below_rows=32\)$", text, re.M)
    assert re.search(r"^prefetch \(async_rpc_prefetch\): 2 of 2 lookups prefetched; \d+ lookups answered by a "
                     r"prefetch\n  ebc   prefetched      \S*test_user_model.py:\d+\n  tags  prefetched      ", text, re.M)
    assert "passes run: parameter_servers (" in text and "async_rpc_prefetch (" in text


MOVIELENS = Path(__file__).resolve().parents[3] / "shared" / "data" / "movielens-100k" / "u.data"


@pytest.mark.skipif(not MOVIELENS.is_file(), reason=f"MovieLens-100K is not at {MOVIELENS} (../shared/data absent)")
def test_bundled_movielens_job(ray_session, tmp_path, capsys):
    rc = main(["launch", "jobs/movielens.toml", "--run-dir", str(tmp_path / "run"),
               *[a for s in ("job.steps=12", "job.checkpoint_every=0", "job.progress=false", "phases.block_steps=4",
                             "cluster.cpus_per_trainer=0.5", f"metrics.port={free_port_block(3)}")
                 for a in ("--set", s)]])
    text = capsys.readouterr().out
    assert rc == 0, text[-3000:]
    r = json.loads((tmp_path / "run" / "results.json").read_text())
    base, opt = r["phases"]["baseline"], r["phases"]["optimized"]
    assert r["config_source"].endswith("movielens.toml") and r["config"]["model"]["factory"] == "jobs.movielens:model"
    q = base["quality"]
    assert q["rows"] == 10_000 and 0.5 < q["rmse"] < 1.5 and 0 < q["rmse_se"] < 0.05
    assert r["parity"]["ok"] and r["parity"]["metrics"] == ["rmse"] and r["parity"]["identical_losses"]
    assert r["parity"]["rmse"]["tolerance"] == pytest.approx(2 * q["rmse_se"])
    assert opt["prefetched_lookups"] > 0
    assert re.search(r"^phase .* loss\s+RMSE\s+MAE$", text, re.M)
    assert "parity of the optimized phase (async_rpc_prefetch): OK" in text and "RMSE diff" in text
    assert "parameter_servers plan: 4 tables on 1 server," in text


# ---- bad entry points: found before Ray starts ------------------------------------------------------------

def _launch(tmp_path, capsys, *sets: str) -> tuple[int, str]:
    rc = main(["launch", "--quiet", "--run-dir", str(tmp_path / "run"), "--set", "metrics.enabled=false",
               *[a for s in sets for a in ("--set", s)]])
    assert not (tmp_path / "run").exists()  # nothing was created
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("sets, message", [
    ((f'model.factory="{HERE}:make_model"',), r"\[model\] factory is set but \[data\] batches is not"),
    (('model.factory="no_such_pkg.models:make"', f'data.batches="{HERE}:batches"'),
     r"\[model\] factory = 'no_such_pkg.models:make': cannot import 'no_such_pkg.models': ModuleNotFoundError: .*"
     r"\(Python finds 'no_such_pkg' only on sys.path: run fxdist from the folder that holds it with PYTHONPATH=\$PWD"),
    ((f'model.factory="{HERE}:missing"', f'data.batches="{HERE}:batches"'),
     r"\[model\] factory = '.*:missing': 'tests.jobs.test_user_model' has no attribute 'missing'"),
    (('model.factory="make_model"', f'data.batches="{HERE}:batches"'),
     r"\[model\] factory = 'make_model': expected 'package.module:function'"),
    ((f'model.factory="{HERE}:not_a_module"', f'data.batches="{HERE}:batches"'),
     r"\[model\] factory = '.*:not_a_module' returned a str, expected an nn.Module"),
    ((f'model.factory="{HERE}:make_model"', f'data.batches="{HERE}:no_labels"'),
     r"\[data\] batches = '.*:no_labels': first batch: a dict batch needs a 'labels' entry"),
    ((f'model.factory="{HERE}:make_model"', f'data.batches="{HERE}:batches"', 'train.loss="huber"'),
     r"\[train\] loss = 'huber': expected one of bce_with_logits, mse or 'package.module:function'"),
    (('train.loss="mse"',), r"\[train\] loss = 'mse': the built-in DLRM trains with \"bce_with_logits\""),
    ((f'train.train_step="{HERE}:train_step"',), r"\[train\] train_step = .* is set but \[model\] factory is not"),
    ((f'model.factory="{HERE}:make_model"', f'data.batches="{HERE}:batches"', f'train.train_step="{HERE}:make_model"'),
     r"\[train\] train_step = '.*:make_model': must take \(model, batch\)"),
])
def test_bad_entry_points_exit_2_naming_the_key(tmp_path, capsys, sets, message):
    rc, err = _launch(tmp_path, capsys, *sets)
    assert rc == 2 and re.search(message, err), err


def test_bundled_config_is_found_from_anywhere(tmp_path, monkeypatch):
    from jobs.config import load_config

    monkeypatch.chdir(tmp_path)  # not the repository root: the bundled file is used
    config = load_config("jobs/movielens.toml")
    assert Path(config.source).resolve() == REPO / "jobs" / "movielens.toml" and config.user_model
    with pytest.raises(FileNotFoundError):
        load_config("elsewhere/movielens.toml")


def test_user_model_with_local_tables_trains_the_same_in_both_phases():
    """No parameter servers: the tables stay in the model; both phases train it over the same batches (no Ray)."""
    from jobs.config import load_config
    from jobs.trainer.evaluation import evaluate
    from jobs.trainer.pipeline import run_phase
    from jobs.trainer.workload import LocalTables, UserWorkload

    config = load_config().replace(
        job={"steps": 6, "batch_size": 16}, model={"factory": f"{HERE}:make_model", "embedding_dim": 4},
        data={"batches": f"{HERE}:batches"}, cluster={"parameter_servers": 0}, phases={"passes": ["dce"]})
    workload = UserWorkload(config, 0, 1)
    assert workload.rows == 12 * 16 and workload.has_eval
    out = {}
    for phase in ("baseline", "optimized"):
        model = workload.build(LocalTables())
        with warnings.catch_warnings():  # dce may find nothing to remove (NoOpPassWarning)
            warnings.simplefilter("ignore")
            run, info, _ = run_phase(phase, model, LocalTables(), workload, config)
        out[phase] = run.losses, evaluate(model, workload, LocalTables())
    assert [r["name"] for r in info["passes"]] == ["dce"]
    assert out["baseline"][0] == out["optimized"][0] and len(out["baseline"][0]) == 6
    assert out["baseline"][1] == out["optimized"][1] and out["baseline"][1]["rows"] == 8 * 16


def _local_losses(config, phase: str = "optimized") -> list[float]:
    from jobs.trainer.pipeline import run_phase
    from jobs.trainer.workload import LocalTables, UserWorkload

    workload = UserWorkload(config, 0, 1)
    with warnings.catch_warnings():  # dce may find nothing to remove (NoOpPassWarning)
        warnings.simplefilter("ignore")
        run, _, _ = run_phase(phase, workload.build(LocalTables()), LocalTables(), workload, config)
    return run.losses


def test_train_step_trains_as_the_loss_it_computes():
    """``[train] train_step`` computing BCE trains exactly as ``[train] loss = "bce_with_logits"``; one adding an L2
    penalty trains otherwise; one returning a vector is a ConfigError naming the key (no Ray)."""
    from jobs.config import ConfigError, load_config

    config = load_config().replace(
        job={"steps": 5, "batch_size": 16}, model={"factory": f"{HERE}:make_model", "embedding_dim": 4},
        data={"batches": f"{HERE}:batches"}, cluster={"parameter_servers": 0}, phases={"passes": ["dce"]})
    plain = _local_losses(config)
    assert _local_losses(config.replace(train={"train_step": f"{HERE}:train_step"})) == plain
    regularized = _local_losses(config.replace(train={"train_step": f"{HERE}:l2_step"}))
    assert len(regularized) == 5 and all(r > p for r, p in zip(regularized, plain))
    with pytest.raises(ConfigError, match=r"\[train\] train_step = '.*:vector_step' returned Tensor\(16,\), expected "
                                          "a scalar loss tensor"):
        _local_losses(config.replace(train={"train_step": f"{HERE}:vector_step"}))
