"""Dynamic tables of one shape stacked, so a request's lookups and pushes run one set of ops for all of them.

A :class:`~scheduling.ps.dynamic.DynamicTable` is a handle on one row of a :class:`DynamicTableGroup`; the
group holds every table's state as stacked tensors (``T`` tables of ``C`` slots):

* ``weight`` ``(T * C, D)`` stored rows, ``state`` ``(T * C,)`` optimizer state (table ``t``'s slot ``s`` at
  row ``t * C + s``); ``slot_id`` ``(T, C)`` the id in each slot (-1 free); ``last_seen`` ``(T, C)`` steps;
* ``rows`` ``(T,)`` occupied slots, ``step`` ``(T,)``, ``counters`` ``(T, 5)``; the id -> slot maps, LRU order
  and free slots in a :class:`~scheduling.ps.dynamic_index.SlotIndex` (a hash table, an append-only log and a
  free list: per-step work in the ids a step touches, not in ``C``).

A lookup of ``k`` tables pads their ids to ``(k, M)``, sorts each row (``torch.sort(dim=1)``), probes the hash
tables with vectorised rounds, takes free slots and LRU victims of all tables from the index, enters the new
ids, makes all fresh rows with one :func:`initial_rows_keyed` call, gathers all rows with one ``index_select``
and appends the step's slots to the log: a number of tensor ops independent of ``k`` and of ``C`` (per-op
overhead, not arithmetic, was the cost of one table at a time; whole-``C`` scans were the cost of large tables).
A push of the ids the latest lookup answered reuses its slots. Candidates (``min_count`` > 1, or ids left
without a slot) stay per table. Fresh rows are made in chunks of :data:`CHUNK_ELEMENTS`, which bounds their
temporaries. The rules, and so every row, slot and counter, are those of one table at a time.

With the compiled kernels (:mod:`scheduling.ps.dynamic_native`, the default where a C++ compiler is found) the
index's operations are one call each, and for ``min_count == 1`` and tables without candidates the whole id ->
slot step (sort, probe, take slots, evict, insert, count) is one call; fresh rows, gathers and pushes stay here.
The torch code above is the reference: both give the same state tensors (``tests/scheduling/test_ps_dynamic_native.py``).

Source: Liu et al. 2022, "Monolith: Real Time Recommendation System With Collisionless Embedding Table"
(§2.1, §2.2); FBGEMM's table-batched embeddings (``SplitTableBatchedEmbeddingBagsCodegen``) batch the tables
of a rank for the same reason; Steele et al., OOPSLA 2014 (splitmix64).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from .dynamic_index import _i64, _shr, mix64_torch
from .dynamic_native import NativeSlotIndex, initial_rows_native, make_slot_index
from .optimizer import RowWiseOptimizer
from .storage import RowStore

__all__ = ["DynamicTableGroup", "initial_rows", "initial_rows_keyed", "mix64_torch", "row_key"]

_GOLDEN = 0x9E3779B97F4A7C15
_MAX = torch.iinfo(torch.int64).max
CHUNK_ELEMENTS = 1 << 18
"""Elements per batch of fresh rows: 2 MiB per int64 temporary."""
COUNTERS = ("inserts", "admitted", "evictions", "expired", "rejected")
_INSERTS, _ADMITTED, _EVICTIONS, _EXPIRED, _REJECTED = range(5)


def row_key(seed: int, salt: int) -> int:
    """The int64 added to raw ids before mixing, for table ``(seed, salt)``."""
    return _i64((seed * 1_000_003 + salt + 1) * _GOLDEN % (1 << 64))


def initial_rows_keyed(ids: torch.Tensor, keys: torch.Tensor | int, dim: int, bound: float) -> torch.Tensor:
    """:func:`initial_rows` with each id's table key (:func:`row_key`) given per element or once.

    Shapes: ids ``(N,)`` int64, keys ``(N,)`` int64 or an int -> ``(N, dim)`` float32.
    """
    key = mix64_torch(ids.long() + keys)
    cols = torch.arange(1, dim + 1, dtype=torch.int64) * _i64(_GOLDEN)
    bits = _shr(mix64_torch(key.unsqueeze(1) + cols), 11)                    # 53 random bits
    unit = bits.double() * 2.0 ** -53                                         # [0, 1)
    return ((2.0 * unit - 1.0) * bound).float()


def initial_rows(ids: torch.Tensor, dim: int, bound: float, seed: int, salt: int = 0) -> torch.Tensor:
    """Fresh rows of raw ids: uniform in ``[-bound, bound)``, element ``(i, j)`` a function of
    ``(seed, salt, ids[i], j)`` only.

    Shapes: ids ``(N,)`` int64 -> ``(N, dim)`` float32.
    """
    return initial_rows_keyed(ids, row_key(seed, salt), dim, bound)


def _find(keys: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of ``q`` in sorted ``keys`` and whether each is present. Shapes: ``(K,)``, ``(N,)``."""
    pos = torch.searchsorted(keys, q)
    found = pos < keys.numel()
    found[found.clone()] = keys[pos[found]] == q[found]
    return pos.clamp_max(max(keys.numel() - 1, 0)), found


