"""FBGEMM post-training quantization and conv-bn fusion as passes over fxdist graphs.

Entry points (each returns a new GraphModule; the argument is never mutated):

* :func:`fuse` -- fold eval-mode BatchNorm into Conv/ConvTranspose/Linear (torch.fx paper §6.2.2); with
  ``patterns=True`` also Conv/Linear + ReLU into ``torch.ao.nn.intrinsic`` modules.
* :func:`prepare` -> :func:`calibrate` -> :func:`convert` -- static int8 PTQ on FBGEMM (§6.2.1).
* :func:`quantize_dynamic` -- dynamic int8 Linear/LSTM and 8-bit row-wise embedding bags.
* :func:`sqnr_report` -- per-layer quantization error.
* :func:`select_int8` (pass :class:`SelectInt8`) -- static int8 for only the layers measured faster on this CPU
  (keeps fp32 where int8 does not pay, e.g. on AVX2 without VNNI); :class:`SelectionReport` says why.

torch.ao's observers, qconfigs and quantized modules are the building blocks; the graph work is ours.
"""

from __future__ import annotations

from typing import Any

from quant.convert import calibrate, convert
from quant.dynamic import QuantizeDynamic, quantize_dynamic
from quant.errors import FusionError, QuantizationError
from quant.fuse_conv_bn import FuseConvBn
from quant.fuse_onednn import FuseConvPointwise, OneDNNConv2d
from quant.fuse_patterns import FuseReluPatterns
from quant.prepare import prepare
from quant.report import LayerError, format_report, sqnr_report
from quant.select import LayerChoice, SelectInt8, SelectionReport, cpu_isa, select_int8

__all__ = [
    "fuse", "prepare", "calibrate", "convert", "quantize_dynamic", "sqnr_report", "format_report", "LayerError",
    "select_int8", "SelectInt8", "SelectionReport", "LayerChoice", "cpu_isa",
    "FuseConvBn", "FuseReluPatterns", "FuseConvPointwise", "OneDNNConv2d", "QuantizeDynamic", "FusionError", "QuantizationError",
]


def fuse(gm: Any, *, patterns: bool = False, strict: bool = True, onednn_inputs: Any = None) -> Any:
    """Return a copy of ``gm`` with every eval-mode BatchNorm folded into the Conv/Linear before it.

    Args:
        gm: an fxdist ``GraphModule`` (a plain ``nn.Module`` is traced with ``fxdist.symbolic_trace``).
        patterns: also fuse Conv/Linear + ReLU into ``torch.ao.nn.intrinsic`` modules (for quantization).
        strict: raise on a BatchNorm that cannot be folded; ``False`` skips it with a warning.
        onednn_inputs: example inputs (a tuple); if given, also fuse Conv2d + add + ReLU into oneDNN kernels
            with prepacked weights (:class:`~quant.fuse_onednn.FuseConvPointwise`; inference only).

    Returns:
        The fused GraphModule; ``meta["fxdist"]["passes"]`` records what each pass did.

    Raises:
        FusionError: (strict) a module is in training mode or a conv output has other users.

    Source: torch.fx paper §6.2.2; torch/fx/experimental/optimization.py (fuse).
    """
    import fxdist as fx
    from fxdist.passes.pass_base import PassManager

    if not isinstance(gm, fx.GraphModule):
        gm = fx.symbolic_trace(gm)
    passes: list[Any] = [FuseConvBn(strict=strict)]
    if patterns:
        passes.append(FuseReluPatterns())
    if onednn_inputs is not None:
        passes.append(FuseConvPointwise(tuple(onednn_inputs)))
    return PassManager(passes).run(gm).graph_module
