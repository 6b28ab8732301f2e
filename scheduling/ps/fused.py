"""All the shards one server holds for a client, in one weight tensor: lookups and pushes in a few ops.

A server holding 13 tables used to run ~8 small tensor ops per table per request; on a 2-core machine that
per-op overhead (dispatch, allocation, Python) was most of a request's CPU time and competed with the
trainer's compute. :class:`FusedTables` stacks the shards' rows into one ``(R, D)`` weight (and one
``(R,)`` optimizer state) and turns a whole KeyedJaggedTensor into global row ids once, so a lookup is one
``index_select`` + one ``index_add_`` and a push one ``unique`` + one ``index_add_`` + one optimizer step,
whatever the number of tables. The shards keep *views* of these tensors, so checkpoints and tests still see
per-shard weights.

What a batch's keys and lengths alone decide (which ids this server pools, their valid ranges, stacked-row
offsets and output bags) is computed once and reused while the lengths repeat (:data:`RECENT_STRUCTURES`;
fixed-size bags: every step), so resolving a batch is a handful of ops on its ids; the bags are also numbered
sample-major, the layout of the ``(B, J * D)`` answer and gradient, so neither is copied through a transpose.

Applies when every shard of the namespace has the same embedding dimension and every feature is pooled by
one shard on this server (the common case: table-wise or row-wise sharding, tables with one or more features);
otherwise :meth:`FusedTables.build` returns None and the server uses its per-shard path. Both give the same
numbers (the per-row sums run in the same order).

Source: FBGEMM's table-batched embedding (``SplitTableBatchedEmbeddingBagsCodegen``), which batches all
tables of a rank into one kernel call for the same reason.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from .dynamic_native import sgd_rows
from .optimizer import RowWiseSGD
from .shard_plan import ShardSpec
from .storage import RowStore, empty_rows

__all__ = ["FusedTables", "FusedIndex", "RECENT_INDEXES", "RECENT_STRUCTURES", "unique_inverse", "unique_count"]

RECENT_INDEXES = 16
"""How many recently resolved batches a :class:`FusedTables` keeps (:meth:`FusedTables.index`): a trainer's push
carries the ids of a batch it looked up a step before, so its push reuses that lookup's :class:`FusedIndex`
instead of resolving the same ids again (2 trainers with prefetch have at most 4 batches between a lookup and
its push here; more trainers or staleness only miss, and a miss resolves as before)."""

RECENT_STRUCTURES = 4
"""How many batch structures (what a batch's keys and lengths alone decide: which ids are pooled here, their
valid ranges, stacked-row offsets and output bags) a :class:`FusedTables` keeps per key tuple, so that resolving a
batch of known lengths is a few ops on its ids alone (fixed-size bags: every batch of a run)."""


@dataclass
class FusedIndex:
    """A batch resolved against a :class:`FusedTables`: ``rows`` global row ids ``(N',)`` int64, ``bags``
    output-bag ids ``(N',)`` (``entry * B + sample``), per-id ``weights`` ``(N',)`` or None, ``batch_size``;
    ``sample_bags`` ``(N',)``: the same bags numbered ``sample * J + entry`` (J entries), or None; ``order``
    ``(B * J,)``: where every bag holds exactly one id, the ids' positions in bag order ``sample * J + entry``,
    else None."""

    rows: torch.Tensor
    bags: torch.Tensor
    weights: torch.Tensor | None
    batch_size: int
    sample_bags: torch.Tensor | None = None
    order: torch.Tensor | None = None


@dataclass(eq=False)  # hashed by identity: part of the key of a recent index
class _Structure:
    """A batch's keys and ``lengths`` resolved against a :class:`FusedTables`, ids aside: ``pos`` ``(N',)`` the
    positions of the ids of pooled keys (None: all), and per such id its layout entry, valid ids ``[0, high)``,
    shard rows ``[start, end)``, ``shift`` (its stacked row is ``id + shift``) and output bag (numbered
    ``entry * B + sample`` and ``sample * J + entry``); ``whole``: every entry's shard holds its whole table;
    ``order``: :attr:`FusedIndex.order` (the positions sorting ``sample_bags``, when it numbers every bag once)."""

    lengths: torch.Tensor
    batch_size: int
    pos: torch.Tensor | None
    entry: torch.Tensor
    high: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    shift: torch.Tensor
    bags: torch.Tensor
    sample_bags: torch.Tensor
    whole: bool
    order: torch.Tensor | None

    def __post_init__(self) -> None:
        # NumPy views of the per-id bounds and shifts: a batch's checks and row ids in NumPy ops (~1 us each, a
        # third of torch's dispatch per op on these few thousand ids); ``high`` as unsigned, so that one
        # comparison also catches a negative id (it wraps to >= 2**63)
        self.high_u = self.high.numpy().view(np.uint64)
        self.shift_np = self.shift.numpy()



def unique_inverse(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(rows, return_inverse=True)`` of row ids ``rows`` ``(N,)``: the sorted distinct ids ``(U,)`` and
    each id's position among them ``(N,)`` (int64), the same tensors, from NumPy's vectorised ``argsort`` (about
    half the time of torch's CPU ``unique``, which sorts with ``std::sort``: a push's largest op at 1664 ids).
    Tensors other than int64 on the CPU go to ``torch.unique``.

    Raises:
        RuntimeError: ``rows`` is not 1-D (from ``torch.unique``'s own check or this one).
    """
    if rows.dtype != torch.int64 or rows.device.type != "cpu" or rows.dim() != 1 or rows.requires_grad:
        if rows.dim() != 1:
            raise RuntimeError(f"unique_inverse: rows must be 1-D, got shape {tuple(rows.shape)}")
        return torch.unique(rows, return_inverse=True)
    ids = rows.numpy()
    order = np.argsort(ids)  # ties in any order: equal ids get the same position either way
    ordered = ids[order]
    first = np.empty(ids.size, dtype=bool)  # where a new distinct id starts in sorted order
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    inverse = np.empty(ids.size, dtype=np.int64)
    inverse[order] = np.cumsum(first, dtype=np.int64) - 1
    return torch.from_numpy(ordered[first]), torch.from_numpy(inverse)


def unique_count(rows: torch.Tensor) -> int:
    """How many distinct ids ``rows`` ``(N,)`` holds (``torch.unique(rows).numel()``, by NumPy's sort)."""
    if rows.dtype != torch.int64 or rows.device.type != "cpu" or rows.requires_grad:
        return int(torch.unique(rows).numel())
    ordered = np.sort(rows.numpy().ravel())
    return int(ordered.size and 1 + np.count_nonzero(ordered[1:] != ordered[:-1]))


def _stacked(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` (each ``(n_i, ...)``, one dtype) into memory advised for huge pages
    (:func:`~scheduling.ps.storage.empty_rows`): the stacked rows are read and written at random."""
    rows, width = sum(p.shape[0] for p in parts), math.prod(parts[0].shape[1:])
    out = empty_rows(rows, width, parts[0].dtype)
    torch.cat([p.reshape(p.shape[0], width) for p in parts], out=out)
    return out.view(rows, *parts[0].shape[1:])


def _sample_bags(idx: FusedIndex) -> torch.Tensor:
    """``idx.sample_bags``, which :meth:`FusedTables.index` always sets (only dynamic tables' indexes lack it)."""
    return cast(torch.Tensor, idx.sample_bags)

class FusedTables:
    """The shards of one namespace on one server, stacked (see the module docstring).

    Args:
        layout: the ``(shard, feature)`` pairs in output-column order (``server_layout``).
        weights: per shard key, its ``(rows, D)`` weight (in the form of :attr:`store`); states: its ``(rows,)``
            optimizer state or None.
        lock: guards updates of the stacked tensors (shared with the shards' own locks).

    Use :meth:`build`, which returns None when the layout cannot be stacked.
    """

    store: RowStore = RowStore()
    """How the stacked rows are stored (:mod:`scheduling.ps.storage`); set by the server."""

    def __init__(self, layout: Sequence[tuple[ShardSpec, str]], weights: dict[str, torch.Tensor],
                 states: dict[str, torch.Tensor | None], lock: threading.Lock) -> None:
        self.layout = list(layout)
        self.dim = self.layout[0][0].table.embedding_dim
        self.shard_keys = list(dict.fromkeys(spec.key for spec, _ in self.layout))  # a table may pool 2 features
        sizes = [weights[k].shape[0] for k in self.shard_keys]
        offset = dict(zip(self.shard_keys, [0, *torch.tensor(sizes).cumsum(0).tolist()[:-1]]))
        self.base = torch.tensor([offset[spec.key] for spec, _ in self.layout])
        self.weight = _stacked([weights[k] for k in self.shard_keys])
        has_state = all(states[k] is not None for k in self.shard_keys)
        # has_state: every shard has its state
        self.state = _stacked([cast(torch.Tensor, states[k]) for k in self.shard_keys]) if has_state else None
        self._offset = offset
        # per entry, and a last column for KJT keys this server does not pool: valid ids [low, high), this
        # shard's rows [start, end) (none for the last column), and the shard's first row in the stack
        big = 2**62
        self._meta = torch.tensor([[0] * len(self.layout) + [-big],
                                   [spec.table.num_embeddings for spec, _ in self.layout] + [big],
                                   [spec.row_start for spec, _ in self.layout] + [0],
                                   [spec.row_end for spec, _ in self.layout] + [0],
                                   self.base.tolist() + [0]])
        self.features = [feat for _, feat in self.layout]
        self.lock = lock
        self._entry_of_key: dict[tuple[str, ...], torch.Tensor] = {}
        self._structures: dict[tuple[str, ...], tuple[_Structure, ...]] = {}
        self._recent: OrderedDict[tuple, tuple[Any, ...]] = OrderedDict()
        """Recent batches: key -> (values, weights, their version counters when kept, the FusedIndex)."""
        self._recent_lock = threading.Lock()
        self.index_hits = 0
        """Batches :meth:`index` found among the recent ones (a push of a batch looked up here) instead of
        resolving them again."""
        self.kernel: Any = None
        """FBGEMM's kernel owning :attr:`weight` and :attr:`state` (:meth:`use_kernel`), or None."""
        self.changed: torch.Tensor | None = None
        """``(R,)`` bool: the stacked rows pushed since the last delta (:meth:`track_changes`), or None: not tracked."""
        self._changed_np: np.ndarray | None = None

    def use_kernel(self, optimizer: Any) -> bool:
        """Move the stacked rows into FBGEMM's CPU kernel (:mod:`scheduling.ps.tbe`) where it applies (call
        before :meth:`shard_views`); returns whether it did."""
        from .tbe import kernel_for

        rows = [int(n) for n in torch.tensor([self._offset[k] for k in self.shard_keys] + [self.weight.shape[0]]).diff()]
        tables = [self.shard_keys.index(spec.key) for spec, _ in self.layout]
        kernel = kernel_for(optimizer, self.store, self.dim, rows, tables)
        if kernel is None or (self.state is None) != (kernel.state is None):
            return False
        kernel.weight.copy_(self.weight)
        if self.state is not None:
            cast(torch.Tensor, kernel.state).copy_(self.state)  # checked above: it has one when self has
        self.weight, self.state, self.kernel = kernel.weight, kernel.state, kernel
        return True

    @classmethod
    def build(cls, layout: Sequence[tuple[ShardSpec, str]], weights: dict[str, torch.Tensor],
              states: dict[str, torch.Tensor | None], lock: threading.Lock) -> "FusedTables | None":
        """Stack the shards, or None when the layout is empty, dims differ, a feature is pooled by two
        shards, or only some shards have optimizer state."""
        if not layout:
            return None
        dims = {spec.table.embedding_dim for spec, _ in layout}
        feats = [feat for _, feat in layout]
        with_state = {states[spec.key] is not None for spec, _ in layout}
        if len(dims) != 1 or len(set(feats)) != len(feats) or len(with_state) != 1:
            return None
        return cls(layout, weights, states, lock)

    def shard_views(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """Per shard key: views ``(rows, D)`` of the stacked weight and ``(rows,)`` of the state."""
        out = {}
        rows = {spec.key: spec.num_rows for spec, _ in self.layout}
        for key in self.shard_keys:
            lo, hi = self._offset[key], self._offset[key] + rows[key]
            out[key] = (self.weight[lo:hi], None if self.state is None else self.state[lo:hi])
        return out

    def track_changes(self) -> dict[str, torch.Tensor]:
        """Start recording the rows pushes update (:mod:`scheduling.ps.changes`): a fresh :attr:`changed` mask, all
        False; returns per shard key the view ``(rows,)`` of its slice."""
        self.changed = torch.zeros(self.weight.shape[0], dtype=torch.bool, device=self.weight.device)
        self._changed_np = self.changed.numpy() if self.changed.device.type == "cpu" else None
        rows = {spec.key: spec.num_rows for spec, _ in self.layout}
        return {k: self.changed[self._offset[k]:self._offset[k] + rows[k]] for k in self.shard_keys}

    def _mark(self, rows: torch.Tensor) -> None:
        """Record global rows ``rows`` ``(N,)`` as changed when tracked (caller holds :attr:`lock`)."""
        if self._changed_np is not None and rows.device.type == "cpu":
            self._changed_np[rows.numpy()] = True   # NumPy: a third of torch's index_put_ dispatch on a push's ids
        elif self.changed is not None:
            self.changed[rows.to(self.changed.device)] = True

    # ---- batch -> global rows ---------------------------------------------------------------------------
    def _entries(self, keys: tuple[str, ...], where: str) -> torch.Tensor:
        """``(K,)`` layout position of each KJT key, ``J`` (number of entries) for keys not pooled here."""
        found = self._entry_of_key.get(keys)
        if found is None:
            pos = {k: i for i, k in enumerate(keys)}
            missing = [f for f in self.features if f not in pos]
            if missing:
                raise ValueError(f"{where}: the batch has no feature {missing[0]!r} (table "
                                 f"{self.layout[self.features.index(missing[0])][0].table.name!r}); got keys "
                                 f"{sorted(keys)}")
            entry = [len(self.layout)] * len(keys)  # the "not pooled here" column of _meta
            for j, feat in enumerate(self.features):
                entry[pos[feat]] = j
            found = self._entry_of_key[keys] = torch.tensor(entry)
        return found

    def index(self, keys: tuple[str, ...], values: torch.Tensor, lengths: torch.Tensor,
              weights: torch.Tensor | None, where: str) -> FusedIndex:
        """Resolve a key-major KJT ``(values (N,), lengths (K*B,), weights (N,) or None)``; a batch equal to one
        of the last :data:`RECENT_INDEXES` resolved here (same keys, ``torch.equal`` values, lengths and
        weights: a push of a batch this server looked up) gets that batch's :class:`FusedIndex` back (the same
        rows and bags, so the same numbers), counted in :attr:`index_hits`.

        Raises:
            ValueError: a feature of the layout is missing, or an id lies outside its table (the message
                names ``where``, the feature, the id and the table).
        """
        # a cheap key narrows the candidates (equal keys and lengths: the same structure); equality decides
        st = self._structure(keys, lengths, where)
        total = int(values.numpy().sum()) if values.device.type == "cpu" else int(values.sum())  # NumPy: no dispatch
        key = (st, values.dtype, values.numel(), total, weights is None)
        with self._recent_lock:
            seen = self._recent.get(key)
        # the kept tensors are the sender's own (servers in the trainers get them uncopied): one changed in place
        # since (its version counter moved) no longer shows the ids its index was resolved from
        if (seen is not None and seen[0]._version == seen[2] and torch.equal(seen[0], values)
                and (weights is None or (seen[1]._version == seen[3] and torch.equal(seen[1], weights)))):
            self.index_hits += 1
            return seen[4]
        idx = self._resolve(keys, values, lengths, weights, where, st)
        with self._recent_lock:
            self._recent[key] = (values, weights, values._version, None if weights is None else weights._version,
                                 idx)
            self._recent.move_to_end(key)
            while len(self._recent) > RECENT_INDEXES:
                self._recent.popitem(last=False)
        return idx

    def _structure(self, keys: tuple[str, ...], lengths: torch.Tensor, where: str) -> _Structure:
        """What resolving a batch needs from its keys and lengths alone (not its ids): the last
        :data:`RECENT_STRUCTURES` computed per key tuple are reused for equal lengths (same dtype, ``torch.equal``:
        every step of fixed-size bags, whichever trainer sent it)."""
        num_keys = len(keys)
        if num_keys == 0:
            raise ValueError(f"{where}: empty KeyedJaggedTensor")
        recent = self._structures.get(keys, ())
        for seen in recent:
            if seen.lengths.dtype == lengths.dtype and torch.equal(seen.lengths, lengths):
                return seen
        batch_size = lengths.numel() // num_keys
        entry_of_key = self._entries(keys, where)
        flat_bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths.long())
        entry = entry_of_key.index_select(0, torch.div(flat_bag, batch_size, rounding_mode="floor"))
        pooled = entry < len(self.layout)           # KJT keys this server pools; the others never match a row
        pos = None if bool(pooled.all()) else pooled.nonzero().squeeze(1)
        if pos is not None:
            entry, flat_bag = entry.index_select(0, pos), flat_bag.index_select(0, pos)
        _, high, start, end, base = self._meta.index_select(1, entry)     # (5, N'), see __init__
        whole = bool(((start == 0) & (end == high)).all())  # no row-wise shard: every valid id is a row here
        sample = torch.remainder(flat_bag, batch_size)
        sample_bags = sample * len(self.layout) + entry
        bags = batch_size * len(self.layout)
        order = None  # one id in every bag: bag order is a permutation of the ids (see lookup)
        if sample_bags.numel() == bags and bool((torch.bincount(sample_bags, minlength=bags) == 1).all()):
            order = torch.argsort(sample_bags)
        found = _Structure(lengths.clone(), batch_size, pos, entry, high, start, end, base - start,
                           entry * batch_size + sample, sample_bags, whole, order)
        self._structures[keys] = (found, *recent[:RECENT_STRUCTURES - 1])  # one assignment: readers see either
        return found

    def _resolve(self, keys: tuple[str, ...], values: torch.Tensor, lengths: torch.Tensor,
                 weights: torch.Tensor | None, where: str, st: _Structure | None = None) -> FusedIndex:
        st = st if st is not None else self._structure(keys, lengths, where)
        ids = values.long()
        if st.pos is not None:  # the ids of the keys pooled here (the others are no row of this server)
            ids = ids.index_select(0, st.pos)
            weights = weights.index_select(0, st.pos) if weights is not None else None
        flat = ids.numpy() if ids.device.type == "cpu" else None  # a CPU batch (always, on a server): NumPy ops
        if flat is None or bool((flat.view(np.uint64) >= st.high_u).any()):  # ids in [0, high)?
            bad = (ids < 0) | (ids >= st.high)
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                spec, feat = self.layout[int(st.entry[i])]
                raise ValueError(f"{where}: feature {feat!r} has id {int(ids[i])} outside table "
                                 f"{spec.table.name!r} rows [0, {spec.table.num_embeddings})")
        rows = ids + st.shift if flat is None else torch.from_numpy(flat + st.shift_np)  # the same int64 sums
        bags, sample_bags, order = st.bags, st.sample_bags, st.order
        if not st.whole:
            keep = (ids >= st.start) & (ids < st.end)      # rows of this server's shard of a row-wise table
            if not bool(keep.all()):
                sel = keep.nonzero().squeeze(1)
                rows, bags = rows.index_select(0, sel), bags.index_select(0, sel)
                sample_bags = sample_bags.index_select(0, sel)
                weights = weights.index_select(0, sel) if weights is not None else None
                order = None  # some bags lost their id here
        return FusedIndex(rows, bags, weights, st.batch_size, sample_bags, order)

    # ---- lookup and push --------------------------------------------------------------------------------
    def _local(self, idx: FusedIndex) -> torch.Tensor:
        """Each id's row within its own shard (FBGEMM's table-local indices)."""
        return idx.rows - self.base.index_select(0, torch.div(idx.bags, idx.batch_size, rounding_mode="floor"))

    def push(self, idx: FusedIndex, grad: torch.Tensor, optimizer: Any) -> int:
        """Apply the lookup output's gradient ``grad`` ``(B, J * D)`` with ``optimizer`` (FBGEMM's fused one when
        :attr:`kernel` is set; plain SGD on float32 rows without per-id weights in one pass of the compiled
        kernels where they apply, :func:`~scheduling.ps.dynamic_native.sgd_rows`, the same bits); returns the
        number of rows updated."""
        if self.kernel is not None:
            with self.lock:
                self.kernel.push(self._local(idx), idx.bags, idx.weights, idx.batch_size, grad)
                self._mark(idx.rows)
            return unique_count(idx.rows)
        if idx.weights is None and type(optimizer) is RowWiseSGD and type(self.store) is RowStore:
            bags = grad.reshape(idx.batch_size * len(self.layout), self.dim)  # sample-major, as row_grads reads it
            with self.lock:
                touched = sgd_rows(self.weight, idx.rows, bags, _sample_bags(idx), optimizer.lr)
                if touched is not None:
                    self._mark(idx.rows)
            if touched is not None:
                return touched
        rows, summed = self.row_grads(idx, grad)
        if rows.numel():
            with self.lock:
                optimizer.step(self.weight, self.state, rows, summed, self.store)
                self._mark(rows)
        return rows.numel()

    def lookup(self, idx: FusedIndex) -> torch.Tensor:
        """Pooled sums ``(B, J * D)``, entry ``j``'s ``D`` columns at ``j * D`` (layout order)."""
        if self.kernel is not None:
            return self.kernel.lookup(self._local(idx), idx.bags, idx.weights, idx.batch_size)
        num = len(self.layout)
        if idx.order is not None and idx.weights is None:
            # one id per bag: gathered in bag order, the rows are the answer; "+ 0.0" is what index_add_ into
            # zeros adds (-0.0 becomes 0.0), so the bits are the general path's
            rows = self.store.gather(self.weight, idx.rows.index_select(0, idx.order))  # a fresh tensor
            return rows.add_(0.0).view(idx.batch_size, num * self.dim)
        rows = self.store.gather(self.weight, idx.rows)
        if idx.weights is not None:
            rows = rows * idx.weights.unsqueeze(1)
        # pooled sample-major: the answer's layout already, no transposed copy
        pooled = torch.zeros(idx.batch_size * num, self.dim).index_add_(0, _sample_bags(idx), rows)
        return pooled.view(idx.batch_size, num * self.dim)

    def row_grads(self, idx: FusedIndex, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unique global rows ``(U,)`` and their summed gradients ``(U, D)`` from the lookup's output
        gradient ``grad`` ``(B, J * D)``."""
        num = len(self.layout)
        # the gradient's rows are sample-major bags already: no transposed copy
        g = grad.reshape(idx.batch_size * num, self.dim).index_select(0, _sample_bags(idx))
        if idx.weights is not None:
            g = g * idx.weights.unsqueeze(1)
        uniq, inverse = unique_inverse(idx.rows)
        return uniq, torch.zeros(uniq.numel(), self.dim).index_add_(0, inverse, g)
