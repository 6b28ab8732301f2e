"""``calibrate`` and ``convert``: run data through the observers, then lower to FBGEMM quantized kernels.

``convert`` steps:
 1. Copy the prepared module.
 2. Replace each observer with ``quantize_per_tensor(x, scale, zero_point, dtype) -> .dequantize()`` using the
    observer's ``calculate_qparams()`` (the "reference" program: still float, with quantization error).
 3. Apply :data:`quant.rules.RULES` until none fires: dequantize sinks through same-scale ops, ``dq -> op -> q``
    becomes a quantized module (``torch.ao.nn.quantized``, ``torch.ao.nn.intrinsic.quantized``) or a quantized
    op (``torch.ops.quantized.add/add_relu/mul/cat``), and redundant ``dq -> q`` pairs disappear.
 4. Drop observers' submodules, lint, recompile.

DeepRecommender's first layers after ``convert`` (SELU has no quantized kernel, so it stays in float)::

    quantize_per_tensor = torch.quantize_per_tensor(x, 0.0394, 0, torch.quint8);  x = None
    encoder_0 = self._modules['encoder']._modules['0'](quantize_per_tensor);  quantize_per_tensor = None
    dequantize_1 = encoder_0.dequantize();  encoder_0 = None
    act = self._modules['act'](dequantize_1);  dequantize_1 = None
    quantize_per_tensor_2 = torch.quantize_per_tensor(act, 0.1440, 12, torch.quint8);  act = None
    encoder_1 = self._modules['encoder']._modules['1'](quantize_per_tensor_2);  quantize_per_tensor_2 = None

(``encoder.0`` is now a ``torch.ao.nn.quantized.Linear``; node names survive lowering.)

Source: torch.fx paper §6.2.1; torch/ao/quantization/fx/convert.py (reference representation and lowering).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch.ao.quantization.observer import ObserverBase

from quant.errors import QuantizationError, describe_node
from quant.rules import RULES

__all__ = ["calibrate", "convert"]


def calibrate(prepared: Any, batches: Iterable[Any], *, progress: bool = True, desc: str = "calibrate") -> Any:
    """Run each batch through ``prepared`` (under ``torch.no_grad``) so its observers see the value ranges.

    Args:
        prepared: the module returned by :func:`quant.prepare`.
        batches: an iterable of inputs; a tuple/list is splatted as positional arguments.
        progress: show a tqdm progress bar (on stderr).

    Returns:
        ``prepared`` itself, calibrated.

    Raises:
        QuantizationError: ``batches`` was empty (the observers would give meaningless scales).
    """
    from tqdm.auto import tqdm

    seen = 0
    with torch.no_grad():
        for batch in tqdm(batches, desc=desc, disable=not progress, leave=False):
            prepared(*batch) if isinstance(batch, (tuple, list)) else prepared(batch)
            seen += 1
    if seen == 0:
        raise QuantizationError("calibrate: no batches were given; the observers have seen no data")
    return prepared


def _observer_to_reference(gm: Any, node: Any) -> None:
    """Step 2 for one observer node."""
    obs = gm.get_submodule(node.target)
    if getattr(obs, "min_val", torch.tensor([])).numel() == 0 or torch.isinf(obs.min_val).any():
        raise QuantizationError(
            f"convert: observer {node.target!r} of {describe_node(node.args[0])} has seen no data; "
            "run quant.calibrate(prepared, batches) before convert"
        )
    scale, zero_point = obs.calculate_qparams()
    if scale.numel() != 1:
        raise QuantizationError(f"convert: activation observer {node.target!r} must be per-tensor, got {obs}")
    graph = gm.graph
    with graph.inserting_before(node):
        q = graph.call_function(
            torch.quantize_per_tensor, (node.args[0], float(scale), int(zero_point), obs.dtype)
        )
        dq = graph.call_method("dequantize", (q,))
    q.meta.update(quant_observer=obs, quant_qconfig=node.meta["quant"]["qconfig"], quant_float_tensor=False)
    dq.meta["quant_float_tensor"] = True
    node.replace_all_uses_with(dq)
    graph.erase_node(node)


def convert(prepared: Any) -> Any:
    """Return a quantized copy of a calibrated module from :func:`quant.prepare`.

    Returns:
        A GraphModule whose compute ops are FBGEMM quantized modules/ops, with ``quantize_per_tensor`` where float
        values enter the int8 region and ``dequantize`` where they leave it (graph outputs are float).

    Raises:
        QuantizationError: ``prepared`` did not come from ``prepare``, or an observer saw no data.
        (A prepared module in which everything was excluded converts to an unchanged float copy.)
    """
    gm = copy.deepcopy(prepared)
    observers = [
        n for n in gm.graph.nodes
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), ObserverBase)
    ]
    if not any("quant" in n.meta for n in gm.graph.nodes):
        raise QuantizationError("convert: the module has no observers; pass the result of quant.prepare")
    for node in observers:
        _observer_to_reference(gm, node)
    for name in {n.target for n in observers}:
        delattr(gm, name)
    _apply_rules(gm)
    gm.graph.lint()
    gm.recompile()
    return gm


def _apply_rules(gm: Any, max_rounds: int = 100) -> None:
    """Step 3: apply every rule to every node until a full round changes nothing."""
    for _ in range(max_rounds):
        changed = False
        for node in list(gm.graph.nodes):
            if getattr(node, "_erased", False) or node.graph is not gm.graph:
                continue
            for rule in RULES:
                if rule.rewrite(gm, node):
                    changed = True
                    break
        if not changed:
            return
    raise QuantizationError(f"convert: rewrite rules did not settle after {max_rounds} rounds (a rule cycles)")
