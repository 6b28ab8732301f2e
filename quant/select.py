"""``SelectInt8``: quantize only the layers that run faster in int8 on this CPU (measured); keep the rest fp32.

FBGEMM's int8 kernels are 4-6x fp32 on CPUs with AVX-512 VNNI, about 1.2x on AVX2-only parts, and slower than
fp32 for small layers there (measured on an AVX2-only AMD EPYC: the job's dense DLRM at batch 256 ran at
0.62-0.85x fp32). Static PTQ (:func:`quant.prepare` -> :func:`quant.calibrate` -> :func:`quant.convert`)
quantizes every layer it can; this pass measures each one on the machine at hand, on the calibration inputs, and
keeps only those that pay.

Steps (one function each):
 1. Prepare and calibrate the whole module and convert it: the "all int8" module (plain static PTQ), whose
    quantized modules are the per-layer int8 versions.
 2. Candidates: every ``call_module`` node static PTQ lowers (Linear, Linear+ReLU, Conv{1,2,3}d(+ReLU)...),
    with its real input captured on the first calibration batch. The cost model
    (:func:`fxdist.passes.cost_model.estimate`: a roofline on this CPU's measured profile; its ShapeProp runs
    under FakeTensor with the attention fast path off, on the real inputs when FakeTensor refuses an op)
    predicts each one's fp32 time; layers predicted under ``min_share`` of the candidates' total are not
    measured and stay fp32 (quantizing them could save at most that share). The others are measured, largest predicted first.
 3. Measure each candidate: the fp32 module on its input, the int8 module on that input quantized with the
    observer's qparams, and the boundary it pays when its neighbours stay fp32 (``quantize_per_tensor`` of the
    input plus ``dequantize`` of the output). Variants are timed in alternating rounds (``rounds``), keeping
    each one's best, so a burst of load from other processes hits all of them.
 4. Choose the layers faster in int8. A function op static PTQ would quantize (``add``, ``cat``...) stays int8
    only when every input arrives in int8 from a chosen layer, so it adds no ``quantize``. Convert that subset
    (the rest excluded in ``prepare``, which places the dequantize/quantize boundaries) and measure the whole
    module against fp32 (the best fp32 time seen). If it is not faster, retry with the layers that are faster even after paying their
    own boundary; if no try is faster, keep the fp32 module.

The result carries a :class:`SelectionReport` (``gm.meta["quant_selection"]``): per layer the fp32 and int8
times, the speed-up and the choice, the whole-module times, and the ISA seen (:func:`cpu_isa`).

Shapes: those of the calibration batches; the timings hold for that batch size and the current
``torch.get_num_threads()``. Units: the timer returns seconds per call; the report shows µs.

Source: FBGEMM (int8 GEMM: ``vpdpbusd`` with VNNI, ``vpmaddubsw`` + ``vpmaddwd`` on AVX2); torch.fx paper
§6.2.1 (quantization) and §6.3 (cost model); measure-then-choose as in ``torch.backends.cudnn.benchmark``.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
from torch.ao.quantization.observer import ObserverBase

import fxdist as fx
from fxdist.interpreter import Interpreter
from fxdist.passes.pass_base import PassBase, PassManager, PassResult
from quant.convert import calibrate, convert
from quant.errors import QuantizationError
from quant.prepare import prepare
from quant.rules import QUANTIZED_MODULES, _tensor_inputs

__all__ = ["SelectInt8", "SelectionReport", "LayerChoice", "Timer", "best_time", "cpu_isa", "isa_from_flags",
           "select_int8"]

Timer = Callable[[str, str, Callable[[], Any]], float]
"""``timer(subject, variant, run) -> seconds per call of run()``.

