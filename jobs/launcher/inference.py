"""After training: fp32 vs int8 inference of the trained model, its dense layers chosen by ``quant.select_int8``.

The same for the built-in torchrec DLRM and for your model (``[model] factory``). The launcher rebuilds the
model the results table's quality refers to (:func:`rebuild_model`: a fresh model, then the checkpoint's dense
weights, then the tables the ``parameter_servers`` pass had moved, under the model's state-dict names), traces it
with its embedding modules as leaves (they stay fp32), fuses Linear+ReLU, and runs :func:`quant.select_int8`:
FBGEMM static int8, calibrated on training batches, for only the layers measured faster in int8 on this CPU (for
the DLRM: the layers of its dense arch and over arch). Both versions then score the held-out batches: inference
QPS (rows/s, embedding lookups included, one thread; the fastest of alternating passes) and the job's quality
metrics (:func:`jobs.entry.quality`: AUC / log loss for the DLRM).

int8 pays on CPUs with AVX-512 VNNI (4-6x) and often not on AVX2-only ones (1.2x measured, the job's dense DLRM
0.85x). When no layer is faster, or the selected int8 model is not faster end to end, the fp32 model is kept:
``kept_fp32`` is True, ``speedup``
is 1.0 and ``int8`` repeats the fp32 scores, so a slowdown is never reported as the optimized model; ``note``
says why and ``all_int8_speedup`` what plain static PTQ of every layer measured. A model without a layer static
int8 can quantize (``nn.Linear``, ``nn.Conv1d/2d/3d``) outside the ``torch.nn`` modules the tracer keeps whole
(``nn.TransformerEncoder``, ``nn.MultiheadAttention``: they stay fp32) is skipped with the reason.

Any output structure: outputs (a tensor, tuples, lists, dicts, dataclasses registered with pytree) are
compared leaf by leaf, flattened with ``torch.utils._pytree.tree_flatten``: ``output_max_abs_diff`` is the
largest ``|int8 - fp32|`` over the floating tensor leaves of every held-out batch. Layers are named by module
path (``over_arch.model.0._mlp.0._linear``) in ``layers`` (``name`` and ``target``; ``node`` is the graph's node
name), ``note`` and ``selection``.

Never fails after training: :func:`compare` turns any exception (the model does not trace, FakeTensor or
FBGEMM refuses an op, the eval batches do not fit ``forward``) into ``InferenceResult(skipped=reason)`` with the
exception's type and message, which the results table prints and ``results.json`` keeps.

Source: torch.fx paper §6.2.1 (quantization as a graph pass); FBGEMM; DLRM inference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from jobs import entry
from jobs.config import JobConfig
from jobs.records import ModelQuality, ModelState
from jobs.results import InferenceResult

__all__ = ["rebuild_model", "quantize", "compare", "max_abs_diff", "NothingToQuantize"]

QUANTIZABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
"""Layer types static int8 lowers (quant.rules); a model with none of them has nothing to compare."""


class NothingToQuantize(Exception):
    """The traced model has no ``call_module`` node of a :data:`QUANTIZABLE` type (its layers are all inside
    modules the tracer keeps whole); :func:`compare` reports it as the skip reason.

    See docs/troubleshooting.md#nothingtoquantize.
    """


def rebuild_model(config: JobConfig, state: ModelState) -> nn.Module:
    """The trained model with local tables (eval mode): ``state["model"]`` (dense weights) then
    ``state["tables"]`` (``"<path>.weight"``; the servers' optimizer state dropped), loaded into a fresh model
    (:func:`jobs.trainer.workload.build_model`).

    Raises:
        RuntimeError: a table weight that is not in the model's state dict.
    """
    from jobs import criteo
    from jobs.trainer.workload import build_model

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
        # the ignore: torch's stub types Module.__setattr__'s value as Tensor | Module; it stores any object
        m.__deepcopy__ = lambda memo, m=m: m  # type: ignore[assignment]  # deepcopy looks it up on the instance
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
        ``isa``, ``layers`` (one dict per candidate layer: ``name`` and ``target`` its module path, ``node`` its
        graph node name, ``fp32_us``, ``int8_us``, ``speedup``, ``chosen``...), ``kept_fp32``, ``note``,
        ``all_int8_speedup`` and ``selection`` (the report).

    Raises:
        NothingToQuantize: no Linear/Conv layer is traced as its own module (all inside ``torch.nn`` leaves).
        fxdist.TraceError: the model does not trace (control flow on an input); other errors of
            :func:`quant.select_int8` (an op FBGEMM or the observers refuse) propagate.
    """
    import fxdist
    from quant import fuse, select_int8
    from recsys.embedding import EmbeddingLeafTracer, is_embedding_module

    tracer = EmbeddingLeafTracer()  # embedding modules stay whole (and fp32)
    graph = tracer.trace(model)
    gm = fxdist.GraphModule(tracer.root, graph, type(model).__name__)
    if not any(n.op == "call_module" and isinstance(gm.get_submodule(n.target), QUANTIZABLE) for n in graph.nodes):
        whole = sorted({type(gm.get_submodule(n.target)).__name__ for n in graph.nodes if n.op == "call_module"
                        and any(isinstance(m, QUANTIZABLE) for m in gm.get_submodule(n.target).modules())})
        raise NothingToQuantize(f"{type(model).__name__}'s nn.Linear / nn.Conv layers are all inside modules traced "
                                f"whole ({', '.join(whole)}), which stay fp32")
    with _shared_in_copies([m for m in model.modules() if is_embedding_module(m)]):
        fused = fuse(gm, patterns=True)
        chosen, report = select_int8(fused, calibration, timer=timer)
    fused_modules = sum(1 for m in fused.modules() if type(m).__module__.startswith("torch.ao.nn.intrinsic"))
    layers = [{**x, "name": x["target"], "node": x["name"]} for x in report.as_dict()["layers"]]
    info = {"method": "quant: fuse(Linear+ReLU) + select_int8 (FBGEMM static int8 for the layers measured faster; "
                      "embedding tables fp32)",
            "fused_modules": fused_modules, "quantized_modules": sum(1 for x in layers if x["chosen"]),
            "isa": report.isa, "layers": layers, "kept_fp32": report.kept_fp32, "note": report.reason,
            "all_int8_speedup": report.all_int8_speedup, "selection": str(report)}
    return chosen.eval(), info


def _run(model: nn.Module, inputs: list[tuple[Any, ...]]) -> list[Any]:
    """The model's output for each input, in its own structure, every tensor leaf detached."""
    return [tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, model(*x)) for x in inputs]


