"""Per-layer quantization error (SQNR), to find the layers that hurt accuracy.

``SQNR = 10 * log10(sum(x_float ** 2) / sum((x_float - x_int8) ** 2))`` in dB, per layer output, where
``x_float`` is the layer's output in the float (prepared) model and ``x_int8`` the dequantized output of the same
node in the converted model, on the same inputs. Higher is better; 8-bit quantization of one layer gives roughly
35-45 dB, and every layer adds its own error to its inputs'. The report also measures each layer's inputs as the int8 model
feeds them; relative noise powers add, so ``own_sqnr_db`` isolates the error the layer adds itself. The layers with
the lowest ``own_sqnr_db`` are the ones to exclude (``quant.prepare(..., exclude_names=[...])``).

Nodes are matched by name: ``convert`` keeps the name of every node it lowers.

Source: torch.ao.ns (numeric suite) ``compute_sqnr``; torch.fx paper §5 (Interpreter-based analyses).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fxdist.interpreter import Interpreter

__all__ = ["LayerError", "sqnr", "sqnr_report", "format_report"]


@dataclass(frozen=True)
class LayerError:
    """Quantization error of one layer's output."""

    name: str
    """Node name (the same in the prepared and the converted graph)."""
    op: str
    """What the layer is, e.g. ``Linear`` or ``add_relu``."""
    sqnr_db: float
    """SQNR of this layer's output against float, in dB (inf if identical)."""
    input_sqnr_db: float
    """Worst SQNR among the layer's float-tensor inputs, as the int8 model feeds them (inf: exact or none)."""

    @property
    def own_sqnr_db(self) -> float:
        """SQNR of the noise this layer adds itself, in dB (inf: it adds none).

        Relative noise powers add (``10**(-dB/10)``), so the layer's own share is
        ``-10 log10(10**(-sqnr_db/10) - 10**(-input_sqnr_db/10))``.
        """
        own = 10 ** (-self.sqnr_db / 10) - 10 ** (-self.input_sqnr_db / 10)
        return math.inf if own <= 0 else -10 * math.log10(own)


def sqnr(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB; ``inf`` when the tensors are equal. Shapes must match.

    Raises:
        ValueError: the shapes of ``reference`` and ``approx`` differ.
    """
    if reference.shape != approx.shape:
        raise ValueError(f"sqnr: shapes differ, {tuple(reference.shape)} vs {tuple(approx.shape)}")
    ref = reference.detach().double()
    noise = (ref - approx.detach().double()).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(max(signal, 1e-300) / noise)


def _float_tensors(values: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out += _float_tensors(v)
        elif isinstance(v, torch.Tensor) and (v.is_quantized or v.is_floating_point()):
            out.append(v.dequantize() if v.is_quantized else v.detach().clone())
    return out


class _Capture(Interpreter):
    """Runs a module and keeps the inputs and output of the named nodes (dequantized)."""

    def __init__(self, module: Any, names: set[str]) -> None:
        super().__init__(module)
        self.names = names
        self.inputs: dict[str, list[torch.Tensor]] = {}
        self.outputs: dict[str, torch.Tensor] = {}

    def run_node(self, n: Any) -> Any:
        if n.name in self.names:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            self.inputs[n.name] = _float_tensors([*args, *kwargs.values()])
        value = super().run_node(n)
        if n.name in self.names and isinstance(value, torch.Tensor):
            self.outputs[n.name] = value.dequantize() if value.is_quantized else value.detach().clone()
        return value


def _describe(gm: Any, node: Any) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__
    return getattr(node.target, "__name__", str(node.target))


def sqnr_report(prepared: Any, quantized: Any, inputs: Sequence[Any]) -> list[LayerError]:
    """SQNR of every quantized layer's output (and of its inputs), in graph order.

    Args:
        prepared: the (calibrated) module from ``quant.prepare``; its observers pass values through unchanged.
        quantized: ``quant.convert(prepared)`` (or ``quantize_dynamic`` of the same graph).
        inputs: positional inputs of one batch.

    Returns:
        One :class:`LayerError` per node marked quantizable in ``prepared`` that exists in both graphs.
    """
    kinds = ("compute", "weight_only", "dynamic")
    layers = [n for n in prepared.graph.nodes if n.meta.get("quant", {}).get("kind") in kinds]
    names = {n.name for n in layers} & {n.name for n in quantized.graph.nodes}
    with torch.no_grad():
        ref, out = _Capture(prepared, names), _Capture(quantized, names)
        ref.run(*inputs)
        out.run(*inputs)
    report = []
    for node in layers:
        if node.name not in ref.outputs or node.name not in out.outputs:
            continue
        pairs = zip(ref.inputs[node.name], out.inputs[node.name])
        input_db = min((sqnr(a, b) for a, b in pairs if a.shape == b.shape), default=math.inf)
        value = sqnr(ref.outputs[node.name], out.outputs[node.name])
        report.append(LayerError(node.name, _describe(prepared, node), value, input_db))
    return report


def format_report(errors: Sequence[LayerError], *, worst_first: bool = False) -> str:
    """A text table ``layer | op | in dB | out dB | own dB``; ``worst_first`` sorts by lowest ``own_sqnr_db``."""
    rows = sorted(errors, key=lambda e: e.own_sqnr_db) if worst_first else list(errors)
    width = max([len(e.name) for e in rows] + [5])
    lines = [f"{'layer':<{width}}  {'op':<18}  {'in dB':>7}  {'out dB':>7}  {'own dB':>7}"]
    lines += [
        f"{e.name:<{width}}  {e.op:<18}  {e.input_sqnr_db:7.2f}  {e.sqnr_db:7.2f}  {e.own_sqnr_db:7.2f}" for e in rows
    ]
    return "\n".join(lines)
