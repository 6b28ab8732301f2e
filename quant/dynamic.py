"""Dynamic quantization (Linear, LSTM) and 8-bit row-wise embedding bags, as a pass over fxdist graphs.

Dynamic quantization stores int8 weights and quantizes activations on the fly with per-batch ranges, so it needs
no calibration; it suits recommendation and sequence models whose time goes to large Linear/LSTM weights.
Embedding tables are quantized row-wise to uint8 with a float scale and offset per row
(``float_qparams_weight_only_qconfig``): FBGEMM's ``embedding_bag_byte_rowwise_offsets`` reads them directly,
cutting table memory about 4x.

Each swap is one ``# before -> after`` rule on a ``call_module`` node (the graph's structure is unchanged)::

    nn.Linear(x)            -> nnqd.Linear(x)            # int8 weight (per-channel), float in/out
    nn.LSTM(x, hc)          -> nnqd.LSTM(x, hc)          # int8 weights, float in/out
    nn.EmbeddingBag(i, o)   -> nnq.EmbeddingBag(i, o)    # uint8 rows + float (scale, offset) per row
    nn.Embedding(i)         -> nnq.Embedding(i)

Source: torch.fx paper §6.2.1 (DeepRecommender); torch/ao/quantization/quantize.py (quantize_dynamic mappings).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch.ao.nn.quantized as nnq
import torch.ao.nn.quantized.dynamic as nnqd
from torch import nn
from torch.ao.quantization import (
    default_dynamic_qconfig,
    float_qparams_weight_only_qconfig,
    per_channel_dynamic_qconfig,
)

import fxdist as fx
from fxdist.passes.pass_base import PassBase, PassManager, PassResult

__all__ = ["QuantizeDynamic", "quantize_dynamic", "DYNAMIC_MODULES"]

DYNAMIC_MODULES: dict[type[nn.Module], tuple[Any, Any]] = {  # (quantized class with .from_float, qconfig)
    nn.Linear: (nnqd.Linear, per_channel_dynamic_qconfig),
    nn.LSTM: (nnqd.LSTM, default_dynamic_qconfig),
    nn.GRU: (nnqd.GRU, default_dynamic_qconfig),
    nn.EmbeddingBag: (nnq.EmbeddingBag, float_qparams_weight_only_qconfig),
    nn.Embedding: (nnq.Embedding, float_qparams_weight_only_qconfig),
}
"""Float module -> (quantized module, qconfig passed to its ``from_float``)."""


@dataclass(frozen=True)
class QuantizeDynamic(PassBase):
    """Swap each ``call_module`` of a type in ``types`` for its dynamic/weight-only quantized twin.

    A module called from several nodes is swapped once (all call sites share it, as before).
    Returns: ``PassResult(gm, modified)``; ``modified`` is False when nothing matched.
    """

    name: ClassVar[str] = "quantize-dynamic"
    types: tuple[type, ...] = (nn.Linear, nn.LSTM, nn.EmbeddingBag, nn.Embedding)
    """Module types to quantize (keys of :data:`DYNAMIC_MODULES`)."""
    exclude_names: tuple[str, ...] = field(default=())
    """Module names (and their children) kept in float."""

    def __post_init__(self) -> None:
        unknown = [t for t in self.types if t not in DYNAMIC_MODULES]
        if unknown:
            raise ValueError(
                f"quantize_dynamic: no dynamic quantized module for {unknown}; supported: "
                f"{[t.__name__ for t in DYNAMIC_MODULES]}"
            )

    def call(self, gm: Any) -> PassResult:
        done: set[str] = set()
        for node in gm.graph.nodes:
            if node.op != "call_module" or node.target in done:
                continue
            target = str(node.target)
            if any(target == n or target.startswith(n + ".") for n in self.exclude_names):
                continue
            mod = gm.get_submodule(target)
            if type(mod) not in self.types:
                continue
            qtype, qconfig = DYNAMIC_MODULES[type(mod)]
            observed = copy.deepcopy(mod)
            observed.qconfig = qconfig
            prefix, _, leaf = target.rpartition(".")
            setattr(gm.get_submodule(prefix) if prefix else gm, leaf, qtype.from_float(observed))
            node.meta["quant"] = {"kind": "dynamic", "qconfig": qconfig}
            done.add(target)
        return PassResult(gm, bool(done))


def quantize_dynamic(
    model: nn.Module, types: Iterable[type] = (nn.Linear, nn.LSTM, nn.EmbeddingBag, nn.Embedding),
    *, exclude_names: Iterable[str] = (),
) -> Any:
    """Return a copy of ``model`` (traced with ``fxdist.symbolic_trace`` if not a GraphModule) with dynamic int8
    Linear/LSTM/GRU and 8-bit row-wise Embedding/EmbeddingBag modules.

    Raises:
        ValueError: a type in ``types`` has no dynamic quantized counterpart.
    """
    gm = model if isinstance(model, fx.GraphModule) else fx.symbolic_trace(model)
    qpass = QuantizeDynamic(tuple(types), tuple(exclude_names))
    return PassManager([qpass]).run(gm).graph_module
