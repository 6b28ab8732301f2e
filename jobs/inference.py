"""After training: fp32 vs int8 inference of the trained model, its dense layers chosen by ``quant.select_int8``.

The same for the built-in torchrec DLRM and for your model (``[model] factory``). The launcher rebuilds the
model the results table's quality refers to (:func:`rebuild_model`: a fresh model, then the checkpoint's dense
weights, then the tables the ``parameter_servers`` pass had moved, under the model's state-dict names), traces it
with its embedding modules as leaves (they stay fp32), fuses Linear+ReLU, and runs :func:`quant.select_int8`:
FBGEMM static int8, calibrated on training batches, for only the layers measured faster in int8 on this CPU (for
the DLRM: the layers of its dense arch and over arch). Both versions then score the held-out batches: inference
QPS (rows/s, embedding lookups included, one thread; the fastest of alternating passes) and the job's quality
metrics (:func:`jobs.entry.quality`: AUC / log loss for the DLRM).

int8 pays on CPUs with AVX-512 VNNI (4-6x) and often not on AVX2-only ones (FACTS.md). When no layer is faster,
or the selected int8 model is not faster end to end, the fp32 model is kept: ``kept_fp32`` is True, ``speedup``
is 1.0 and ``int8`` repeats the fp32 scores, so a slowdown is never reported as the optimized model; ``note``
says why and ``all_int8_speedup`` what plain static PTQ of every layer measured. A model without a layer static
int8 can quantize (``nn.Linear``, ``nn.Conv1d/2d/3d``) is skipped with the reason.

Source: torch.fx paper §6.2.1 (quantization as a graph pass); FBGEMM; DLRM inference.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from jobs import entry
from jobs.config import JobConfig

__all__ = ["rebuild_model", "quantize", "compare"]

QUANTIZABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
"""Layer types static int8 lowers (quant.rules); a model with none of them has nothing to compare."""


def rebuild_model(config: JobConfig, state: dict[str, Any]) -> nn.Module:
    """The trained model with local tables (eval mode): ``state["model"]`` (dense weights) then
    ``state["tables"]`` (``"<path>.weight"``; the servers' optimizer state dropped), loaded into a fresh model
    (:func:`jobs.workload.build_model`).

    Raises:
        RuntimeError: a table weight that is not in the model's state dict.
    """
    from jobs import criteo
    from jobs.workload import build_model

    # the built-in DLRM's server tables come from the checkpoint: built on meta, then the checkpoint's tensors
    # are assigned (no copy: with the launcher's mmap'ed checkpoint, pages are read as the lookups touch them)
    on_servers = not config.user_model and config.cluster.parameter_servers > 0
    model = criteo.dlrm(config, tables_device="meta") if on_servers else build_model(config)
    model.load_state_dict(state["model"], strict=False, assign=True)
    tables = {k: v for k, v in (state.get("tables") or {}).items() if k.endswith(".weight")}
    _, unexpected = model.load_state_dict(tables, strict=False, assign=True)
    if unexpected:
        raise RuntimeError(f"checkpoint tables not in {type(model).__name__}'s state dict: {unexpected}")
    missing = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if missing:
        raise RuntimeError(f"the checkpoint has no tables for {missing} (state keys: {sorted(tables)})")
    return model.eval()


@contextlib.contextmanager
def _shared_in_copies(modules: list[nn.Module]) -> Iterator[None]:
    """Deep copies made inside share ``modules`` instead of copying them: quantization copies the model several
    times (prepare, convert, each layer subset), and the embedding tables it keeps fp32 are most of its bytes."""
    for m in modules:
        m.__deepcopy__ = lambda memo, m=m: m  # copy.deepcopy looks the hook up on the instance
    try:
        yield
    finally:
        for m in modules:
            del m.__deepcopy__


def _positional(model: nn.Module, batch: tuple[tuple, dict, torch.Tensor]) -> tuple[Any, ...]:
    """A batch's inputs as ``model.forward``'s positional arguments (a traced module takes them so)."""
    args, kwargs, _ = batch
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    if bound.kwargs:
        raise TypeError(f"{type(model).__name__}.forward takes keyword-only inputs {sorted(bound.kwargs)}")
    return tuple(bound.args)


def quantize(model: nn.Module, calibration: list[tuple[Any, ...]], *, timer: Any = None) -> tuple[nn.Module, dict]:
    """``model`` with int8 for the layers that pay (:func:`quant.select_int8`), calibrated on ``calibration``
    (positional inputs of ``model``; the first is also the timing input).

    Args:
        timer: a :data:`quant.select.Timer` for the per-layer measurements (tests inject one); None: measured.

    Returns:
        (module, info): ``info`` has ``method``, ``fused_modules``, ``quantized_modules`` (the layers in int8; 0
        when fp32 is kept),
        ``isa``, ``layers`` (one dict per candidate layer: ``name``, ``target``, ``fp32_us``, ``int8_us``,
        ``speedup``, ``chosen``...), ``kept_fp32``, ``note``, ``all_int8_speedup`` and ``selection`` (the report).
    """
    import fxdist
    from quant import fuse, select_int8
    from recsys.embedding import EmbeddingLeafTracer, is_embedding_module

    tracer = EmbeddingLeafTracer()  # embedding modules stay whole (and fp32)
    graph = tracer.trace(model)
    gm = fxdist.GraphModule(tracer.root, graph, type(model).__name__)
    with _shared_in_copies([m for m in model.modules() if is_embedding_module(m)]):
        fused = fuse(gm, patterns=True)
        chosen, report = select_int8(fused, calibration, timer=timer)
    fused_modules = sum(1 for m in fused.modules() if type(m).__module__.startswith("torch.ao.nn.intrinsic"))
    layers = report.as_dict()["layers"]
    info = {"method": "quant: fuse(Linear+ReLU) + select_int8 (FBGEMM static int8 for the layers measured faster; "
                      "embedding tables fp32)",
            "fused_modules": fused_modules, "quantized_modules": sum(1 for x in layers if x["chosen"]),
            "isa": report.isa, "layers": layers, "kept_fp32": report.kept_fp32, "note": report.reason,
            "all_int8_speedup": report.all_int8_speedup, "selection": str(report)}
    return chosen.eval(), info


def _run(model: nn.Module, inputs: list[tuple[Any, ...]]) -> list[torch.Tensor]:
    return [model(*x).detach() for x in inputs]


def _best_qps(models: dict[str, nn.Module], inputs: list[tuple[Any, ...]], rows: int, *, min_seconds: float = 1.0,
              min_passes: int = 5, max_passes: int = 500) -> dict[str, float]:
    """Rows per second of each model: ``rows`` over its fastest pass through ``inputs``, the models' passes
    alternating until each has run ``min_passes`` and ``min_seconds`` have passed per model (at most
    ``max_passes``). The best pass, not the mean: other processes only ever add time, and alternating makes a
    burst of their load hit every model, not one (as ``quant.select``'s timings)."""
    best = dict.fromkeys(models, math.inf)
    for model in models.values():
        model(*inputs[0])  # warm-up
    passes, start = 0, time.perf_counter()
    while passes < max_passes and (passes < min_passes or time.perf_counter() - start < min_seconds * len(models)):
        for name, model in models.items():
            t0 = time.perf_counter()
            for x in inputs:
                model(*x)
            best[name] = min(best[name], time.perf_counter() - t0)
        passes += 1
    return {name: rows / seconds for name, seconds in best.items()}


def compare(config: JobConfig, state: dict[str, Any], data_path: str | Path | None = None, *,
            timer: Any = None) -> dict[str, Any]:
    """fp32 vs int8 inference QPS and quality of the trained model on the held-out batches
    (:func:`jobs.workload.inference_batches`: the Criteo held-out rows, or your "eval" split).

    Args:
        state: ``{"model": dense weights, "tables": the servers' tables (or {})}`` from a checkpoint.
        data_path: the Criteo file (the built-in model; unused for yours).
        timer: passed to :func:`quantize` (tests inject one); None: measured on this CPU.

    Returns:
        :func:`quantize`'s info plus ``rows``, ``batch_size``, ``threads``, ``fp32`` and ``int8`` (``qps`` in
        rows/s and the quality metrics; ``int8`` is the model chosen: a copy of ``fp32`` when ``kept_fp32``) and
        ``speedup`` (int8 / fp32 QPS: exactly 1.0 when fp32 is kept, else > 1), ``device`` (``"cpu"``: FBGEMM's int8
        kernels are CPU kernels, so the comparison runs on the launcher's CPU even when the trainers used GPUs;
        ``device_note`` says so then); or ``{"skipped": reason}`` when
        there is no held-out batch or no layer to quantize.
    """
    from jobs.workload import inference_batches

    held_out, calibration = inference_batches(config, data_path)
    if not held_out:
        return {"skipped": "no held-out batch (the eval split is empty)"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return _compare(config, rebuild_model(config, state), held_out, calibration, timer)
    finally:
        torch.set_num_threads(threads)


def _compare(config: JobConfig, model: nn.Module, held_out: list[Any], calibration: list[Any],
             timer: Any) -> dict[str, Any]:
    if not any(isinstance(m, QUANTIZABLE) for m in model.modules()):
        return {"skipped": f"{type(model).__name__} has no nn.Linear or nn.Conv layer to quantize"}
    batches = [entry.split_batch(b, forward=model.forward) for b in held_out]
    inputs, labels = [_positional(model, b) for b in batches], [b[2] for b in batches]
    rows = sum(y.shape[0] for y in labels)
    with warnings.catch_warnings():  # torch.ao's deprecation notices, once per observer/module
        warnings.simplefilter("ignore", UserWarning)
        int8_model, info = quantize(model, [_positional(model, entry.split_batch(b, forward=model.forward))
                                            for b in calibration], timer=timer)
    models = {"fp32": model} if info["kept_fp32"] else {"fp32": model, "int8": int8_model}
    qps = _best_qps(models, inputs, rows)
    fp32 = {"qps": qps["fp32"], **entry.quality(config, _run(model, inputs), labels)}
    int8 = dict(fp32)
    if not info["kept_fp32"]:
        measured = {"qps": qps["int8"], **entry.quality(config, _run(int8_model, inputs), labels)}
        if measured["qps"] > fp32["qps"]:
            int8 = measured
        else:  # the selected layers were faster, the whole model with its lookups is not: keep fp32
            info.update(kept_fp32=True, int8_measured=measured, quantized_modules=0,
                        layers=[{**x, "chosen": False} for x in info["layers"]],
                        note=f"kept fp32: the selected int8 model ran at {measured['qps'] / fp32['qps']:.2f}x "
                             "fp32 end to end (embedding lookups included)")
    out = {**info, "rows": rows, "batch_size": labels[0].shape[0], "threads": 1, "fp32": fp32, "int8": int8,
           "speedup": int8["qps"] / fp32["qps"], "device": "cpu"}
    if config.cluster.use_gpu:  # FBGEMM's int8 kernels are CPU kernels: the comparison stays on the CPU
        out["device_note"] = ("a CPU inference measurement (FBGEMM int8 kernels), on the launcher's CPU; the "
                              "trainers trained on GPUs")
    return out
