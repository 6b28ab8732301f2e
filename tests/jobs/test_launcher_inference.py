"""jobs.launcher.inference: fp32 vs int8 of the trained model through quant.select_int8, for the built-in torchrec DLRM and
for a model of your own; fp32 is kept (speed-up 1.00x) whenever int8 does not pay, and the table says so."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

import fxdist
from jobs.config import JobConfig
from jobs.launcher.inference import compare, rebuild_model
from jobs.launcher.report import table
from jobs.trainer.workload import build_model
from quant import cpu_isa
from recsys.criteo_synth import write_synthetic_criteo

CONFIG = JobConfig().replace(model={"table_size": 300, "bottom_mlp": [32], "top_mlp": [32]},
                             quant={"calibration_batches": 2, "eval_batch_size": 64})
LAYERS = ["dense_arch.model._mlp.0._linear", "dense_arch.model._mlp.1._linear", "over_arch.model.0._mlp.0._linear",
          "over_arch.model.1"]
"""torchrec DLRM's Linear layers: dense arch 13->32->16 (Linear+ReLU each), over arch 367->32 (+ReLU), 32->1."""
HERE = "tests.jobs.test_launcher_inference"


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return write_synthetic_criteo(tmp_path_factory.mktemp("data") / "c.tsv", 400, seed=5)


def _trained_state(config: JobConfig) -> dict:
    """A checkpoint's ``{"model", "tables"}`` of the built-in model on servers: its tables apart, as the
    ``parameter_servers`` pass names them, with the servers' row-wise Adagrad state."""
    model = build_model(config)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    tables = {k: torch.randn_like(v) for k, v in state.items() if ".embedding_bags." in k}
    tables.update({k.replace(".weight", ".momentum"): torch.rand(v.shape[0]) for k, v in tables.items()})
    return {"model": {k: v for k, v in state.items() if k not in tables}, "tables": tables}


def test_rebuild_model_loads_the_dense_weights_and_the_servers_tables():
    state = _trained_state(CONFIG)
    model = rebuild_model(CONFIG, state)
    assert not model.training
    weights = model.state_dict()
    table = "sparse_arch.embedding_bag_collection.embedding_bags.t_C7.weight"
    assert torch.equal(weights[table], state["tables"][table]) and weights[table].shape == (300, 16)
    assert all(torch.equal(weights[k], v) for k, v in state["model"].items())
    with pytest.raises(RuntimeError, match="checkpoint tables not in DLRM's state dict: .*'t9.weight'"):
        rebuild_model(CONFIG, {"model": {}, "tables": {"t9.weight": torch.zeros(3, 16)}})


def test_compare_keeps_fp32_when_no_layer_is_faster_in_int8(data_path):
    calls = []

    def int8_slower(subject, variant, run):  # every int8 variant takes twice as long as fp32
        calls.append((subject, variant))
        return 2e-3 if variant.startswith("int8") else 1e-3

    threads = torch.get_num_threads()
    r = compare(CONFIG, _trained_state(CONFIG), data_path, timer=int8_slower)
    assert torch.get_num_threads() == threads  # compare runs on one thread and restores the setting
    assert r["kept_fp32"] is True and r["speedup"] == 1.0 and r["quantized_modules"] == 0
    assert r["isa"] == cpu_isa() and r["note"] == f"kept fp32: no layer is faster in int8 on this CPU ({cpu_isa()})"
    assert [x["target"] for x in r["layers"]] == LAYERS and r["fused_modules"] == 3
    assert not any(x["chosen"] for x in r["layers"])
    assert {s for s, _ in calls} >= {"dense_arch_model__mlp_0__linear", "over_arch_model_0__mlp_0__linear"}
    assert r["int8"] == r["fp32"] and r["fp32"]["qps"] > 0 and 0 <= r["fp32"]["auc"] <= 1
    assert r["rows"] == 40 and r["batch_size"] == 40 and r["all_int8_speedup"] == pytest.approx(0.5)
    results = {"job": "demo", "config": {"cluster": {"trainers": 1, "parameter_servers": 0},
                                         "job": {"steps": 2, "batch_size": 8}},
               "phases": {}, "inference": dataclasses.replace(r, model_step=2)}
    text = table(results)
    assert f"int8 speed-up: 1.00x (kept fp32: no layer is faster in int8 on this CPU ({cpu_isa()}))" in text
    assert "dense_arch.model._mlp.0._linear 1000.0 / 2000.0 -> fp32" in text and "select_int8" in text
    assert re.search(r"^fp32\s+\d", text, re.M) and not re.search(r"^int8\s+\d", text, re.M)  # no int8 row


def _int8_faster(subject, variant, run):
    return 1e-3 if variant.startswith("int8") else 2e-3


