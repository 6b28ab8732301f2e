"""Turning a ``PSClient``'s per-server lookup answers into torchrec's ``KeyedTensor`` (pooling).

Each server answers ``(B, D_s)``: the pooled sums of the features it holds, in its layout. When every feature
comes whole from one server the output is one ``index_select`` of the concatenated answers (one ``index_add``
in backward); row-wise shards add their partial sums. The client's layout (``client._slots``, feature ->
``[(server, first column, dim)]``) and the cached gather (``client._gather``) stay on the client.

Source: torchrec ``KeyedTensor`` (``keys``, ``length_per_key``, ``values``); EmbeddingBag sum/mean pooling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["pool", "column_gather", "pool_gather"]


def pool(client: Any, kjt: Any, parts: Sequence[torch.Tensor]) -> Any:
    """Assemble per-server answers into torchrec's ``KeyedTensor`` ``(B, sum D)`` keyed by feature.

    ``parts`` are the answers of the servers :meth:`PSClient.servers_for` lists, in that order.

    Row-wise partial sums are added; mean-pooled features are divided by their bag lengths (empty bags
    give zeros). Differentiable in ``parts``.

    Raises:
        ValueError: ``parts`` does not hold one answer per server the client reads.
    """
    from torchrec.sparse.jagged_tensor import KeyedTensor

    ids = client.servers_for()
    if len(parts) != len(ids):
        raise ValueError(f"PSClient.pool: expected {len(ids)} server answers (servers {ids}), got {len(parts)}")
    if client._gather is None:
        client._gather = column_gather(client, ids)
    if client._gather is not False:
        return pool_gather(client, kjt, parts)
    by_server = dict(zip(ids, parts))
    pooling = {f: t.pooling for t in client.tables for f in t.feature_names}
    outs, dims = [], []
    for feat in client.feature_names:
        slots = client._slots[feat]
        value = by_server[slots[0][0]][:, slots[0][1]:slots[0][1] + slots[0][2]]
        for s, col, dim in slots[1:]:
            value = value + by_server[s][:, col:col + dim]
        if pooling[feat] == "mean":
            bag_len = kjt[feat].lengths().clamp(min=1).to(value.device, value.dtype).unsqueeze(1)
            value = value / bag_len
        outs.append(value)
        dims.append(slots[0][2])
    return KeyedTensor(keys=client.feature_names, length_per_key=dims, values=torch.cat(outs, dim=1))


def column_gather(client: Any, ids: list[int]) -> Any:
    """When every feature comes whole from one server: a :class:`_Gather` (the output's columns as indices into
    the concatenated answers, or, when every feature has the same dim ``D``, its ``D``-wide blocks), False
    otherwise (row-wise)."""
    names = client.feature_names
    if any(len(client._slots[f]) != 1 for f in names):
        return False
    start = dict(zip(ids, [0, *torch.tensor([client.widths[s] for s in ids]).cumsum(0).tolist()[:-1]]))
    mean = torch.tensor([t.pooling == "mean" for t in client.tables for _ in t.feature_names])
    dims = [client._slots[f][0][2] for f in names]
    block = dims[0] if dims and all(d == dims[0] for d in dims) else 0
    positions: list[torch.Tensor] | None = None
    if block and all(client.widths[s] % block == 0 for s in ids):   # every feature one aligned block of the answers
        index = torch.tensor([(start[s] + col) // block for f in names for s, col, _ in client._slots[f]])
        positions = _block_positions(client, ids, names, block)
    else:
        block = 0
        index = torch.tensor([start[s] + col + j for f in names for s, col, dim in client._slots[f] for j in range(dim)])
    return _Gather(index, block, mean if bool(mean.any()) else None, dims, torch.tensor(dims), list(names), positions,
                   _interleave(positions))


def _interleave(positions: list[torch.Tensor] | None) -> list[int] | None:
    """When answer ``s`` of ``P`` holds the output's blocks ``start_s, start_s + P, start_s + 2P, ...`` (tables dealt
    round-robin to the servers): the answers' indices in order of ``start_s``, so the output is their blocks stacked
    (``torch.stack(dim=2)``, autograd's own backward); None otherwise."""
    if not positions:
        return None
    count, total = len(positions), sum(p.numel() for p in positions)
    starts = [int(p[0]) if p.numel() else -1 for p in positions]
    if sorted(starts) != list(range(count)) or any(p.numel() * count != total for p in positions):
        return None
    if not all(torch.equal(p, torch.arange(start, total, count)) for p, start in zip(positions, starts)):
        return None
    return sorted(range(count), key=starts.__getitem__)


def _block_positions(client: Any, ids: list[int], names: list[str], block: int) -> list[torch.Tensor] | None:
    """Per server, the output position of each of its answer's blocks, in the answer's order; None unless every
    block of every answer is one output feature (then a server's gradient is one ``index_select``)."""
    slots: list[list[int | None]] = [[None] * (client.widths[s] // block) for s in ids]
    where = {s: i for i, s in enumerate(ids)}
    for i, f in enumerate(names):
        s, col, _ = client._slots[f][0]
        if slots[where[s]][col // block] is not None:
            return None
        slots[where[s]][col // block] = i
    if any(p is None for server in slots for p in server):
        return None
    return [torch.tensor(server, dtype=torch.int64) for server in slots]


class _BlockGather(torch.autograd.Function):
    """The answers' blocks gathered into the output ``(B, F * D)``; backward gives each answer its gradient as one
    ``index_select`` of the output's (a contiguous ``(B, D_s)``, no zero-filled ``index_add``). Same values and
    gradients as ``cat`` + ``index_select``."""

    @staticmethod
    def forward(ctx: Any, gather: "_Gather", *parts: torch.Tensor) -> torch.Tensor:
        ctx.positions, ctx.block = gather.positions, gather.block
        return _gather_blocks(parts, gather)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        rows = grad.shape[0]
        blocks = grad.reshape(rows, grad.shape[1] // ctx.block, ctx.block)
        return (None, *[blocks.index_select(1, pos).view(rows, pos.numel() * ctx.block) for pos in ctx.positions])


def _gather_blocks(parts: Sequence[torch.Tensor], gather: "_Gather") -> torch.Tensor:
    """The output ``(B, F * D)``: the answers as ``(B, sum D_s / D, D)`` blocks, concatenated, then the features'
    blocks picked in output order."""
    block = gather.block
    views = [p.reshape(p.shape[0], p.shape[1] // block, block) for p in parts]
    blocks = torch.cat(views, dim=1) if len(views) > 1 else views[0]
    return blocks.index_select(1, gather.index).view(blocks.shape[0], len(gather.dims) * block)


class _Gather:
    """How :func:`pool_gather` assembles whole features: ``index`` (``(sum D,)`` columns, or ``(F,)`` blocks of
    ``block`` columns when ``block`` > 0) into the concatenated answers, the ``(F,)`` mask of mean-pooled
    features (None when all sum), the dims as a list and as a tensor, the output's keys, and (blocks only, when
    every block of every answer is a feature) each answer's blocks' output positions."""

    __slots__ = ("index", "block", "mean", "dims", "repeats", "keys", "positions", "interleave")

    def __init__(self, index: torch.Tensor, block: int, mean: torch.Tensor | None, dims: list[int],
                 repeats: torch.Tensor, keys: list[str], positions: list[torch.Tensor] | None = None,
                 interleave: list[int] | None = None) -> None:
        self.index, self.block, self.mean, self.dims, self.repeats, self.keys = index, block, mean, dims, repeats, keys
        self.positions, self.interleave = positions, interleave

    def to(self, device: torch.device) -> "_Gather":
        """The same gather with its tensors on ``device``."""
        return _Gather(self.index.to(device), self.block, None if self.mean is None else self.mean.to(device),
                       self.dims, self.repeats.to(device), self.keys,
                       None if self.positions is None else [p.to(device) for p in self.positions], self.interleave)


def pool_gather(client: Any, kjt: Any, parts: Sequence[torch.Tensor]) -> Any:
    """:func:`pool` in one ``index_select`` (one ``index_add`` backward) instead of a slice per feature; over
    ``D``-wide blocks when every feature has the same dim (a copy per block and row, not per column), and then,
    when the answers hold nothing but the features, each answer's gradient one ``index_select`` (:class:`_BlockGather`),
    or, when the tables were dealt round-robin to the servers, one ``torch.stack`` of the answers' blocks (its backward
    autograd's own, no Python)."""
    from torchrec.sparse.jagged_tensor import KeyedTensor

    gather = client._gather
    if gather.index.device != parts[0].device:  # rows on an accelerator: the index tensors follow once
        gather = client._gather = gather.to(parts[0].device)
    if gather.interleave is not None and len(parts) == len(gather.interleave):   # no Python in backward
        rows, block = parts[0].shape[0], gather.block
        values = torch.stack([parts[i].reshape(rows, parts[i].shape[1] // block, block) for i in gather.interleave],
                             dim=2).view(rows, len(gather.dims) * block)
    elif gather.positions is not None and len(parts) == len(gather.positions):
        values = _BlockGather.apply(gather, *parts)
    elif gather.block:
        values = _gather_blocks(parts, gather)
    else:
        values = torch.cat(list(parts), dim=1) if len(parts) > 1 else parts[0]
        values = values.index_select(1, gather.index)
    if gather.mean is not None:
        keys = kjt.keys()
        pos = {k: i for i, k in enumerate(keys)}
        lengths = kjt.lengths().to(values.device)
        lens = lengths.view(len(keys), -1).index_select(
            0, torch.tensor([pos[f] for f in gather.keys], device=values.device))
        divisor = torch.where(gather.mean.unsqueeze(1), lens.clamp(min=1), 1).to(values.dtype)   # (F, B)
        values = values / divisor.t().repeat_interleave(gather.repeats, dim=1)
    return KeyedTensor(keys=gather.keys, length_per_key=gather.dims, values=values)