def max_abs_diff(a: list[Any], b: list[Any]) -> float | None:
    """Largest ``|a - b|`` over the floating tensor leaves of two lists of outputs of any structure, flattened
    with ``torch.utils._pytree.tree_flatten`` (int8 vs fp32 outputs, in the outputs' units); None when no leaf
    is a floating tensor.

    Raises:
        ValueError: the two outputs of a batch differ in structure or in a leaf's shape.
    """
    worst = None
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        (xs, xspec), (ys, yspec) = tree_flatten(x), tree_flatten(y)
        if xspec != yspec:
            raise ValueError(f"held-out batch {i}: the outputs differ in structure: {xspec} vs {yspec}")
        for j, (u, v) in enumerate(zip(xs, ys)):
            if isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) and u.is_floating_point():
                if u.shape != v.shape:
                    raise ValueError(f"held-out batch {i}, output leaf {j}: shapes {tuple(u.shape)} vs "
                                     f"{tuple(v.shape)}")
                d = float((u.double() - v.double()).abs().max()) if u.numel() else 0.0
                worst = d if worst is None else max(worst, d)
    return worst


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


@dataclasses.dataclass
class Int8Keep:
    """Where :func:`compare` leaves the int8 module when it is the model chosen, for the model folder."""

    module: nn.Module | None = None


