"""Dynamic tables of one shape stacked, so a request's lookups and pushes run one set of ops for all of them.

A :class:`~scheduling.ps.dynamic.DynamicTable` is a handle on one row of a :class:`DynamicTableGroup`; the
group holds every table's state as stacked tensors (``T`` tables of ``C`` slots):

* ``weight`` ``(T * C, D)`` stored rows, ``state`` ``(T * C,)`` optimizer state (table ``t``'s slot ``s`` at
  row ``t * C + s``); ``slot_id`` ``(T, C)`` the id in each slot (-1 free); ``last_seen`` ``(T, C)`` steps;
* the id -> slot maps as ``keys`` ``(T, C)`` int64, each row sorted with its ``rows[t]`` admitted ids first
  and int64-max padding after, and ``slots`` ``(T, C)`` alongside; ``step`` ``(T,)``; ``counters`` ``(T, 5)``.

A lookup of ``k`` tables pads their ids to ``(k, M)``, sorts each row (``torch.sort(dim=1)``), probes the maps
with one batched ``torch.searchsorted``, picks LRU victims of all tables with one ``topk(dim=1)``, rebuilds the
maps with one scatter (each kept entry moved by the victims before it and the new ids before it, counted with
``scatter_add_`` + ``cumsum``: no sort), makes all fresh rows with one :func:`initial_rows_keyed` call and gathers
all rows with one ``index_select``: a constant number of tensor ops whatever ``k`` (per-op overhead, not
arithmetic, was the cost of one table at a time). A push of the ids the latest lookup answered reuses its slots.
Candidates (``min_count`` > 1, or ids left without a slot) stay per table. For large capacities the ops on whole
``(k, C)`` maps and the fresh rows run in chunks of :data:`CHUNK_ELEMENTS`, which bounds their temporaries. The
rules, and so every row, slot and counter, are those of one table at a time.

Source: Liu et al. 2022, "Monolith: Real Time Recommendation System With Collisionless Embedding Table"
(§2.1, §2.2); FBGEMM's table-batched embeddings (``SplitTableBatchedEmbeddingBagsCodegen``) batch the tables
of a rank for the same reason; Steele et al., OOPSLA 2014 (splitmix64).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from .optimizer import RowWiseOptimizer
from .storage import RowStore

__all__ = ["DynamicTableGroup", "initial_rows", "initial_rows_keyed", "mix64_torch", "row_key"]

_GOLDEN = 0x9E3779B97F4A7C15
_MAX = torch.iinfo(torch.int64).max
CHUNK_ELEMENTS = 1 << 18
"""Map entries per batch of the dense map ops (eviction, merge, expiry): 2 MiB per int64 temporary."""
COUNTERS = ("inserts", "admitted", "evictions", "expired", "rejected")
_INSERTS, _ADMITTED, _EVICTIONS, _EXPIRED, _REJECTED = range(5)


def _i64(c: int) -> int:
    """A 64-bit unsigned constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix64_torch(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (bits as uint64, wrapping), elementwise; any shape.

    Equals ``recsys.criteo_format.mix64(v, -1)`` bit for bit (that one adds the table salt first).
    """
    z = (z ^ _shr(z, 30)) * _i64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _i64(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


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
        self.keys = torch.full((t, cap + 1), _MAX, dtype=torch.int64)      # the last column: always padding
        self.slots = torch.zeros(t, cap + 1, dtype=torch.int64)
        self.rows = torch.zeros(t, dtype=torch.int64)
        self.step = torch.zeros(t, dtype=torch.int64)
        self.counters = torch.zeros(t, len(COUNTERS), dtype=torch.int64)
        empty = torch.empty(0, dtype=torch.int64)
        self.cands: list[list[torch.Tensor]] = [[empty, empty, empty] for _ in range(t)]  # ids, counts, seen
        self.lock = threading.Lock()
        self.last_lookup: tuple[list[int], torch.Tensor, torch.Tensor] | None = None
        """The latest lookup's ``(tabs, ids (k, M), slots (k, M))``, valid until the maps next change: a push of
        the same ids (no prefetch) reuses its slots instead of probing again."""

    @property
    def size(self) -> int:
        """The number of tables ``T``."""
        return len(self.salts)

    def compatible(self, other: DynamicTableGroup) -> bool:
        """Whether ``other``'s tables can join this group's (same shape, rules, optimizer and storage)."""
        same_store = self.store is other.store or (type(self.store) is type(other.store) is RowStore) or (
            self.store.name == other.store.name == "fp16")            # stateless stores (fused8bit has an rng)
        return same_store and (self.dim, self.spec, self.optimizer) == (other.dim, other.spec, other.optimizer)

    # ---- map rows -------------------------------------------------------------------------------------
    def _rows(self, tix: torch.Tensor, whole: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if whole:
            return self.keys, self.slots, self.rows
        return self.keys[tix], self.slots[tix], self.rows[tix]

    def _set_rows(self, tix: torch.Tensor, whole: bool, keys: torch.Tensor, slots: torch.Tensor,
                  rows: torch.Tensor) -> None:
        if whole:
            self.keys, self.slots, self.rows = keys, slots, rows
        else:
            self.keys[tix], self.slots[tix], self.rows[tix] = keys, slots, rows

    def _rebuild(self, tix: torch.Tensor, whole: bool, drop: torch.Tensor | None, new: torch.Tensor | None = None,
                 new_slots: torch.Tensor | None = None, n_new: torch.Tensor | None = None) -> None:
        """The map rows without the entries where ``drop`` ``(k, C + 1)`` is True and with sorted ``new`` ids
        ``(k, R)`` (first ``n_new[r]`` real, int64 max after; none mapped yet) and their slots: one scatter,
        each entry moved to its rank among the kept and new keys (no sort, no masked copies)."""
        keys, slots, rows = self._rows(tix, whole)
        k, width = keys.shape
        cols = torch.arange(width)
        live = cols < rows.unsqueeze(1)
        dest, kept = cols.unsqueeze(0), None
        if drop is not None:
            keep = ~drop
            live &= keep
            kept = keep.cumsum(1)                                # kept entries up to each one (inclusive)
            dest = kept - 1
        if new is not None and n_new is not None:
            pos = torch.searchsorted(keys, new)                  # new ids are in no map: pos[j] <= p iff new < key
            real = torch.arange(new.shape[1]) < n_new.unsqueeze(1)
            pos = torch.where(real, pos, width)
            before = torch.zeros(k, width + 1, dtype=torch.int64).scatter_add_(1, pos, torch.ones_like(pos))
            dest = dest + before.cumsum(1)[:, :width]
        out_keys = torch.full((k, width), _MAX, dtype=torch.int64)
        out_slots = torch.zeros(k, width, dtype=torch.int64)
        dest = torch.where(live, dest, width - 1)                # dropped entries and padding: the last column
        out_keys.scatter_(1, dest, keys)
        out_slots.scatter_(1, dest, slots)
        left = live.sum(1)
        if new is not None and new_slots is not None and n_new is not None:
            if kept is not None:                                 # kept entries before each insertion point
                pos = torch.cat([torch.zeros(k, 1, dtype=torch.int64), kept], 1).gather(1, pos)
            at = torch.where(real, pos + torch.arange(new.shape[1]), width - 1)
            out_keys.scatter_(1, at, new)
            out_slots.scatter_(1, at, new_slots)
            left = left + n_new
        out_keys[:, -1] = _MAX
        self._set_rows(tix, whole, out_keys, out_slots, left)

    def probe(self, tix: torch.Tensor, q: torch.Tensor, whole: bool = False) -> torch.Tensor:
        """Slots ``(k, M)`` of ids ``q`` ``(k, M)`` in tables ``tix`` ``(k,)`` (-1 where not admitted)."""
        keys, slots, rows = self._rows(tix, whole)
        pos = torch.searchsorted(keys, q)
        at = pos.clamp_max(self.capacity)
        found = (pos < rows.unsqueeze(1)) & (keys.gather(1, at) == q)
        return torch.where(found, slots.gather(1, at), -1)

    # ---- lookup ---------------------------------------------------------------------------------------
    def _expire(self, tix: torch.Tensor, tabs: list[int], step: torch.Tensor, whole: bool) -> None:
        assert self.spec.expire_steps is not None
        horizon = step - self.spec.expire_steps
        keys, slots, rows = self._rows(tix, whole)
        cap = self.capacity
        live = torch.arange(cap + 1) < rows.unsqueeze(1)
        base = (tix * cap).unsqueeze(1)
        old = live & (self.last_seen.view(-1)[(slots + base).clamp_max(self.size * cap - 1)] < horizon.unsqueeze(1))
        if bool(old.any()):
            self.slot_id.view(-1)[(slots + base)[old]] = -1
            self.counters[tix, _EXPIRED] += old.sum(1)
            for a, b, part in self._chunks(len(tabs), whole):
                self._rebuild(tix[a:b], part, old[a:b])
        for r, t in enumerate(tabs):
            ids, counts, seen = self.cands[t]
            if ids.numel():
                keep = seen >= int(horizon[r])
                self.cands[t] = [ids[keep], counts[keep], seen[keep]]

    def _chunks(self, k: int, whole: bool) -> list[tuple[int, int, bool]]:
        """Row ranges ``[a, b)`` of ``k`` tables for the ops on whole ``(k, C)`` maps, about
        :data:`CHUNK_ELEMENTS` entries each (bounds their temporaries for large capacities), and whether a
        range is the whole group."""
        rows = max(1, CHUNK_ELEMENTS // (self.capacity + 1))
        if k <= rows:
            return [(0, k, whole)]
        return [(a, min(k, a + rows), False) for a in range(0, k, rows)]

    def _take_slots(self, tix: torch.Tensor, whole: bool, step: torch.Tensor, want: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Slots ``(k, R)`` for up to ``want[r]`` new rows of each table (free slots lowest first, then LRU
        victims not seen this step: oldest first, ties smallest id), how many each table got ``(k,)``, and
        the victims' map entries ``(k, C + 1)`` (None without victims)."""
        keys, slots, rows = self._rows(tix, whole)
        k, cap = keys.shape[0], self.capacity
        cols = torch.arange(cap + 1)
        free = torch.minimum(cap - rows, want)
        width = int(free.max())
        parts = []
        if width > 0:
            sid = self.slot_id if whole else self.slot_id[tix]
            mask = sid < 0
            rank = mask.cumsum(1) - 1
            take = mask & (rank < free.unsqueeze(1))
            r, c = take.nonzero(as_tuple=True)
            got = torch.zeros(k, width, dtype=torch.int64)
            got[r, rank[r, c]] = c
            parts.append(got)
        need = want - free
        evicted, drop = torch.zeros_like(want), None
        if int(need.max()) > 0:
            seen = (self.last_seen if whole else self.last_seen[tix]).gather(1, slots)
            order = torch.add(cols, seen, alpha=cap)             # (last seen, id rank): unique, oldest first
            # padding entries (cap + 1 - rows a row) may rank anywhere, rows seen now after every victim: take
            # as many more, then keep the live ones not seen now
            n = min(int(need.max()) + cap + 1 - int(rows.min()), cap + 1)
            value, at = torch.topk(order, n, dim=1, largest=False, sorted=True)
            ok = (at < rows.unsqueeze(1)) & (value < (step * cap).unsqueeze(1))
            rank = ok.cumsum(1) - 1
            use = ok & (rank < need.unsqueeze(1))
            evicted = use.sum(1)
            victims = torch.zeros(k, n + 1, dtype=torch.int64)
            parts.append(victims.scatter_(1, torch.where(use, rank, n), slots.gather(1, at))[:, :n])
            drop = torch.zeros(k, cap + 1, dtype=torch.bool).scatter_(1, at, use)
            self.counters[tix, _EVICTIONS] += evicted
        got_n = free + evicted
        if not parts:
            return torch.zeros(k, 0, dtype=torch.int64), got_n, drop
        both = torch.cat(parts, 1)
        j = torch.arange(int(want.max())).unsqueeze(0).expand(k, -1)
        col = torch.where(j < free.unsqueeze(1), j, width + j - free.unsqueeze(1)).clamp(0, both.shape[1] - 1)
        return both.gather(1, col), got_n, drop

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
        whole = tabs == list(range(self.size))
        tix = torch.tensor(tabs, dtype=torch.int64)
        self.last_lookup = None
        self.step[tix] += 1
        step = self.step[tix]
        if self.spec.expire_steps is not None:
            self._expire(tix, tabs, step, whole)
        width = q.shape[1]
        sq, perm = torch.sort(q, dim=1)
        first = torch.ones_like(sq, dtype=torch.bool)
        first[:, 1:] = sq[:, 1:] != sq[:, :-1]
        if valid is not None:
            first &= valid
        slot = self.probe(tix, sq, whole)
        known = slot >= 0
        base = (tix * cap).unsqueeze(1)
        self.last_seen.view(-1)[(slot + base)[known]] = step.unsqueeze(1).expand(k, width)[known]
        miss = first & ~known
        if bool(miss.any()):
            slot = self._admit(tabs, tix, whole, step, sq, first, miss, slot, valid)
        slot = torch.empty_like(slot).scatter_(1, perm, slot)
        hit = slot >= 0
        rows = self.store.gather(self.weight, torch.where(hit, slot + base, 0).view(-1)).view(k, width, self.dim)
        if not bool(hit.all()):
            rows[~hit] = 0.0
            lost = ~hit if valid is None else ~hit & valid
            self.counters[tix, _REJECTED] += lost.sum(1)
        self.last_lookup = (tabs, q.clone(), slot)
        return rows, slot

    def _admit(self, tabs: list[int], tix: torch.Tensor, whole: bool, step: torch.Tensor, sq: torch.Tensor,
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
            valid_ = valid if valid is not None else torch.ones_like(first)
            flat = (group_start + (torch.arange(k) * width).unsqueeze(1))[valid_]
            counts = torch.bincount(flat, minlength=k * width).view(k, width)
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
            new_slots = torch.zeros(k, width_r, dtype=torch.int64)
            drops = []
            for a, b, part in self._chunks(k, whole):
                got_slots, got[a:b], drop = self._take_slots(tix[a:b], part, step[a:b], want[a:b])
                new_slots[a:b, :got_slots.shape[1]] = got_slots
                drops.append(drop)
            rank = reached.cumsum(1) - 1
            take = reached & (rank < got.unsqueeze(1))
            tr, tc = take.nonzero(as_tuple=True)
            new = torch.full((k, width_r), _MAX, dtype=torch.int64)
            new[tr, rank[tr, tc]] = sq[tr, tc]
            slot[tr, tc] = new_slots[tr, rank[tr, tc]]
            for (a, b, part), drop in zip(self._chunks(k, whole), drops):
                self._rebuild(tix[a:b], part, drop, new[a:b], new_slots[a:b], got[a:b])
            real = torch.arange(width_r) < got.unsqueeze(1)
            glob = (new_slots + (tix * self.capacity).unsqueeze(1))[real]
            fresh_ids = new[real]
            keys = self.row_keys[tix].unsqueeze(1).expand(k, width_r)[real]
            n = max(1, CHUNK_ELEMENTS // self.dim)               # fresh rows in chunks: bounded temporaries
            for a in range(0, glob.numel(), n):
                self.weight.index_copy_(0, glob[a:a + n], self.store.encode(
                    initial_rows_keyed(fresh_ids[a:a + n], keys[a:a + n], self.dim, self.bound)))
            fresh = self.optimizer.init_state(int(glob.numel()), self.dim)
            if self.state is not None and fresh is not None:
                self.state.index_copy_(0, glob, fresh)
            self.slot_id.view(-1)[glob] = fresh_ids
            self.last_seen.view(-1)[glob] = step.unsqueeze(1).expand(k, width_r)[real]
            self.counters[tix, _ADMITTED] += got
            slot = slot.gather(1, group_start)
            if valid is not None:
                slot = torch.where(valid, slot, -1)
        left = (want > got).nonzero().flatten().tolist()
        for r in left:                                   # ids without a slot become (or stay) candidates
            if r not in pending:
                if counts is None:
                    valid_ = valid if valid is not None else torch.ones_like(first)
                    flat = (group_start + (torch.arange(k) * width).unsqueeze(1))[valid_]
                    counts = torch.bincount(flat, minlength=k * width).view(k, width)
                at = miss[r].nonzero().flatten()
                none = torch.zeros(at.numel(), dtype=torch.bool)
                pending[r] = (at, sq[r, at], counts[r, at], torch.zeros_like(at), none, none.logical_not())
        for r, (_, pend, total, pos, found, reach) in pending.items():
            admitted = reach & ((reach.cumsum(0) - 1) < int(got[r]))
            self._settle(tabs[r], int(step[r]), pend, total, pos, found, admitted)
        return slot

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
            slot = self.probe(tix, q, tabs == list(range(self.size)))
        hit = slot >= 0
        lost = ~hit if valid is None else ~hit & valid
        self.counters[tix, _REJECTED] += lost.sum(1)
        glob = slot + (tix * self.capacity).unsqueeze(1)
        keep = hit.view(-1) if valid is None else hit[valid]
        if not bool(keep.any()):
            return 0
        uniq, inverse = torch.unique(glob[hit], return_inverse=True)
        summed = torch.zeros(uniq.numel(), self.dim).index_add_(0, inverse, g[keep].float())
        self.optimizer.step(self.weight, self.state, uniq, summed, self.store)
        return int(uniq.numel())
