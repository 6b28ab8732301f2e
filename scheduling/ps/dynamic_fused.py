"""All the dynamic tables one server holds for a client, served like fused fixed tables: a request in one
batched group lookup (push) and one pooling ``index_add_``.

:mod:`scheduling.ps.fused` stacks a namespace's fixed tables so a request costs a few tensor ops whatever the
number of tables. Dynamic tables (:mod:`scheduling.ps.dynamic`) of one shape share a
:class:`~scheduling.ps.dynamic_group.DynamicTableGroup`; when a namespace's tables all sit in one group,
:class:`DynamicFused` takes the server's fused path with them (raw ids instead of global rows), which saves the
per-shard path's per-table bagging, pooling and gradient slicing.

Source: FBGEMM's table-batched embedding (``SplitTableBatchedEmbeddingBagsCodegen``); Liu et al. 2022,
"Monolith: Real Time Recommendation System With Collisionless Embedding Table" §2.1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .dynamic import DynamicTable, group_tables
from .fused import FusedIndex, FusedTables

__all__ = ["DynamicFused", "group_shards"]


def group_shards(layout: Sequence[tuple[Any, str]], shards: Sequence[Any]) -> FusedTables | None:
    """:func:`group_tables` over the dynamic tables of a namespace's server shards (``shards[i]`` pools
    ``layout[i]``, a ``(ShardSpec, feature)`` pair; objects with ``dynamic``, ``weight``, ``state`` and
    ``lock``, None where not created yet), then point each shard at its table's views and lock. Returns a
    :class:`DynamicFused` when every entry is a dynamic table of one group and no feature is pooled twice,
    else None (the server's per-shard path)."""
    tables = [s.dynamic for s in shards if s is not None and s.dynamic is not None]
    for shard in shards:
        if shard is not None and shard.dynamic is not None:
            shard.weight = shard.state = None                # drop views of the old groups: copies move one by one
    group_tables(tables)
    for shard in shards:
        if shard is not None and shard.dynamic is not None:
            shard.weight, shard.state, shard.lock = shard.dynamic.weight, shard.dynamic.state, shard.dynamic.lock
    feats = [feat for _, feat in layout]
    if not tables or len(tables) != len(shards) or len(set(feats)) != len(feats) or any(
            t.group is not tables[0].group for t in tables):
        return None
    return DynamicFused(layout, tables)


class DynamicFused(FusedTables):
    """A namespace's dynamic tables on one server, all in one :class:`DynamicTableGroup`: a request's lookup
    is one batched group lookup and one pooling ``index_add_``, a push one batched group push, whatever the
    number of tables (as :class:`~scheduling.ps.fused.FusedTables` does for fixed tables). ``FusedIndex.rows``
    holds raw ids here. Rows and counters equal the per-shard path's (a table pooling two features sums a
    repeated id's gradients in batch order rather than layout order).

    Args:
        layout: the ``(shard, feature)`` pairs in output-column order; tables: each entry's dynamic table.
    """

    def __init__(self, layout: Sequence[tuple[Any, str]], tables: Sequence[DynamicTable]) -> None:
        self.layout, self.features = list(layout), [feat for _, feat in layout]
        self.group = tables[0].group
        self.dim, self.store, self.lock, self.kernel = self.group.dim, self.group.store, self.group.lock, None
        self._entry_of_key: dict[tuple[str, ...], torch.Tensor] = {}
        distinct = list(dict.fromkeys(tables))
        self.tabs = [t.index for t in distinct]
        self._row_of_entry = torch.tensor([distinct.index(t) for t in tables] + [len(distinct)])

    def index(self, keys: tuple[str, ...], values: torch.Tensor, lengths: torch.Tensor,
              weights: torch.Tensor | None, where: str) -> FusedIndex:
        """Raw ids and output bags of a key-major KJT ``(values (N,), lengths (K*B,), weights (N,) or None)``.

        Raises:
            ValueError: an empty KJT, or a feature of the layout is missing (the message names ``where``).
        """
        if not keys:
            raise ValueError(f"{where}: empty KeyedJaggedTensor")
        batch_size = lengths.numel() // len(keys)
        flat_bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths.long())
        entry = self._entries(keys, where).index_select(0, torch.div(flat_bag, batch_size, rounding_mode="floor"))
        ids, bags = values.long(), entry * batch_size + torch.remainder(flat_bag, batch_size)
        keep = entry < len(self.layout)
        if not bool(keep.all()):
            sel = keep.nonzero().squeeze(1)
            ids, bags = ids.index_select(0, sel), bags.index_select(0, sel)
            weights = weights.index_select(0, sel) if weights is not None else None
        return FusedIndex(ids, bags, weights, batch_size)

    def _padded(self, idx: FusedIndex) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The ids as ``(k, M)`` rows per table (int64-max padding), the mask of real ones (None: all), and the
        permutation from batch order to row-major order (None: already so)."""
        k = len(self.tabs)
        row = self._row_of_entry.index_select(0, torch.div(idx.bags, idx.batch_size, rounding_mode="floor"))
        ids, order = idx.rows, None
        if row.numel() > 1 and not bool((row[1:] >= row[:-1]).all()):
            order = torch.argsort(row, stable=True)
            ids, row = ids.index_select(0, order), row.index_select(0, order)
        counts = torch.bincount(row, minlength=k)
        lo, hi = int(counts.min()), int(counts.max())
        if lo == hi:
            return ids.view(k, hi), None, order
        valid = torch.arange(hi) < counts.unsqueeze(1)
        q = torch.full(valid.shape, torch.iinfo(torch.int64).max, dtype=torch.int64)
        q[valid] = ids
        return q, valid, order

    def lookup(self, idx: FusedIndex) -> torch.Tensor:
        """Pooled sums ``(B, J * D)``, entry ``j``'s ``D`` columns at ``j * D`` (layout order); one step of
        every table of the namespace."""
        q, valid, order = self._padded(idx)
        with self.lock:
            rows, _ = self.group.lookup_padded(self.tabs, q, valid)
        rows = rows.view(-1, self.dim) if valid is None else rows[valid]
        if order is not None:
            rows = torch.empty_like(rows).index_copy_(0, order, rows)
        if idx.weights is not None:
            rows = rows * idx.weights.unsqueeze(1)
        num = len(self.layout)
        pooled = torch.zeros(num * idx.batch_size, self.dim).index_add_(0, idx.bags, rows)
        return pooled.view(num, idx.batch_size, self.dim).transpose(0, 1).reshape(idx.batch_size, num * self.dim)

    def push(self, idx: FusedIndex, grad: torch.Tensor, optimizer: Any) -> int:
        """Apply the lookup output's gradient ``grad`` ``(B, J * D)`` (the group's own optimizer); returns the
        number of rows updated."""
        num = len(self.layout)
        per_bag = grad.reshape(idx.batch_size, num, self.dim).transpose(0, 1).reshape(num * idx.batch_size,
                                                                                       self.dim)
        g = per_bag.index_select(0, idx.bags)
        if idx.weights is not None:
            g = g * idx.weights.unsqueeze(1)
        q, valid, order = self._padded(idx)
        if order is not None:
            g = g.index_select(0, order)
        with self.lock:
            return self.group.push_padded(self.tabs, q, valid, g)