def compare(config: JobConfig, state: ModelState, data_path: str | Path | None = None, *,
            timer: Any = None, keep: Int8Keep | None = None) -> InferenceResult:
    """fp32 vs int8 inference QPS and quality of the trained model on the held-out batches
    (:func:`jobs.trainer.workload.inference_batches`: the Criteo held-out rows, or your "eval" split).

    Args:
        state: ``{"model": dense weights, "tables": the servers' tables (or {})}`` from a checkpoint.
        data_path: the Criteo file (the built-in model; unused for yours).
        timer: passed to :func:`quantize` (tests inject one); None: measured on this CPU.
        keep: when given, its ``module`` receives the int8 module when it is the model chosen (not ``kept_fp32``), for
            the model folder (:mod:`jobs.launcher.model_export`).

    Returns:
        An :class:`jobs.results.InferenceResult` (units: its fields): :func:`quantize`'s info plus ``rows``,
        ``batch_size``, ``threads``, ``fp32`` and ``int8`` (``qps`` in rows/s and the quality metrics; ``int8`` is the
        model chosen: a copy of ``fp32`` when ``kept_fp32``) and ``speedup`` (int8 / fp32 QPS: exactly 1.0 when fp32 is
        kept, else > 1), ``output_max_abs_diff`` (:func:`max_abs_diff` of the int8 and fp32 outputs: 0.0 when fp32 is
        kept at selection), ``device`` (``"cpu"``: FBGEMM's int8 kernels are CPU kernels, so the comparison runs on the
        launcher's CPU even when the trainers used GPUs; ``device_note`` says so then); or ``skipped`` (the reason)
        alone when the tables are dynamic, there is no held-out batch, no layer to quantize, quantization cannot run
        on the model (the reason names the exception's type and message), or anything else in this stage raised (then
        reason starts with "failed:").

    Never raises an ``Exception``: the job trained, and this stage only adds to its results.
    """
    from jobs.trainer.workload import inference_batches

    if config.model.table_sizes == "dynamic":
        return InferenceResult(skipped='dynamic tables ([model] table_sizes = "dynamic"): their rows are found '
                                       "through the servers' id maps, which the local fp32 / int8 models do not have")
    threads = torch.get_num_threads()
    try:
        held_out, calibration = inference_batches(config, data_path)
        if not held_out:
            return InferenceResult(skipped="no held-out batch (the eval split is empty)")
        torch.set_num_threads(1)
        with torch.no_grad():
            return _compare(config, rebuild_model(config, state), held_out, calibration, timer, keep)
    except Exception as e:  # noqa: BLE001 - recorded as the stage's skip reason, never the job's failure
        return InferenceResult(skipped=f"failed: {_describe(e)}")
    finally:
        torch.set_num_threads(threads)


def _describe(e: BaseException) -> str:
    """``"<type>: <message>"`` of an exception, its lines joined (one line of the results table)."""
    message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


def _compare(config: JobConfig, model: nn.Module, held_out: list[Any], calibration: list[Any],
             timer: Any, keep: Int8Keep | None = None) -> InferenceResult:
    if not any(isinstance(m, QUANTIZABLE) for m in model.modules()):
        return InferenceResult(skipped=f"{type(model).__name__} has no nn.Linear or nn.Conv layer to quantize")
    batches = [entry.split_batch(b, forward=model.forward) for b in held_out]
    inputs, labels = [_positional(model, b) for b in batches], [b[2] for b in batches]
    rows = sum(y.shape[0] for y in labels)
    try:
        with warnings.catch_warnings():  # torch.ao's deprecation notices, once per observer/module
            warnings.simplefilter("ignore", UserWarning)
            int8_model, info = quantize(model, [_positional(model, entry.split_batch(b, forward=model.forward))
                                                for b in calibration],
                                        timer=timer)
    except NothingToQuantize as e:
        return InferenceResult(skipped=str(e))
    except Exception as e:  # noqa: BLE001 - tracing, the cost model, FakeTensor or FBGEMM refused the model
        return InferenceResult(skipped=f"quantization cannot run on {type(model).__name__}: {_describe(e)}")
    models = {"fp32": model} if info["kept_fp32"] else {"fp32": model, "int8": int8_model}
    qps = _best_qps(models, inputs, rows)
    fp32_out = _run(model, inputs)
    fp32: ModelQuality = {"qps": qps["fp32"], **entry.quality(config, fp32_out, labels)}
    int8, info["output_max_abs_diff"] = fp32.copy(), 0.0
    if not info["kept_fp32"]:
        int8_out = _run(int8_model, inputs)
        info["output_max_abs_diff"] = max_abs_diff(int8_out, fp32_out)
        measured: ModelQuality = {"qps": qps["int8"], **entry.quality(config, int8_out, labels)}
        if measured["qps"] > fp32["qps"]:
            int8 = measured
            if keep is not None:
                keep.module = int8_model
        else:  # the selected layers were faster, the whole model with its lookups is not: keep fp32
            info.update(kept_fp32=True, int8_measured=measured, quantized_modules=0,
                        layers=[{**x, "chosen": False} for x in info["layers"]],
                        note=f"kept fp32: the selected int8 model ran at {measured['qps'] / fp32['qps']:.2f}x "
                             "fp32 end to end (embedding lookups included)")
    out = InferenceResult(**info, rows=rows, batch_size=labels[0].shape[0], threads=1, fp32=fp32, int8=int8,
                          speedup=int8["qps"] / fp32["qps"], device="cpu")
    if config.cluster.use_gpu:  # FBGEMM's int8 kernels are CPU kernels: the comparison stays on the CPU
        out = dataclasses.replace(out, device_note="a CPU inference measurement (FBGEMM int8 kernels), on the "
                                                   "launcher's CPU; the trainers trained on GPUs")
    return out
