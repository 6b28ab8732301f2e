"""A DLRM whose embedding tables live on parameter servers, its traceable train step, and Criteo input.

The dense, interaction and over arches are torchrec's (``torchrec.models.dlrm``); the
``EmbeddingBagCollection`` is replaced by :class:`~scheduling.ps.PSEmbeddingBagCollection`.

:class:`PSTrainStep` is one whole training step as a module, so that tracing it gives a graph holding the
fetches, the backward pass, the pushes and the dense optimizer step, which :func:`scheduling.async_rpc`
can schedule::

    d = dense_arch(dense)                 # independent of the fetches: overlaps them after the pass
    parts = [ps_fetch(ps, s, kjt) ...]    # one lookup per server
    cut = split_point(d)                  # backward is split at the dense arch output ...
    loss = bce(over(inter(cut, pool(parts))), labels)
    top = ps_backward(loss)               # ... gradients of the fetched parts (and the top) first,
    [ps_push(ps, s, kjt, part, top) ...]  # pushed to the servers,
    bottom = backward_from(d, cut, top)   # then the dense arch's backward, which overlaps the pushes
    optimizer_step("opt", bottom)

Source: torch.fx paper §6.2.3; torchrec ``DLRM`` (Naumov et al. 2019).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DenseArch, InteractionArch, OverArch

import fxdist
from fxdist.node import has_side_effect

from .ps import ops as _ops
from .ps.ebc import PSEmbeddingBagCollection

__all__ = ["DLRMOnPS", "PSTrainStep", "PSTracer", "trace_train_step", "criteo_tables", "criteo_batches",
           "split_point", "backward_from", "optimizer_step", "register_optimizer"]

CRITEO_DENSE = 13
CRITEO_SPARSE = 26
_OPTIMIZERS: dict[str, torch.optim.Optimizer] = {}


def register_optimizer(name: str, optimizer: torch.optim.Optimizer) -> str:
    """Make ``optimizer`` callable from graphs as ``optimizer_step(name, ...)``; returns ``name``."""
    _OPTIMIZERS[name] = optimizer
    return name


def split_point(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached as a new leaf requiring grad: backward stops here (see :func:`backward_from`)."""
    return x.detach().requires_grad_(True)


@has_side_effect
def backward_from(x: torch.Tensor, cut: torch.Tensor, after: Any = None) -> torch.Tensor:
    """Continue backward below a :func:`split_point`: ``x.backward(cut.grad)``; returns ``cut.grad``."""
    if cut.grad is None:
        raise RuntimeError("backward_from: the split point has no gradient; run the top backward first")
    x.backward(cut.grad)
    return cut.grad


@has_side_effect
def optimizer_step(name: str, after: Any = None) -> None:
    """``step()`` then ``zero_grad()`` of the optimizer registered as ``name``."""
    try:
        opt = _OPTIMIZERS[name]
    except KeyError:
        raise KeyError(f"no optimizer registered as {name!r}; call register_optimizer first") from None
    opt.step()
    opt.zero_grad(set_to_none=True)


fxdist.wrap("split_point")
fxdist.wrap("backward_from")
fxdist.wrap("optimizer_step")