def _pad(ids: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """``(k, M)`` int64 rows of ``ids`` padded with int64 max, the ``(k, M)`` mask of real entries (None when
    all have one length), and the lengths."""
    lens = [int(x.numel()) for x in ids]
    if len(set(lens)) == 1:
        return torch.stack([x.long() for x in ids]), None, lens
    valid = torch.arange(max(lens)) < torch.tensor(lens).unsqueeze(1)
    q = torch.full(valid.shape, _MAX, dtype=torch.int64)
    q[valid] = torch.cat([x.long() for x in ids])
    return q, valid, lens


def _occurrences(group_start: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """How often each distinct id of sorted rows occurs, at its first entry: ``group_start`` ``(k, M)`` each
    entry's first equal entry, ``valid`` the real entries (None: all) -> ``(k, M)`` counts (0 elsewhere)."""
    k, width = group_start.shape
    flat = group_start + (torch.arange(k) * width).unsqueeze(1)
    return torch.bincount(flat.view(-1) if valid is None else flat[valid], minlength=k * width).view(k, width)


class DynamicTableGroup:
    """``T`` dynamic tables of one ``(capacity, dim, min_count, expire_steps)``, optimizer and storage, stacked
    (see the module docstring); ``seeds[t]`` and ``salts[t]`` key table ``t``'s fresh rows."""

    def __init__(self, dim: int, spec: Any, optimizer: RowWiseOptimizer, store: RowStore,
                 seeds: Sequence[int], salts: Sequence[int]) -> None:
        t, cap = len(salts), spec.capacity
        self.dim, self.spec, self.optimizer, self.store, self.capacity = dim, spec, optimizer, store, cap
        self.bound = cap ** -0.5
        self.seeds, self.salts = list(seeds), list(salts)
        self.row_keys = torch.tensor([row_key(s, a) for s, a in zip(self.seeds, self.salts)], dtype=torch.int64)
        self.weight = store.encode(torch.zeros(t * cap, dim))
        self.state = optimizer.init_state(t * cap, dim)
        self.slot_id = torch.full((t, cap), -1, dtype=torch.int64)
        self.last_seen = torch.zeros(t, cap, dtype=torch.int64)
        self.index = make_slot_index(t, cap)              # compiled kernels, else the torch SlotIndex
        self.rows = torch.zeros(t, dtype=torch.int64)
        self.step = torch.zeros(t, dtype=torch.int64)
        self.counters = torch.zeros(t, len(COUNTERS), dtype=torch.int64)
        empty = torch.empty(0, dtype=torch.int64)
        self.cands: list[list[torch.Tensor]] = [[empty, empty, empty] for _ in range(t)]  # ids, counts, seen
        self.lock = threading.Lock()
        self.last_lookup: tuple[list[int], torch.Tensor, torch.Tensor] | None = None
        """The latest lookup's ``(tabs, ids (k, M), slots (k, M))``, valid until the maps next change: a push of
        the same ids (no prefetch) reuses its slots instead of probing again."""
        self.changed: torch.Tensor | None = None
        """``(T * C,)`` bool: slots pushed or given a fresh row since the last delta, None: not tracked; with
        ``base_slot`` (``slot_id`` then) and ``admitted`` (``(table, ids)`` since): :mod:`scheduling.ps.changes`."""
        self.base_slot: torch.Tensor | None = None
        self.admitted: list[tuple[int, torch.Tensor]] = []

    @property
    def size(self) -> int:
        """The number of tables ``T``."""
        return len(self.salts)

    def compatible(self, other: DynamicTableGroup) -> bool:
        """Whether ``other``'s tables can join this group's (same shape, rules, optimizer and storage)."""
        same_store = self.store is other.store or (type(self.store) is type(other.store) is RowStore) or (
            self.store.name == other.store.name == "fp16")            # stateless stores (fused8bit has an rng)
        return same_store and (self.dim, self.spec, self.optimizer) == (other.dim, other.spec, other.optimizer)

    # ---- maps ---------------------------------------------------------------------------------------
    def probe(self, tix: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Slots ``(k, M)`` of ids ``q`` ``(k, M)`` in tables ``tix`` ``(k,)`` (-1 where not admitted)."""
        k, m = q.shape
        return self.index.find(self.slot_id, tix.unsqueeze(1).expand(k, m).reshape(-1), q.reshape(-1)).view(k, m)

    def reindex(self, t: int) -> None:
        """Rebuild table ``t``'s map, LRU log and free slots from its ``slot_id`` and ``last_seen`` rows (after
        a restore or a restack)."""
        self.last_lookup = None
        self.rows[t] = int((self.slot_id[t] >= 0).sum())
        self.index.reindex(t, self.slot_id, self.last_seen)

    def map_of(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Table ``t``'s admitted ids ``(K,)`` sorted and their slots ``(K,)``."""
        occ = (self.slot_id[t] >= 0).nonzero().flatten()
        ids, order = torch.sort(self.slot_id[t, occ])
        return ids, occ[order]

    # ---- lookup ---------------------------------------------------------------------------------------
    def _expire(self, tix: torch.Tensor, tabs: list[int], step: torch.Tensor) -> None:
        assert self.spec.expire_steps is not None
        horizon = step - self.spec.expire_steps
        rows, slots = self.index.expired(tix, horizon, self.slot_id, self.last_seen)
        if rows.numel():
            t = tix[rows]
            self.slot_id.view(-1)[t * self.capacity + slots] = -1
            self.index.remove(t, slots)
            self.index.release(t, slots)
            self.index.maintain(self.slot_id)
            gone = torch.bincount(rows, minlength=tix.numel())
            self.counters[tix, _EXPIRED] += gone
            self.rows[tix] -= gone
        for r, tab in enumerate(tabs):
            ids, counts, seen = self.cands[tab]
            if ids.numel():
                keep = seen >= int(horizon[r])
                self.cands[tab] = [ids[keep], counts[keep], seen[keep]]

    def _take_slots(self, tabs: list[int], tix: torch.Tensor, want: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots ``(k, max want)`` for up to ``want[r]`` new rows of each table (free slots lowest first, then
        LRU victims not seen this step: oldest first, ties smallest id; the victims' map entries removed) and
        how many each table got ``(k,)``."""
        k = tix.numel()
        free = torch.minimum(self.capacity - self.rows[tix], want)
        parts = [self.index.take_free(tabs, tix, free)] if int(free.max()) > 0 else []
        width = parts[0].shape[1] if parts else 0
        self.rows[tix] += free
        need = want - free
        evicted = torch.zeros_like(want)
        if int(need.max()) > 0:
            victims, evicted = self.index.victims(tix, need, self.slot_id, self.last_seen)
            real = torch.arange(victims.shape[1]) < evicted.unsqueeze(1)
            self.index.remove(tix.unsqueeze(1).expand_as(victims)[real], victims[real])
            parts.append(victims)
            self.counters[tix, _EVICTIONS] += evicted
        got_n = free + evicted
        if not parts:
            return torch.zeros(k, 0, dtype=torch.int64), got_n
        both = torch.cat(parts, 1)
        j = torch.arange(int(want.max())).unsqueeze(0).expand(k, -1)
        col = torch.where(j < free.unsqueeze(1), j, width + j - free.unsqueeze(1)).clamp(0, both.shape[1] - 1)
        return both.gather(1, col), got_n

    def lookup(self, tabs: list[int], ids: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One step of each table ``tabs[r]`` (distinct) with ids ``ids[r]`` ``(N_r,)`` int64: expire, count,
        admit, answer. Returns rows ``(N_r, dim)`` float32 (zeros where not admitted) and slots ``(N_r,)``
        (-1 where not admitted) per table."""
        q, valid, lens = _pad(ids)
        rows, slot = self.lookup_padded(tabs, q, valid)
        if valid is None:
            return list(rows.unbind(0)), list(slot.unbind(0))
        return [rows[r, :n] for r, n in enumerate(lens)], [slot[r, :n] for r, n in enumerate(lens)]

    def lookup_padded(self, tabs: list[int], q: torch.Tensor, valid: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`lookup` of ids ``q`` ``(k, M)``, row ``r`` table ``tabs[r]``'s, real where ``valid``
        ``(k, M)`` (None: all). Returns rows ``(k, M, dim)`` and slots ``(k, M)`` (padding: zeros, -1)."""
        k, cap = len(tabs), self.capacity
        tix = torch.tensor(tabs, dtype=torch.int64)
        self.last_lookup = None
        self.step[tix] += 1
        step = self.step[tix]
        if self.spec.expire_steps is not None:
            self._expire(tix, tabs, step)
        if isinstance(self.index, NativeSlotIndex) and self.spec.min_count == 1 and not any(
                self.cands[t][0].numel() for t in tabs):
            return self._lookup_native(self.index, tabs, tix, step, q, valid)
        width = q.shape[1]
        sq, perm = torch.sort(q, dim=1)
        first = torch.ones_like(sq, dtype=torch.bool)
        first[:, 1:] = sq[:, 1:] != sq[:, :-1]
        if valid is not None:
            first &= valid
        flat = first.view(-1).nonzero().flatten()              # each distinct id probed once
        found = self.index.find(self.slot_id, tix.repeat_interleave(width)[flat], sq.view(-1)[flat])
        slot = torch.full_like(sq, -1).view(-1).index_put_((flat,), found).view(k, width)
        slot = slot.gather(1, torch.where(first, torch.arange(width), 0).cummax(1).values)
        if valid is not None:
            slot = torch.where(valid, slot, -1)
        known = slot >= 0
        base = (tix * cap).unsqueeze(1)
        self.last_seen.view(-1)[(slot + base)[known]] = step.unsqueeze(1).expand(k, width)[known]
        miss = first & ~known
        if bool(miss.any()):
            slot = self._admit(tabs, tix, step, sq, first, miss, slot, valid)
        seen = first & (slot >= 0)                               # this step's rows, ascending ids: to the log
        n = seen.sum(1)
        entries = torch.zeros(k, width + 1, dtype=torch.int64)
        entries.scatter_(1, torch.where(seen, seen.cumsum(1) - 1, width), step.unsqueeze(1) * cap + slot)
        self.index.append(tix, entries[:, :width], n, self.slot_id, self.last_seen)
        return self._answer(tabs, tix, q, valid, torch.empty_like(slot).scatter_(1, perm, slot))

    def _lookup_native(self, index: NativeSlotIndex, tabs: list[int], tix: torch.Tensor, step: torch.Tensor,
                       q: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`lookup_padded` after expiry for ``min_count == 1`` and tables without candidates: the id ->
        slot step in one compiled call (:meth:`NativeSlotIndex.lookup_ids`), fresh rows and the answer here."""
        out = index.lookup_ids(tabs, tix, q, valid, step, self.rows, self.counters, self.slot_id,
                                    self.last_seen)
        if out["glob"].numel():
            self._fresh_rows(out["glob"], out["ids"], self.row_keys[tix[out["row"]]])
        self.index.append(tix, out["entries"], out["n"], self.slot_id, self.last_seen)
        for r in (out["want"] > out["got"]).nonzero().flatten().tolist():   # ids left without a slot
            ids, counts = torch.unique(q[r][out["missed"][r]], return_counts=True)
            admitted = torch.arange(ids.numel()) < int(out["got"][r])
            self._settle(tabs[r], int(step[r]), ids, counts, torch.zeros_like(ids),
                         torch.zeros(ids.numel(), dtype=torch.bool), admitted)
        return self._answer(tabs, tix, q, valid, out["slot"])

    def _answer(self, tabs: list[int], tix: torch.Tensor, q: torch.Tensor, valid: torch.Tensor | None,
                slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``(k, M, dim)`` of slots ``(k, M)`` in ``q``'s order (zeros where -1, counted in ``rejected``)."""
        k, width = q.shape
        base = (tix * self.capacity).unsqueeze(1)
        hit = slot >= 0
        rows = self.store.gather(self.weight, torch.where(hit, slot + base, 0).view(-1)).view(k, width, self.dim)
        if not bool(hit.all()):
            rows[~hit] = 0.0
            lost = ~hit if valid is None else ~hit & valid
            self.counters[tix, _REJECTED] += lost.sum(1)
        self.last_lookup = (tabs, q.clone(), slot)
        return rows, slot

    def _admit(self, tabs: list[int], tix: torch.Tensor, step: torch.Tensor, sq: torch.Tensor,
               first: torch.Tensor, miss: torch.Tensor, slot: torch.Tensor, valid: torch.Tensor | None
               ) -> torch.Tensor:
        """Count and admit the ids first seen at ``miss`` (sorted rows ``sq``); the slots with theirs set."""
        k, width = sq.shape
        cols = torch.arange(width)
        group_start = torch.where(first, cols, 0).cummax(1).values       # each entry's first equal entry
        counts = None
        slow = [r for r, t in enumerate(tabs) if self.cands[t][0].numel()] if self.spec.min_count == 1 \
            else list(range(k))
        pending: dict[int, tuple] = {}
        inserts = miss.sum(1)
        if slow:
            counts = _occurrences(group_start, valid)
            reached = miss.clone()
            for r in slow:
                at = miss[r].nonzero().flatten()
                pend = sq[r, at]
                total, pos, found = self._count(tabs[r], pend, counts[r, at])
                reach = total >= self.spec.min_count
                reached[r, at] = reach
                inserts[r] -= int(found.sum())
                pending[r] = (at, pend, total, pos, found, reach)
        else:
            reached = miss
        self.counters[tix, _INSERTS] += inserts
        want = reached.sum(1)
        got = torch.zeros_like(want)
        if int(want.max()) > 0:
            width_r = int(want.max())
            new_slots, got = self._take_slots(tabs, tix, want)
            rank = reached.cumsum(1) - 1
            take = reached & (rank < got.unsqueeze(1))
            tr, tc = take.nonzero(as_tuple=True)
            new = torch.full((k, width_r), _MAX, dtype=torch.int64)
            new[tr, rank[tr, tc]] = sq[tr, tc]
            slot[tr, tc] = new_slots[tr, rank[tr, tc]]
            real = torch.arange(width_r) < got.unsqueeze(1)
            glob = (new_slots + (tix * self.capacity).unsqueeze(1))[real]
            fresh_ids = new[real]
            keys = self.row_keys[tix].unsqueeze(1).expand(k, width_r)[real]
            self._fresh_rows(glob, fresh_ids, keys)
            self.slot_id.view(-1)[glob] = fresh_ids
            self.index.insert(tix.unsqueeze(1).expand(k, width_r)[real], new_slots[real], fresh_ids)
            self.index.maintain(self.slot_id)
            self.last_seen.view(-1)[glob] = step.unsqueeze(1).expand(k, width_r)[real]
            self.counters[tix, _ADMITTED] += got
            slot = slot.gather(1, group_start)
            if valid is not None:
                slot = torch.where(valid, slot, -1)
        left = (want > got).nonzero().flatten().tolist()
        for r in left:                                   # ids without a slot become (or stay) candidates
            if r not in pending:
                if counts is None:
                    counts = _occurrences(group_start, valid)
                at = miss[r].nonzero().flatten()
                none = torch.zeros(at.numel(), dtype=torch.bool)
                pending[r] = (at, sq[r, at], counts[r, at], torch.zeros_like(at), none, none.logical_not())
        for r, (_, pend, total, pos, found, reach) in pending.items():
            admitted = reach & ((reach.cumsum(0) - 1) < int(got[r]))
            self._settle(tabs[r], int(step[r]), pend, total, pos, found, admitted)
        return slot

    def _fresh_rows(self, glob: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor) -> None:
        """Fresh rows and optimizer state at global slots ``glob`` ``(F,)`` for ``ids`` ``(F,)`` keyed ``keys``."""
        if self.changed is not None:   # tracked for deltas (scheduling.ps.changes)
            self.changed[glob] = True
            tab = torch.div(glob, self.capacity, rounding_mode="floor")
            self.admitted.extend((int(t), ids[tab == t].clone()) for t in torch.unique(tab).tolist())
        n = max(1, CHUNK_ELEMENTS // self.dim)                   # fresh rows in chunks: bounded temporaries
        for a in range(0, glob.numel(), n):
            lib = getattr(self.index, "lib", None)
            make = initial_rows_keyed if lib is None else partial(initial_rows_native, lib)
            self.weight.index_copy_(0, glob[a:a + n], self.store.encode(make(ids[a:a + n], keys[a:a + n],
                                                                             self.dim, self.bound)))
        fresh = self.optimizer.init_state(int(glob.numel()), self.dim)
        if self.state is not None and fresh is not None:
            self.state.index_copy_(0, glob, fresh)

    def _count(self, t: int, ids: torch.Tensor, counts: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Occurrences of table ``t``'s sorted unique non-admitted ``ids`` so far (this lookup's ``counts``
        included), the candidates' positions and whether each is one already."""
        cand_ids, cand_counts, _ = self.cands[t]
        if cand_ids.numel() == 0:
            return counts, torch.zeros_like(ids), torch.zeros(ids.numel(), dtype=torch.bool)
        pos, found = _find(cand_ids, ids)
        return counts + torch.where(found, cand_counts[pos], 0), pos, found

    def _settle(self, t: int, step: int, ids: torch.Tensor, total: torch.Tensor, pos: torch.Tensor,
                found: torch.Tensor, admitted: torch.Tensor) -> None:
        """Table ``t``'s candidates after a lookup: ``ids`` with their ``total`` counts, seen now, except those
        ``admitted`` (which leave)."""
        cand_ids, cand_counts, cand_seen = self.cands[t]
        if bool(found.any()):
            old = pos[found]
            cand_counts[old], cand_seen[old] = total[found], step
            gone = pos[found & admitted]
            if gone.numel():
                keep = torch.ones(cand_ids.numel(), dtype=torch.bool)
                keep[gone] = False
                cand_ids, cand_counts, cand_seen = cand_ids[keep], cand_counts[keep], cand_seen[keep]
        new = ~admitted & ~found
        if bool(new.any()):
            all_ids = torch.cat([cand_ids, ids[new]])
            order = torch.argsort(all_ids)
            cand_ids = all_ids[order]
            cand_counts = torch.cat([cand_counts, total[new]])[order]
            cand_seen = torch.cat([cand_seen, torch.full((int(new.sum()),), step, dtype=torch.int64)])[order]
        self.cands[t] = [cand_ids, cand_counts, cand_seen]

    # ---- push -----------------------------------------------------------------------------------------
    def push(self, tabs: list[int], ids: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> int:
        """Apply the optimizer to the rows of ``ids[r]`` ``(N_r,)`` of table ``tabs[r]`` (distinct) with
        ``grads[r]`` ``(N_r, dim)`` (repeated ids summed, in order); ids not admitted are dropped (counted in
        ``rejected``). Returns the number of rows updated."""
        q, valid, _ = _pad(ids)
        return self.push_padded(tabs, q, valid, torch.cat(list(grads)) if len(grads) > 1 else grads[0])

    def push_padded(self, tabs: list[int], q: torch.Tensor, valid: torch.Tensor | None, g: torch.Tensor) -> int:
        """:meth:`push` of ids ``q`` ``(k, M)`` (real where ``valid``, None: all) with gradients ``g``
        ``(n, dim)`` of the real ids in row-major order."""
        tix = torch.tensor(tabs, dtype=torch.int64)
        last = self.last_lookup
        if last is not None and last[0] == tabs and last[1].shape == q.shape and torch.equal(last[1], q):
            slot = last[2]
        else:
            slot = self.probe(tix, q)
        hit = slot >= 0
        glob = slot + (tix * self.capacity).unsqueeze(1)
        if hit.numel() and bool(hit.all()):                  # the common case: no padding, every id admitted
            flat, rows = glob.view(-1), g
        else:
            lost = ~hit if valid is None else ~hit & valid
            self.counters[tix, _REJECTED] += lost.sum(1)
            keep = hit.view(-1) if valid is None else hit[valid]
            if not bool(keep.any()):
                return 0
            flat, rows = glob[hit], g[keep]
        uniq, inverse = torch.unique(flat, return_inverse=True)
        summed = torch.zeros(uniq.numel(), self.dim).index_add_(0, inverse, rows.float())
        self.optimizer.step(self.weight, self.state, uniq, summed, self.store)
        if self.changed is not None:   # tracked for deltas (scheduling.ps.changes)
            self.changed[uniq] = True
        return int(uniq.numel())
