"""After training your model (``[model] factory``): fp32 vs int8 inference with its dense Linear layers quantized.

The generic counterpart of :mod:`jobs.inference` (the built-in DLRM's static PTQ): the launcher rebuilds your
model from the checkpoint the table's quality refers to (its dense weights, and the tables the
``parameter_servers`` pass moved, under your model's state-dict names), traces it with the embedding modules
as leaves, and swaps every ``nn.Linear`` for FBGEMM's dynamic int8 Linear (``quant.quantize_dynamic``: int8
per-channel weights, activations quantized per batch, no calibration); the embedding tables stay fp32. Both
versions then score the held-out batches of ``[data] batches``: inference QPS (rows/s, one thread) and the
job's quality metrics (:func:`jobs.entry.quality`).

Source: torch.fx paper §6.2.1 (quantization as a graph pass); torch.ao dynamic quantization (FBGEMM).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
from torch import nn

from jobs import entry
from jobs.config import JobConfig

__all__ = ["rebuild_model", "compare"]


def rebuild_model(config: JobConfig, state: dict[str, Any]) -> nn.Module:
    """Your trained model with local tables: ``state["model"]`` (dense weights) then ``state["tables"]``
    (``"<path>.weight"``; optimizer state dropped), loaded into a fresh ``factory`` model (eval mode).

    Raises:
        RuntimeError: a table weight that is not in your model's state dict.
    """
    model = entry.make_model(config)
    model.load_state_dict(state["model"], strict=False)
    tables = {k: v for k, v in (state.get("tables") or {}).items() if k.endswith(".weight")}
    _, unexpected = model.load_state_dict(tables, strict=False)
    if unexpected:
        raise RuntimeError(f"checkpoint tables not in {type(model).__name__}'s state dict: {unexpected}")
    return model.eval()


def _quantize(model: nn.Module) -> tuple[nn.Module, int]:
    import fxdist
    from quant import quantize_dynamic
    from scheduling.placement import EmbeddingLeafTracer

    tracer = EmbeddingLeafTracer()  # embedding modules stay whole (and fp32)
    graph = tracer.trace(model)
    gm = fxdist.GraphModule(tracer.root, graph, type(model).__name__)
    with warnings.catch_warnings():  # torch.ao's deprecation notices
        warnings.simplefilter("ignore")
        int8 = quantize_dynamic(gm, types=(nn.Linear,))
    count = sum(1 for m in int8.modules() if type(m).__module__.startswith("torch.ao.nn.quantized.dynamic"))
    return int8.eval(), count


def _run(model: nn.Module, batches: list[tuple[tuple, dict, torch.Tensor]]) -> list[torch.Tensor]:
    return [model(*args, **kwargs).detach() for args, kwargs, _ in batches]


def _qps(model: nn.Module, batches: list[tuple[tuple, dict, torch.Tensor]], min_seconds: float = 1.0) -> float:
    _run(model, batches[:1])  # warm-up
    rows, start = 0, time.perf_counter()
    while True:
        for args, kwargs, labels in batches:
            model(*args, **kwargs)
            rows += labels.shape[0]
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return rows / elapsed


def compare(config: JobConfig, state: dict[str, Any]) -> dict[str, Any]:
    """fp32 vs int8 (dynamic Linear) inference QPS and quality of your trained model on the held-out batches.

    Returns:
        The :mod:`jobs.inference` result keys (``method``, ``rows``, ``batch_size``, ``threads``, ``fp32``,
        ``int8``, ``speedup``, ``quantized_modules``), or ``{"skipped": reason}`` when there is no held-out
        batch or no ``nn.Linear`` to quantize.
    """
    batches = [entry.split_batch(b) for b in entry.epoch_batches(config, entry.data_context(config, "eval"))]
    if not batches:
        return {"skipped": "no held-out batch ([data] batches gave none for the eval split)"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            model = rebuild_model(config, state)
            int8, count = _quantize(model)
            if count == 0:
                return {"skipped": f"{type(model).__name__} has no nn.Linear layer to quantize"}
            labels = [y for _, _, y in batches]
            fp32_q = entry.quality(config, _run(model, batches), labels)
            int8_q = entry.quality(config, _run(int8, batches), labels)
            fp32_qps, int8_qps = _qps(model, batches), _qps(int8, batches)
    finally:
        torch.set_num_threads(threads)
    return {"method": "quant.quantize_dynamic: nn.Linear -> dynamic int8 (FBGEMM), tables fp32",
            "quantized_modules": count, "rows": sum(y.shape[0] for y in labels),
            "batch_size": labels[0].shape[0], "threads": 1, "fp32": {"qps": fp32_qps, **fp32_q},
            "int8": {"qps": int8_qps, **int8_q}, "speedup": int8_qps / fp32_qps}