``subject`` is a layer's node name or ``"<module>"``. ``variant`` is, for a layer, ``"fp32"``, ``"int8"`` or
``"q/dq"`` (its boundary); for the module, ``"fp32"``, ``"int8"`` (every candidate in int8, plain static PTQ) or
``"int8:" + "+".join(node names)`` (a selection). Calls come under ``torch.no_grad()``.
"""
MODULE = "<module>"


def best_time(repeats: int = 5, min_block_seconds: float = 0.002, min_seconds: float = 0.05) -> Timer:
    """A :data:`Timer`: the best of at least ``repeats`` blocks, each of enough calls to last
    ``min_block_seconds``; more blocks run until ``min_seconds`` have passed (at most ``20 * repeats``).

    The minimum, not the mean: other processes only ever add time (Python's ``timeit`` documentation), and
    the 2-core CI box is shared, so more blocks give more chances of an undisturbed one. One call runs first
    as a warm-up (weight packing, allocator).

    Raises:
        ValueError: ``repeats`` < 1, or a negative ``min_block_seconds`` / ``min_seconds``.
    """
    if repeats < 1 or min_block_seconds < 0 or min_seconds < 0:
        raise ValueError(f"best_time: repeats must be >= 1, min_block_seconds and min_seconds >= 0, got {repeats}, "
                         f"{min_block_seconds}, {min_seconds}")

    def timer(subject: str, variant: str, run: Callable[[], Any]) -> float:
        run()
        start = time.perf_counter()
        run()
        number = max(1, math.ceil(min_block_seconds / max(time.perf_counter() - start, 1e-9)))
        best, blocks, began = math.inf, 0, time.perf_counter()
        while blocks < repeats or (time.perf_counter() - began < min_seconds and blocks < 20 * repeats):
            start = time.perf_counter()
            for _ in range(number):
                run()
            best = min(best, (time.perf_counter() - start) / number)
            blocks += 1
        return best

    return timer


def isa_from_flags(flags: Iterable[str]) -> str:
    """The int8 dot-product instructions a CPU with these ``/proc/cpuinfo`` flags offers FBGEMM.

    >>> isa_from_flags({"avx2", "avx512f", "avx512_vnni"}), isa_from_flags({"avx2", "avx_vnni"})
    ('AVX-512 VNNI', 'AVX-VNNI')
    >>> isa_from_flags({"sse4_2", "avx2", "fma"}), isa_from_flags({"sse4_2"})
    ('AVX2, no VNNI', 'no AVX2')
    """
    flags = set(flags)
    if flags & {"avx512_vnni", "avx512vnni"}:
        return "AVX-512 VNNI"
    if "avx_vnni" in flags:
        return "AVX-VNNI"
    return "AVX2, no VNNI" if "avx2" in flags else "no AVX2"


def cpu_isa(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """:func:`isa_from_flags` of this CPU; without ``/proc/cpuinfo`` (not Linux), torch's dispatch level
    (``torch.backends.cpu.get_cpu_capability()``: ``"AVX512"``, ``"AVX2"``...), which does not tell VNNI."""
    path = Path(cpuinfo)
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.startswith("flags"):
                return isa_from_flags(line.partition(":")[2].split())
    return f"{torch.backends.cpu.get_cpu_capability()} (VNNI unknown)"


@dataclass(frozen=True)
class LayerChoice:
    """The measurement and the decision for one candidate layer."""

    name: str
    """Node name (the same in the float, prepared and converted graphs)."""
    target: str
    """Module path, e.g. ``bottom.0``."""
    op: str
    """The float module's type, e.g. ``LinearReLU`` (fused by ``prepare``) or ``Conv2d``."""
    input_shape: tuple[int, ...]
    """Shape of the input it was measured on (the first calibration batch's)."""
    predicted_us: float
    """The cost model's fp32 estimate, µs per call."""
    fp32_us: float | None
    """Measured fp32 time, µs per call; None when not measured (negligible)."""
    int8_us: float | None
    """Measured int8 time on an int8 input (the kernel alone), µs per call."""
    boundary_us: float | None
    """Measured ``quantize_per_tensor`` of the input + ``dequantize`` of the output, µs per call."""
    chosen: bool
    """Whether the selected module runs this layer in int8."""
    reason: str
    """Why, in words."""

    @property
    def speedup(self) -> float | None:
        """fp32 time / int8 time (> 1: int8 is faster); None when not measured."""
        return None if self.fp32_us is None or not self.int8_us else self.fp32_us / self.int8_us


@dataclass(frozen=True)
class SelectionReport:
    """What :class:`SelectInt8` measured and chose; ``str()`` gives a table (layers by module path)."""

    isa: str
    """The int8 instructions seen (:func:`cpu_isa`), e.g. ``"AVX2, no VNNI"``."""
    threads: int
    """``torch.get_num_threads()`` during the measurements."""
    layers: tuple[LayerChoice, ...]
    """Every candidate layer, in graph order."""
    fp32_us: float
    """Whole module in fp32, µs per call on the first calibration batch."""
    all_int8_us: float
    """Whole module with every candidate in int8 (plain static PTQ), µs per call."""
    int8_us: float | None
    """Whole module as selected, µs per call; None when no int8 selection was built."""
    kept_fp32: bool
    """True when the selected module is the fp32 one (nothing pays)."""
    reason: str
    """The outcome in words, e.g. ``"kept fp32: no layer is faster in int8 on this CPU (AVX2, no VNNI)"``."""
    tries: tuple[tuple[tuple[str, ...], float], ...] = ()
    """Each selection measured: (node names in int8, whole-module µs)."""

    @property
    def speedup(self) -> float:
        """fp32 / chosen module's time: 1.0 when fp32 was kept, else > 1."""
        return 1.0 if self.kept_fp32 or not self.int8_us else self.fp32_us / self.int8_us

    @property
    def all_int8_speedup(self) -> float:
        """fp32 / every-layer-int8 time (what plain static PTQ would give here)."""
        return self.fp32_us / self.all_int8_us

    @property
    def chosen(self) -> list[str]:
        """Node names of the layers run in int8."""
        return [layer.name for layer in self.layers if layer.chosen]

    def as_dict(self) -> dict[str, Any]:
        """Plain types for JSON: every field, ``layers`` as a list of dicts (with ``speedup``)."""
        out = asdict(self)
        out["layers"] = [{**asdict(layer), "input_shape": list(layer.input_shape), "speedup": layer.speedup}
                         for layer in self.layers]
        out.update(speedup=self.speedup, all_int8_speedup=self.all_int8_speedup)
        return out

    def __str__(self) -> str:
        """The table, layers named by module path (``LayerChoice.target``, as in the model's ``named_modules``)."""
        width = max([len(layer.target) for layer in self.layers] + [5])
        lines = [f"int8 layer selection on this CPU ({self.isa}, {self.threads} thread(s)), µs per call:",
                 f"{'layer':<{width}}  {'op':<12} {'input':<14} {'pred':>8} {'fp32':>8} {'int8':>8} {'q/dq':>7} "
                 f"{'speed-up':>8}  chosen"]
        for layer in self.layers:
            lines.append(
                f"{layer.target:<{width}}  {layer.op:<12} {str(layer.input_shape):<14} {layer.predicted_us:8.1f} "
                f"{_us(layer.fp32_us):>8} {_us(layer.int8_us):>8} {_us(layer.boundary_us):>7} "
                f"{_ratio(layer.speedup):>8}  {'yes' if layer.chosen else 'no'}: {layer.reason}")
        whole = f"whole module: fp32 {self.fp32_us:.1f} µs, every layer int8 {self.all_int8_us:.1f} µs " \
                f"({self.all_int8_speedup:.2f}x)"
        path = {layer.name: layer.target for layer in self.layers}
        for names, us in self.tries:
            whole += f", int8 [{', '.join(path[n] for n in names)}] {us:.1f} µs ({self.fp32_us / us:.2f}x)"
        return "\n".join([*lines, whole, self.reason])


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


class _CaptureInputs(Interpreter):
    """Runs a prepared module with its observers bypassed (their statistics stay as calibrated) and keeps
    the first argument of the named nodes."""

    def __init__(self, module: Any, names: set[str]) -> None:
        super().__init__(module)
        self.names, self.inputs = names, dict[str, Any]()

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if isinstance(self.module.get_submodule(target), ObserverBase):
            return args[0]
        return super().call_module(target, args, kwargs)

    def run_node(self, n: Any) -> Any:
        if n.name in self.names:
            self.inputs[n.name] = self.fetch_args_kwargs_from_env(n)[0][0]
        return super().run_node(n)


@dataclass(eq=False)
class _Candidate:
    node: Any
    float_module: torch.nn.Module
    int8_module: torch.nn.Module
    observer: Any
    predicted_s: float
    x: torch.Tensor | None = None
    times: dict[str, float] = field(default_factory=dict)


def _as_args(batch: Any) -> tuple[Any, ...]:
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


@dataclass(frozen=True)
class SelectInt8(PassBase):
    """Quantize (FBGEMM static int8) only the layers measured faster in int8; see the module docstring.

    Returns: ``PassResult(gm', modified)``: ``gm'`` is the converted selection, or ``gm`` unchanged with
    ``modified=False`` when fp32 is kept. ``gm'.meta["quant_selection"]`` is the :class:`SelectionReport`.

    Raises:
        QuantizationError: ``calibration`` is empty, or the module is in training mode (from ``prepare``).
        ValueError: ``min_share`` is not in [0, 1), or ``rounds`` < 1.
    """

    name: ClassVar[str] = "select-int8"
    calibration: tuple[Any, ...]
    """Calibration batches (each a tuple of positional inputs, or one tensor); the first is also the input
    every timing runs on."""
    timer: Timer | None = None
    """Measures one callable (:data:`Timer`); None: :func:`best_time` with ``repeats``."""
    repeats: int = 5
    """Timing blocks per measurement of the default timer."""
    rounds: int = 3
    """Each comparison (a layer's fp32 / int8 / q/dq, the module's fp32 / int8) is timed in this many
    alternating rounds and each variant's best is kept, so a burst of load hits every variant, not one."""
    min_share: float = 0.01
    """Candidates predicted to take less than this share of all candidates' fp32 time are not measured."""
    profile: Any = None
    """The cost model's ``HardwareProfile`` (or a name in ``PROFILES``); None: this CPU, measured once."""
    qconfig_mapping: Any = None
    """torch.ao ``QConfigMapping`` for ``prepare``; None: its default for ``backend``."""
    backend: str = "fbgemm"
    """``"fbgemm"`` or ``"x86"``."""

    def __post_init__(self) -> None:
        if not self.calibration:
            raise QuantizationError("SelectInt8: calibration is empty; pass batches of positional inputs")
        if not 0 <= self.min_share < 1:
            raise ValueError(f"SelectInt8: min_share must be in [0, 1), got {self.min_share}")
        if self.rounds < 1:
            raise ValueError(f"SelectInt8: rounds must be >= 1, got {self.rounds}")

    def call(self, gm: Any) -> PassResult:
        with torch.no_grad():
            selected, report = self.select(gm)
        selected.meta["quant_selection"] = report
        return PassResult(selected, not report.kept_fp32)

    def select(self, gm: Any) -> tuple[Any, SelectionReport]:
        """Steps 1-4 without the pass manager: ``(selected module, report)``; ``gm`` is not mutated."""
        timer = self.timer or best_time(self.repeats)
        inputs = _as_args(self.calibration[0])
        prepared, full = self._convert(gm, ())
        candidates = self._candidates(gm, prepared, full, inputs)
        total_s = sum(c.predicted_s for c in candidates) or 1.0
        measured = [c for c in candidates if c.predicted_s >= self.min_share * total_s]
        for c in sorted(measured, key=lambda c: -c.predicted_s):
            _measure_layer(timer, c, self.rounds)
        fp32_run = lambda: gm(*inputs)  # noqa: E731
        whole = _interleaved(timer, MODULE, {"fp32": fp32_run, "int8": lambda: full(*inputs)}, self.rounds)
        fp32_s, all_int8_s = whole["fp32"], whole["int8"]
        faster = [c for c in measured if c.times["int8"] < c.times["fp32"]]
        paying = [c for c in faster if c.times["int8"] + c.times["q/dq"] < c.times["fp32"]]
        tries: list[tuple[tuple[str, ...], float]] = []
        for subset in (faster, paying):
            names = tuple(c.node.name for c in subset)
            if not subset or any(names == t[0] for t in tries):
                continue
            module = self._convert(gm, _exclusions(prepared, set(names)))[1]
            variant = "int8:" + "+".join(names)
            runs = {variant: lambda: module(*inputs), "fp32": fp32_run}  # noqa: B023 (timed in this iteration only)
            times = _interleaved(timer, MODULE, runs, self.rounds)
            fp32_s = min(fp32_s, times["fp32"])  # the best fp32 seen: any doubt favours fp32
            tries.append((names, times[variant]))
            if tries[-1][1] < fp32_s:
                report = self._report(candidates, measured, set(names), fp32_s, all_int8_s, tries)
                return module, report
        report = self._report(candidates, measured, set(), fp32_s, all_int8_s, tries)
        return gm, report

    def _convert(self, gm: Any, exclude: Sequence[str]) -> tuple[Any, Any]:
        """Step 1 (and step 4's subsets): prepare with ``exclude`` kept float, calibrate, convert."""
        prepared = prepare(gm, self.qconfig_mapping, _as_args(self.calibration[0]), exclude_names=exclude,
                           backend=self.backend)
        calibrate(prepared, [_as_args(b) for b in self.calibration], progress=False)
        return prepared, convert(prepared)

    def _candidates(self, gm: Any, prepared: Any, full: Any, inputs: tuple[Any, ...]) -> list[_Candidate]:
        """Step 2: the lowered ``call_module`` nodes, their captured inputs and predicted fp32 times."""
        from fxdist.passes.cost_model import measure_cpu_profile

        predicted = _predicted_seconds(gm, inputs, self.profile or measure_cpu_profile())
        lowered = tuple(QUANTIZED_MODULES.values())
        candidates = []
        for node in prepared.graph.nodes:
            if node.op != "call_module" or node.meta.get("quant", {}).get("kind") != "compute":
                continue
            source: Any = node.args[0] if node.args else None
            observer = prepared.get_submodule(source.target) if getattr(source, "op", "") == "call_module" else None
            int8_module = full.get_submodule(node.target)
            if isinstance(observer, ObserverBase) and isinstance(int8_module, lowered):
                candidates.append(_Candidate(node, prepared.get_submodule(node.target), int8_module, observer,
                                             predicted.get(node.name, 0.0)))
        capture = _CaptureInputs(prepared, {c.node.name for c in candidates})
        capture.run(*inputs)
        for c in candidates:
            c.x = capture.inputs[c.node.name]
        return candidates

    def _report(self, candidates: list[_Candidate], measured: list[_Candidate], chosen: set[str], fp32_s: float,
                all_int8_s: float, tries: list[tuple[tuple[str, ...], float]]) -> SelectionReport:
        isa = cpu_isa()
        layers = tuple(_choice(c, c in measured, c.node.name in chosen, self.min_share) for c in candidates)
        tries_us = tuple((names, s * 1e6) for names, s in tries)
        if chosen:
            int8_s = next(s for names, s in tries if set(names) == chosen)
            reason = f"int8 for {len(chosen)} of {len(candidates)} layers: {fp32_s / int8_s:.2f}x the fp32 module"
            return SelectionReport(isa, torch.get_num_threads(), layers, fp32_s * 1e6, all_int8_s * 1e6,
                                   int8_s * 1e6, False, reason, tries_us)
        if not tries:
            reason = f"kept fp32: no layer is faster in int8 on this CPU ({isa})"
        else:
            paths = ", ".join(str(c.node.target) for c in candidates if c.node.name in tries[0][0])
            reason = (f"kept fp32: the layers faster in int8 alone ({paths}) do not make the "
                      f"whole module faster (quantize/dequantize boundaries): best {min(s for _, s in tries) * 1e6:.1f}"
                      f" µs vs {fp32_s * 1e6:.1f} µs fp32")
        return SelectionReport(isa, torch.get_num_threads(), layers, fp32_s * 1e6, all_int8_s * 1e6, None, True,
                               reason, tries_us)


@contextlib.contextmanager
def _mha_fastpath_disabled() -> Iterator[None]:
    """``torch.backends.mha.set_fastpath_enabled(False)`` inside: ``nn.TransformerEncoder`` /
    ``nn.MultiheadAttention`` in eval mode under ``no_grad`` then run their plain ops instead of the fused
    ``torch._transformer_encoder_layer_fwd`` and the nested tensors of ``src_key_padding_mask``
    (``torch._nested_tensor_from_mask``), which FakeTensor cannot describe ("NestedTensorImpl doesn't support
    sizes"). The outputs' shapes are the same; the setting is restored on exit."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def _predicted_seconds(gm: Any, inputs: tuple[Any, ...], profile: Any) -> dict[str, float]:
    """Step 2's cost model: node name -> predicted fp32 seconds (:func:`fxdist.passes.cost_model.estimate` on a
    copy of ``gm``), with the attention fast path off (:func:`_mha_fastpath_disabled`). When ShapeProp under
    FakeTensor fails on an op (a fake kernel missing or refused), the shapes are propagated on the real
    ``inputs`` instead (one real forward of the copy); an error there is the model's and propagates."""
    from fxdist.passes.cost_model import estimate
    from fxdist.passes.shape_prop import ShapeProp

    with _mha_fastpath_disabled():
        try:
            costs = estimate(copy.deepcopy(gm), *inputs, profile=profile)
        except Exception:  # noqa: BLE001 - FakeTensor's refusals have no common type; real tensors decide
            real = copy.deepcopy(gm)
            with torch.no_grad():
                ShapeProp(real).propagate(*inputs)
            costs = estimate(real, profile=profile)
    return {n.name: n.seconds for n in costs.nodes}