def test_compare_keeps_fp32_when_the_selection_is_slower_end_to_end(data_path, monkeypatch):
    import jobs.launcher.inference as inference

    def qps(models, inputs, rows, **kwargs):  # the whole model (with its lookups) measured slower in int8
        assert set(models) == {"fp32", "int8"} and isinstance(models["int8"], fxdist.GraphModule)
        return {"fp32": 1000.0, "int8": 900.0}

    monkeypatch.setattr(inference, "_best_qps", qps)
    r = compare(CONFIG, _trained_state(CONFIG), data_path, timer=_int8_faster)
    assert r["int8_measured"]["qps"] == 900.0 and 0 <= r["int8_measured"]["auc"] <= 1
    assert r["kept_fp32"] and r["speedup"] == 1.0 and r["int8"] == r["fp32"] and r["quantized_modules"] == 0
    assert r["note"] == "kept fp32: the selected int8 model ran at 0.90x fp32 end to end (embedding lookups included)"
    assert len(r["layers"]) == 4 and not any(x["chosen"] for x in r["layers"])
    assert "int8 for 4 of 4 layers: 2.00x the fp32 module" in r["selection"]


# ---- a model of your own: the same selection ------------------------------------------------------------------

class TwoTower(nn.Module):
    """Users and items as nn.EmbeddingBag tables of 2 ids each, a Linear tower on each, a dot product.
    Shapes: ``users (B, 2)``, ``items (B, 2)`` int64 -> logits ``(B,)``."""

    def __init__(self) -> None:
        super().__init__()
        self.users, self.items = nn.EmbeddingBag(40, 8), nn.EmbeddingBag(30, 8)
        self.user_tower = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8))
        self.item_tower = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8))

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return (self.user_tower(self.users(users)) * self.item_tower(self.items(items))).sum(1)


def two_tower() -> nn.Module:
    return TwoTower()


def pairs(ctx) -> list[dict]:
    gen = torch.Generator().manual_seed(ctx.seed + (1 if ctx.split == "eval" else 0))
    return [{"users": torch.randint(0, 40, (32, 2), generator=gen), "items": torch.randint(0, 30, (32, 2), generator=gen),
             "labels": (torch.rand(32, generator=gen) < 0.5).float()} for _ in range(3)]


def test_your_model_gets_select_int8_and_the_int8_row_when_it_pays(monkeypatch):
    import jobs.launcher.inference as inference

    config = JobConfig().replace(model={"factory": f"{HERE}:two_tower"}, data={"batches": f"{HERE}:pairs"},
                                 quant={"calibration_batches": 2})
    monkeypatch.setattr(inference, "_best_qps", lambda models, inputs, rows, **kw: {"fp32": 1000.0, "int8": 2000.0})
    model = TwoTower()
    state = {"model": {k: v for k, v in model.state_dict().items() if "tower" in k},
             "tables": {"users.weight": torch.randn(40, 8), "items.weight": torch.randn(30, 8)}}
    r = compare(config, state, timer=_int8_faster)
    assert [x["target"] for x in r["layers"]] == ["user_tower.0", "user_tower.2", "item_tower.0", "item_tower.2"]
    assert not r["kept_fp32"] and r["quantized_modules"] == 4 and r["speedup"] == 2.0
    assert r["rows"] == 96 and r["int8"]["qps"] == 2000.0 and abs(r["int8"]["auc"] - r["fp32"]["auc"]) < 0.1


def test_a_model_without_linear_layers_is_skipped():
    from jobs.launcher.inference import _compare

    out = _compare(CONFIG, nn.Sequential(nn.EmbeddingBag(5, 2)), [], [], None)
    assert out.to_json() == {"skipped": "Sequential has no nn.Linear or nn.Conv layer to quantize"}


def test_the_tables_are_not_copied_for_the_comparison(data_path):
    """The launcher holds the tables once: the rebuilt model takes the checkpoint's tensors, and the int8 model
    (quantization deep-copies the model several times) shares them with the fp32 one."""
    from jobs.entry import split_batch
    from jobs.launcher.inference import _positional, quantize
    from jobs.trainer.workload import inference_batches

    state = _trained_state(CONFIG)
    model = rebuild_model(CONFIG, state)
    table = "sparse_arch.embedding_bag_collection.embedding_bags.t_C7.weight"
    assert model.get_parameter(table).data_ptr() == state["tables"][table].data_ptr()
    _, calibration = inference_batches(CONFIG, data_path)
    int8_faster = lambda subject, variant, run: 1e-3 if variant.startswith("int8") else 2e-3  # noqa: E731
    with torch.no_grad():
        chosen, info = quantize(model, [_positional(model, split_batch(b)) for b in calibration], timer=int8_faster)
    assert info["quantized_modules"] > 0 and chosen is not model
    ebc = "sparse_arch.embedding_bag_collection"
    assert chosen.get_submodule(ebc) is model.get_submodule(ebc)
    assert "__deepcopy__" not in vars(model.get_submodule(ebc))  # the sharing ends with the quantization
