"""Embedding modules of recommendation models, and the tracer that keeps them whole.

The graph passes above (``scheduling.parameter_servers`` moves these modules' tables; ``quant`` quantizes around
them) need each embedding module as one ``call_module`` node, not traced into its ``F.embedding_bag`` calls
(a torchrec ``EmbeddingBagCollection`` would not even trace: its ``KeyedJaggedTensor`` input is data-dependent).

Source: torch.fx's ``Tracer.is_leaf_module`` (torch/fx/_symbolic_trace.py: which modules become one
``call_module`` node); torchrec's ``EmbeddingBagCollection`` / ``EmbeddingCollection``
(torchrec/modules/embedding_modules.py) and their quantized forms (torchrec/quant/embedding_modules.py).
"""

from __future__ import annotations

from torch import nn

import fxdist

__all__ = ["embedding_kind", "is_embedding_module", "EmbeddingLeafTracer"]


def embedding_kind(m: nn.Module) -> str | None:
    """``"ebc"`` (torchrec EmbeddingBagCollection), ``"ec"`` (torchrec EmbeddingCollection), ``"bag"``
    (nn.EmbeddingBag), ``"embedding"`` (nn.Embedding), or None (quantized collections too: they hold no float
    tables to move)."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    if isinstance(m, EmbeddingBagCollection):
        return "ebc"
    if isinstance(m, EmbeddingCollection):
        return "ec"
    if isinstance(m, nn.EmbeddingBag):
        return "bag"
    if isinstance(m, nn.Embedding):
        return "embedding"
    return None


def is_embedding_module(m: nn.Module) -> bool:
    """Whether ``m`` is an embedding module that must stay a leaf when traced: one of :func:`embedding_kind`'s,
    or torchrec's quantized ``EmbeddingBagCollection`` / ``EmbeddingCollection``."""
    if embedding_kind(m) is not None:
        return True
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC
    from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEC

    return isinstance(m, (QuantEBC, QuantEC))


class EmbeddingLeafTracer(fxdist.Tracer):
    """fxdist's tracer with every embedding module (:func:`is_embedding_module`) as a leaf, so each call is one
    ``call_module`` node."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return is_embedding_module(m) or super().is_leaf_module(m, module_qualified_name)