class DLRMOnPS(nn.Module):
    """torchrec's DLRM (dense arch, interaction arch, over arch) over a parameter-server EBC.

    Shapes: dense ``(B, num_dense)`` float, kjt with the client's features (``F`` of them, all of dim
    ``D``), output logits ``(B, 1)``.

    Args:
        client: the :class:`~scheduling.ps.PSClient` name.
        num_dense: dense input features.
        dense_layers: dense arch widths; the last must equal the embedding dim ``D``.
        over_layers: over arch widths; the last is the number of logits (1).

    Raises:
        ValueError: the tables' dims differ or do not match ``dense_layers[-1]``.
    """

    def __init__(self, client: str, num_dense: int = CRITEO_DENSE, dense_layers: Sequence[int] = (64, 16),
                 over_layers: Sequence[int] = (64, 1)) -> None:
        super().__init__()
        self.ebc = PSEmbeddingBagCollection(client)
        dims = {t.embedding_dim for t in self.ebc.client.tables}
        if len(dims) != 1 or dense_layers[-1] not in dims:
            raise ValueError(f"DLRMOnPS: every table needs embedding_dim == dense_layers[-1] "
                             f"({dense_layers[-1]}); got dims {sorted(dims)}")
        self.num_features = len(self.ebc.client.feature_names)
        self.dim = dense_layers[-1]
        self.dense_arch = DenseArch(num_dense, list(dense_layers))
        self.inter_arch = InteractionArch(self.num_features)
        inter_out = self.dim + math.comb(self.num_features + 1, 2)
        self.over_arch = OverArch(inter_out, list(over_layers))

    def top(self, embedded_dense: torch.Tensor, kt: Any) -> torch.Tensor:
        """Interaction + over arch on the dense embedding ``(B, D)`` and the pooled ``KeyedTensor``."""
        sparse = kt.values().reshape(-1, self.num_features, self.dim)
        return self.over_arch(self.inter_arch(embedded_dense, sparse))

    def forward(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        """Logits ``(B, 1)``."""
        embedded_dense = self.dense_arch(dense)
        return self.top(embedded_dense, self.ebc(kjt))


class PSTrainStep(nn.Module):
    """One training step of a :class:`DLRMOnPS`: forward, BCE loss, backward, pushes, dense update.

    ``forward(dense, kjt, labels)`` returns the loss (detached, a scalar). The dense parameters are trained
    by ``optimizer`` (registered under ``optimizer_name``), the embeddings by the servers' optimizer.
    """

    def __init__(self, model: DLRMOnPS, optimizer: torch.optim.Optimizer, optimizer_name: str = "dense") -> None:
        super().__init__()
        self.model = model
        self.optimizer_name = register_optimizer(optimizer_name, optimizer)

    def forward(self, dense: torch.Tensor, kjt: Any, labels: torch.Tensor) -> torch.Tensor:
        """Loss of the step ``()``; embeddings and dense parameters are updated."""
        embedded_dense = self.model.dense_arch(dense)
        parts = self.model.ebc.fetch(kjt)
        cut = split_point(embedded_dense)
        kt = self.model.ebc.pool(kjt, parts)
        logits = self.model.top(cut, kt)
        loss = F.binary_cross_entropy_with_logits(logits.squeeze(-1), labels)
        top_done = _ops.ps_backward(loss)
        self.model.ebc.push(kjt, parts, top_done)
        bottom_done = backward_from(embedded_dense, cut, top_done)
        optimizer_step(self.optimizer_name, bottom_done)
        return top_done


class PSTracer(fxdist.Tracer):
    """fxdist's tracer with torchrec's ``InteractionArch`` as a leaf (it unpacks ``x.shape``)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, InteractionArch) or super().is_leaf_module(m, module_qualified_name)


def trace_train_step(step: nn.Module) -> fxdist.GraphModule:
    """Trace ``step`` (e.g. :class:`PSTrainStep` or :class:`DLRMOnPS`) with :class:`PSTracer`."""
    tracer = PSTracer()
    graph = tracer.trace(step)
    return fxdist.GraphModule(tracer.root, graph, type(step).__name__)


# ---- Criteo ---------------------------------------------------------------------------------------------
def criteo_tables(num_embeddings: int = 1000, dim: int = 16, num_tables: int = CRITEO_SPARSE) -> list[EmbeddingBagConfig]:
    """One table per categorical feature ``C1..C<num_tables>`` (ids hashed modulo ``num_embeddings``)."""
    return [EmbeddingBagConfig(name=f"t_C{i}", embedding_dim=dim, num_embeddings=num_embeddings,
                               feature_names=[f"C{i}"]) for i in range(1, num_tables + 1)]


def _parse_criteo(path: Path, limit: int | None) -> tuple[torch.Tensor, torch.Tensor, list[list[str]]]:
    labels, dense, cats = [], [], []
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and len(labels) >= limit:
                break
            cols = line.rstrip("\n").split("\t")
            if len(cols) != 1 + CRITEO_DENSE + CRITEO_SPARSE:
                raise ValueError(f"{path}:{lineno}: expected {1 + CRITEO_DENSE + CRITEO_SPARSE} tab-separated "
                                 f"columns (label, I1..I13, C1..C26), got {len(cols)}")
            labels.append(float(cols[0]))
            dense.append([math.log1p(max(float(v), 0.0)) if v else 0.0 for v in cols[1:1 + CRITEO_DENSE]])
            cats.append(cols[1 + CRITEO_DENSE:])
    return torch.tensor(labels), torch.tensor(dense), cats


def criteo_batches(path: str | Path, batch_size: int, num_embeddings: int = 1000,
                   num_tables: int = CRITEO_SPARSE, limit: int | None = None,
                   ) -> Iterator[tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]]:
    """Batches ``(dense (B, 13) float, kjt with keys C1.., labels (B,) float)`` from the Criteo TSV.

    Dense values become ``log(1 + max(x, 0))`` (empty: 0); a categorical value is its hex string as an
    integer modulo ``num_embeddings``, an empty one an empty bag. The last partial batch is dropped.

    Raises:
        ValueError: a line without 40 columns (names the file and line).
    """
    labels, dense, cats = _parse_criteo(Path(path), limit)
    keys = [f"C{i}" for i in range(1, num_tables + 1)]
    for lo in range(0, len(labels) - batch_size + 1, batch_size):
        rows = cats[lo:lo + batch_size]
        values, lengths = [], []
        for k in range(num_tables):
            for row in rows:
                if row[k]:
                    values.append(int(row[k], 16) % num_embeddings)
                    lengths.append(1)
                else:
                    lengths.append(0)
        kjt = KeyedJaggedTensor(keys=keys, values=torch.tensor(values, dtype=torch.long),
                                lengths=torch.tensor(lengths, dtype=torch.int32))
        yield dense[lo:lo + batch_size], kjt, labels[lo:lo + batch_size]
