"""jobs.inference.compare keeps fp32 (speed-up 1.00x) when no layer is faster in int8, and the table says so."""

from __future__ import annotations

import re

import pytest
import torch

from jobs.config import JobConfig
from jobs.data import write_synthetic_criteo
from jobs.inference import compare
from jobs.report import table
from jobs.worker import build_model
from quant import cpu_isa

CONFIG = JobConfig().replace(model={"table_size": 300, "bottom_mlp": [32], "top_mlp": [32]},
                             quant={"calibration_batches": 2, "eval_batch_size": 64})


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return write_synthetic_criteo(tmp_path_factory.mktemp("data") / "c.tsv", 400, seed=5)


def test_compare_keeps_fp32_when_no_layer_is_faster_in_int8(data_path):
    calls = []

    def int8_slower(subject, variant, run):  # every int8 variant takes twice as long as fp32
        calls.append((subject, variant))
        return 2e-3 if variant.startswith("int8") else 1e-3

    final = {"model": build_model(CONFIG).state_dict()}
    threads = torch.get_num_threads()
    r = compare(CONFIG, final, data_path, timer=int8_slower)
    assert torch.get_num_threads() == threads  # compare runs on one thread and restores the setting
    assert r["kept_fp32"] is True and r["speedup"] == 1.0 and r["quantized_modules"] == 0
    assert r["isa"] == cpu_isa() and r["note"] == f"kept fp32: no layer is faster in int8 on this CPU ({cpu_isa()})"
    # bottom: Linear+ReLU 13->32, 32->16 (ReLU); top: Linear+ReLU 367->32, Linear 32->1
    assert [x["target"] for x in r["layers"]] == ["bottom.0", "bottom.2", "top.0", "top.2"]
    assert not any(x["chosen"] for x in r["layers"]) and {s for s, _ in calls} >= {"bottom_0", "top_0"}
    assert r["int8"] == r["fp32"] and r["fp32"]["qps"] > 0 and 0 <= r["fp32"]["auc"] <= 1
    assert r["all_int8_speedup"] == pytest.approx(0.5)
    results = {"job": "demo", "config": {"cluster": {"trainers": 1, "parameter_servers": 0},
                                         "job": {"steps": 2, "batch_size": 8}},
               "phases": {}, "inference": {**r, "model_step": 2}}
    text = table(results)
    assert f"int8 speed-up: 1.00x (kept fp32: no layer is faster in int8 on this CPU ({cpu_isa()}))" in text
    assert "bottom.0 1000.0 / 2000.0 -> fp32" in text
    assert re.search(r"^fp32\s+\d", text, re.M) and not re.search(r"^int8\s+\d", text, re.M)  # no int8 row


def test_compare_keeps_fp32_when_the_selection_is_slower_end_to_end(data_path, monkeypatch):
    import jobs.inference as inference

    def qps(model, batches, **kwargs):  # the whole model (with its lookup) measured slower in int8
        return 900.0 if isinstance(model, inference._Quantized) else 1000.0

    monkeypatch.setattr(inference, "_inference_qps", qps)
    int8_faster = lambda subject, variant, run: 1e-3 if variant.startswith("int8") else 2e-3  # noqa: E731
    r = compare(CONFIG, {"model": build_model(CONFIG).state_dict()}, data_path, timer=int8_faster)
    assert r["int8_measured"]["qps"] == 900.0 and 0 <= r["int8_measured"]["auc"] <= 1
    assert r["kept_fp32"] and r["speedup"] == 1.0 and r["int8"] == r["fp32"] and r["quantized_modules"] == 0
    assert r["note"] == "kept fp32: the selected int8 model ran at 0.90x fp32 end to end (embedding lookup included)"
    assert len(r["layers"]) == 4 and not any(x["chosen"] for x in r["layers"])
    assert "int8 for 4 of 4 layers: 2.00x the fp32 module" in r["selection"]
