"""After training: post-training int8 quantization of the dense DLRM and an fp32-vs-int8 comparison.

The trained model is rebuilt in the launching process from the final checkpoint (dense weights, plus
the parameter servers' tables when the job had servers). Its dense part (:class:`jobs.model.DenseDLRM`:
bottom MLP, interaction, top MLP) goes through quant/'s passes (trace with fxdist, fuse, then
:func:`quant.select_int8`: FBGEMM static int8, calibrated on training batches, for only the layers measured
faster in int8 on this CPU); the embedding lookup stays fp32. Both versions then score the held-out rows:
inference QPS (rows/s, embedding lookup included, batch ``[quant] eval_batch_size``, one thread) and
AUC / log loss.

int8 pays on CPUs with AVX-512 VNNI (4-6x) and often not on AVX2-only ones (FACTS.md). When no layer is
faster, or the selected int8 model is not faster end to end, the fp32 model is kept: ``kept_fp32`` is True,
``speedup`` is 1.0 and ``int8`` repeats the fp32 scores, so a slowdown is never reported as the optimized
model; ``note`` says why and ``all_int8_speedup`` what plain static PTQ of every layer measured.

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


def quantize_dense(model: nn.Module, calibration: list[tuple[torch.Tensor, torch.Tensor]], *,
                   timer: Any = None) -> tuple[nn.Module, dict]:
    """The dense model ``DenseDLRM(model)`` with int8 for the layers that pay, calibrated on ``[(dense, embedded), ...]``.

    Args:
        timer: a :data:`quant.select.Timer` for the per-layer measurements (tests inject one); None: measured.

    Returns:
        (dense module, info): ``info`` has ``method``, ``fused_modules``, ``quantized_modules`` (0 when fp32
        is kept), ``isa``, ``layers`` (one dict per candidate layer: ``name``, ``fp32_us``, ``int8_us``,
        ``speedup``, ``chosen``...), ``kept_fp32``, ``note`` and ``selection`` (the report's text).
    """
    import fxdist
    from quant import fuse, select_int8

    dense = DenseDLRM(model).eval()
    fused = fuse(fxdist.symbolic_trace(dense), patterns=True)
    chosen, report = select_int8(fused, calibration, timer=timer)
    fused_modules = sum(1 for m in fused.modules() if type(m).__module__.startswith("torch.ao.nn.intrinsic"))
    quantized_modules = sum(1 for m in chosen.modules() if type(m).__module__.startswith("torch.ao.nn.quantized"))
    info = {"method": "quant: fuse(Linear+ReLU) + select_int8 (FBGEMM static int8 for the layers measured faster)",
            "fused_modules": fused_modules, "quantized_modules": quantized_modules, "isa": report.isa,
            "layers": report.as_dict()["layers"], "kept_fp32": report.kept_fp32, "note": report.reason,
            "all_int8_speedup": report.all_int8_speedup, "selection": str(report)}
    return chosen, info


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


def compare(config: JobConfig, final: dict[str, Any], data_path: str | Path, *, timer: Any = None) -> dict[str, Any]:
    """fp32 vs int8 inference QPS and accuracy of the trained model on the held-out rows.

    Args:
        timer: passed to :func:`quantize_dense` (tests inject one); None: measured on this CPU.

    Returns:
        :func:`quantize_dense`'s info plus ``rows``, ``batch_size``, ``threads``, ``fp32`` and ``int8``
        (``qps`` in rows/s, ``auc``, ``log_loss``; ``int8`` is the model chosen: a copy of ``fp32`` when
        ``kept_fp32``) and ``speedup`` (int8 / fp32 QPS: exactly 1.0 when fp32 is kept, else > 1).
    """
    q = config.quant
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = rebuild_model(config, final)
        eval_fraction = config.data.eval_fraction or 0.1
        sizes = config.table_sizes
        held_out = CriteoShard(data_path, sizes, eval_fraction=eval_fraction, split="eval",
                               max_rows=config.data.eval_max_rows, count_all=False)
        train = CriteoShard(data_path, sizes, eval_fraction=eval_fraction, count_all=False,
                            max_rows=q.eval_batch_size * q.calibration_batches)
        batches = list(held_out.all_batches(q.eval_batch_size))
        with torch.no_grad():
            calibration = [(b.dense, model.sparse_arch(b.sparse))
                           for b, _ in zip(train.batches(q.eval_batch_size), range(q.calibration_batches))]
        with warnings.catch_warnings():  # torch.ao's deprecation notices, once per observer/module
            warnings.simplefilter("ignore", UserWarning)
            int8_dense, info = quantize_dense(model, calibration, timer=timer)
        fp32 = {"qps": _inference_qps(model, batches), **_quality(model, batches)}
        int8 = dict(fp32)
        if not info["kept_fp32"]:
            chosen = _Quantized(model.sparse_arch, int8_dense).eval()
            measured = {"qps": _inference_qps(chosen, batches), **_quality(chosen, batches)}
            if measured["qps"] > fp32["qps"]:
                int8 = measured
            else:  # the dense module was faster, the whole model with its lookup is not: keep fp32
                info.update(kept_fp32=True, int8_measured=measured, quantized_modules=0,
                            layers=[{**x, "chosen": False} for x in info["layers"]],
                            note=f"kept fp32: the selected int8 model ran at {measured['qps'] / fp32['qps']:.2f}x "
                                 "fp32 end to end (embedding lookup included)")
        return {
            **info,
            "rows": sum(b.labels.shape[0] for b in batches),
            "batch_size": q.eval_batch_size,
            "threads": 1,
            "fp32": fp32,
            "int8": int8,
            "speedup": int8["qps"] / fp32["qps"],
        }
    finally:
        torch.set_num_threads(threads)