def _interleaved(timer: Timer, subject: str, runs: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Best seconds per call of each run, timed in ``rounds`` alternating rounds."""
    best = dict.fromkeys(runs, math.inf)
    for _ in range(rounds):
        for variant, run in runs.items():
            best[variant] = min(best[variant], timer(subject, variant, run))
    return best


def _measure_layer(timer: Timer, c: _Candidate, rounds: int) -> None:
    """Step 3: fp32, int8 (kernel on an int8 input) and boundary times of one candidate, in seconds."""
    scale, zero_point = c.observer.calculate_qparams()
    scale, zero_point, dtype = float(scale), int(zero_point), c.observer.dtype
    x = cast(torch.Tensor, c.x)  # captured in step 2
    xq = torch.quantize_per_tensor(x, scale, zero_point, dtype)
    yq = c.int8_module(xq)
    c.times = _interleaved(timer, c.node.name, {
        "fp32": lambda: c.float_module(x),
        "int8": lambda: c.int8_module(xq),
        "q/dq": lambda: (torch.quantize_per_tensor(x, scale, zero_point, dtype), yq.dequantize()),
    }, rounds)


def _choice(c: _Candidate, measured: bool, chosen: bool, min_share: float) -> LayerChoice:
    t = {k: v * 1e6 for k, v in c.times.items()}
    if not measured:
        reason = f"not measured: predicted under {min_share:.0%} of the candidates' fp32 time"
    elif chosen:
        reason = "faster in int8"
    elif t["int8"] >= t["fp32"]:
        reason = "slower in int8"
    else:
        reason = "faster alone, but the module with it in int8 is not faster"
    shape = tuple(cast(torch.Tensor, c.x).shape)  # captured in step 2
    return LayerChoice(c.node.name, str(c.node.target), type(c.float_module).__name__, shape,
                       c.predicted_s * 1e6, t.get("fp32"), t.get("int8"), t.get("q/dq"), chosen, reason)


def _exclusions(prepared: Any, chosen: set[str]) -> list[str]:
    """Step 4's ``exclude_names``: every candidate module not chosen, and every function op static PTQ would
    quantize one of whose inputs would not arrive in int8 (walks the prepared graph in order)."""
    int8_values: set[Any] = set()
    exclude: list[str] = []
    for node in prepared.graph.nodes:
        kind = node.meta.get("quant", {}).get("kind")
        inputs = _tensor_inputs(node)
        if kind == "compute":
            if node.op == "call_module":
                keep = node.name in chosen
            else:
                keep = bool(inputs) and all(a in int8_values for a in inputs)
            if keep:
                int8_values.add(node)
            else:
                exclude.append(str(node.target) if node.op == "call_module" else node.name)
        elif kind in ("same_scale", "observer") and inputs and inputs[0] in int8_values:
            int8_values.add(node)
    return exclude


def select_int8(model: Any, calibration: Sequence[Any], **options: Any) -> tuple[Any, SelectionReport]:
    """Run :class:`SelectInt8` through ``PassManager`` (lint, provenance) on a copy of ``model``.

    Args:
        model: an fxdist ``GraphModule`` or an ``nn.Module`` (traced with ``fxdist.symbolic_trace``), eval mode.
        calibration: batches, as for :func:`quant.calibrate`; the first is the timing input.
        options: the other fields of :class:`SelectInt8` (``timer``, ``repeats``, ``min_share``...).

    Returns:
        ``(module, report)``: the selected int8 module, or a float copy when nothing pays; the report.
    """
    gm = model if isinstance(model, fx.GraphModule) else fx.symbolic_trace(model)
    result = PassManager([SelectInt8(tuple(calibration), **options)]).run(gm)
    return result.graph_module, result.graph_module.meta["quant_selection"]
