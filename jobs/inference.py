"""After training: post-training int8 quantization of the dense DLRM and an fp32-vs-int8 comparison.

The trained model is rebuilt in the launching process from the final checkpoint (dense weights, plus
the parameter servers' tables when the job had servers). Its dense part (:class:`jobs.model.DenseDLRM`:
bottom MLP, interaction, top MLP) goes through quant/'s passes (trace with fxdist, fuse, prepare with
FBGEMM observers, calibrate on training batches, convert to int8 kernels); the embedding lookup stays
fp32. Both versions then score the held-out rows: inference QPS (rows/s, embedding lookup included,
batch ``[quant] eval_batch_size``, one thread) and AUC / log loss.

Source: torch.fx paper §6.2.1 (quantization); FBGEMM; DLRM inference.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from jobs.config import JobConfig
from jobs.data import CriteoShard
from jobs.model import DenseDLRM
from jobs.stats import binary_metrics

__all__ = ["rebuild_model", "quantize_dense", "compare"]


def rebuild_model(config: JobConfig, final: dict[str, Any]) -> nn.Module:
    """The trained DLRM with local embedding tables, from the final checkpoint's contents."""
    from jobs.worker import build_model

    model = build_model(config)
    missing, unexpected = model.load_state_dict(final["model"], strict=False)
    if final.get("tables"):
        from jobs.ps import tables_to_local

        tables_to_local(final["tables"], model.sparse_arch)
    elif any(k.startswith("sparse_arch.") for k in missing):
        raise RuntimeError(f"final checkpoint has no embedding tables (missing {missing})")
    return model.eval()


class _Quantized(nn.Module):
    """Local embedding lookup (fp32) followed by a quantized dense model."""

    def __init__(self, embeddings: nn.Module, dense: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.dense = dense

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.dense(dense, self.embeddings(sparse))


def quantize_dense(model: nn.Module, calibration: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[nn.Module, dict]:
    """int8 version of ``DenseDLRM(model)`` calibrated on ``[(dense, embedded), ...]``.

    Returns:
        (quantized dense module, info): ``info["method"]`` names the path taken.
    """
    import fxdist
    from quant import calibrate, convert, fuse, prepare

    dense = DenseDLRM(model).eval()
    fused = fuse(fxdist.symbolic_trace(dense), patterns=True)
    prepared = prepare(fused, example_inputs=calibration[0], backend="fbgemm")
    calibrate(prepared, calibration, progress=False)
    int8 = convert(prepared)
    fused_modules = sum(1 for m in fused.modules() if type(m).__module__.startswith("torch.ao.nn.intrinsic"))
    quantized_modules = sum(1 for m in int8.modules() if type(m).__module__.startswith("torch.ao.nn.quantized"))
    info = {"method": "quant: fuse(Linear+ReLU) + prepare + calibrate + convert (FBGEMM int8)",
            "fused_modules": fused_modules, "quantized_modules": quantized_modules}
    return int8, info


def _inference_qps(model: nn.Module, batches: list, *, min_seconds: float = 1.0) -> float:
    """Rows per second of ``model`` over ``batches`` (repeated until ``min_seconds`` have passed)."""
    with torch.no_grad():
        model(batches[0].dense, batches[0].sparse)  # warm-up
        rows, start = 0, time.perf_counter()
        while True:
            for b in batches:
                model(b.dense, b.sparse)
                rows += b.labels.shape[0]
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                return rows / elapsed


def _quality(model: nn.Module, batches: list) -> dict[str, float]:
    with torch.no_grad():
        probs = torch.cat([torch.sigmoid(model(b.dense, b.sparse)) for b in batches])
    return binary_metrics(probs, torch.cat([b.labels for b in batches]))


def compare(config: JobConfig, final: dict[str, Any], data_path: str | Path) -> dict[str, Any]:
    """fp32 vs int8 inference QPS and accuracy of the trained model on the held-out rows."""
    q = config.quant
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = rebuild_model(config, final)
        eval_fraction = config.data.eval_fraction or 0.1
        held_out = CriteoShard(data_path, config.model.table_size, eval_fraction=eval_fraction, split="eval")
        train = CriteoShard(data_path, config.model.table_size, eval_fraction=eval_fraction)
        batches = list(held_out.all_batches(q.eval_batch_size))
        with torch.no_grad():
            calibration = [(b.dense, model.sparse_arch(b.sparse))
                           for b, _ in zip(train.batches(q.eval_batch_size), range(q.calibration_batches))]
        with warnings.catch_warnings():  # torch.ao's deprecation notices, once per observer/module
            warnings.simplefilter("ignore", UserWarning)
            int8_dense, info = quantize_dense(model, calibration)
        int8 = _Quantized(model.sparse_arch, int8_dense).eval()
        fp32_qps, int8_qps = _inference_qps(model, batches), _inference_qps(int8, batches)
        return {
            **info,
            "rows": sum(b.labels.shape[0] for b in batches),
            "batch_size": q.eval_batch_size,
            "threads": 1,
            "fp32": {"qps": fp32_qps, **_quality(model, batches)},
            "int8": {"qps": int8_qps, **_quality(int8, batches)},
            "speedup": int8_qps / fp32_qps,
        }
    finally:
        torch.set_num_threads(threads)
