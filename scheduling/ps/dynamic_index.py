"""The per-step indexes of a :class:`~scheduling.ps.dynamic_group.DynamicTableGroup`, each costing work in the
number of ids a step touches, not in the tables' capacity.

For ``T`` tables of ``C`` slots whose ids are ``slot_id`` ``(T, C)`` (-1 free) and last-seen steps
``last_seen`` ``(T, C)`` (both the group's, passed in, the single source of truth):

* **id -> slot: an open-addressing hash table** per table, ``hslot`` ``(T, H)`` int32 with ``H`` the power of
  two >= ``2 C``: each entry a slot (-1 empty, -2 deleted), its key read from ``slot_id`` (so an entry costs 4
  bytes); linear probing from ``splitmix64(id) mod H``, run as vectorised rounds over the ids still probing.
  ``hpos`` ``(T, C)`` is each occupied slot's entry, so removing a row is one write. A table is rehashed
  (O(C)) once its deleted entries pass ``H / 4``, i.e. after at least ``C / 2`` removals: amortized O(1).
* **LRU order: an append-only log** per table, ``log`` ``(T, L)`` of ``step * C + slot`` entries, each
  lookup appending the slots it saw in ascending id order. An entry is live iff its slot is occupied and
  ``last_seen[slot]`` is its step, so the live entries from ``head`` on are the occupied rows by (last seen,
  id): LRU victims and expired rows are the first live entries, found by scanning from ``head`` (stale entries
  are skipped once, for good). A table's log is compacted (its live entries kept, O(C)) when it fills ``L``
  (about ``1.5 C``): amortized O(1) per appended entry.
* **Free slots**: every slot at or above ``high[t]`` was never used; ``freed[t]`` holds the sorted free slots
  below it (left by expiry or a restored checkpoint), so "lowest free slot first" never scans the slots.

Source: Knuth, "The Art of Computer Programming" Vol. 3, §6.4 (open addressing, linear probing, deletion
marks); the log is the queue of an LRU cache with lazy deletion (O'Neil et al., SIGMOD 1993, "The LRU-K page
replacement algorithm", §2); Steele et al., OOPSLA 2014 (splitmix64's finaliser).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["SlotIndex", "mix64_torch"]

EMPTY, DELETED = -1, -2
WINDOW = 8
"""Hash entries probed per round (one gather of ``(n, WINDOW)``): fewer rounds of per-op overhead."""
_STEPS = torch.arange(WINDOW)
CHUNK = 1 << 15
"""Ids probed per batch of :meth:`SlotIndex.find`: bounds its ``(n, WINDOW)`` temporaries (2 MiB each)."""


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


class SlotIndex:
    """Hash table, LRU log and free slots of ``tables`` tables of ``capacity`` slots (module docstring)."""

    native = False
    """Whether the compiled kernels run it (:class:`~scheduling.ps.dynamic_native.NativeSlotIndex`)."""

    def __init__(self, tables: int, capacity: int) -> None:
        cap = capacity
        self.capacity = cap
        self.hsize = 1 << max(1, (2 * cap - 1).bit_length())
        self.hslot = torch.full((tables, self.hsize), EMPTY, dtype=torch.int32)
        self.hpos = torch.zeros(tables, cap, dtype=torch.int32)
        self.deleted = torch.zeros(tables, dtype=torch.int64)
        self.log = torch.zeros(tables, cap + cap // 2 + 1024, dtype=torch.int64)
        self.head = torch.zeros(tables, dtype=torch.int64)
        self.tail = torch.zeros(tables, dtype=torch.int64)
        self.high = torch.zeros(tables, dtype=torch.int64)
        self.freed = [torch.empty(0, dtype=torch.int64) for _ in range(tables)]

    # ---- hash table -----------------------------------------------------------------------------------
    def find(self, slot_id: torch.Tensor, tix: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Slots ``(n,)`` of ids ``q`` ``(n,)`` in tables ``tix`` ``(n,)``, -1 where not admitted."""
        if q.numel() > CHUNK:
            return torch.cat([self._find(slot_id, tix[a:a + CHUNK], q[a:a + CHUNK])
                              for a in range(0, q.numel(), CHUNK)])
        return self._find(slot_id, tix, q)

    def _find(self, slot_id: torch.Tensor, tix: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        h, cap = self.hsize, self.capacity
        out = torch.full_like(q, -1)
        hs, sid = self.hslot.view(-1), slot_id.view(-1)
        idx = torch.arange(q.numel())
        base, sbase = tix * h, tix * cap
        pos = mix64_torch(q) & (h - 1)
        while idx.numel():                                   # WINDOW entries a round
            cur = hs[base.unsqueeze(1) + ((pos.unsqueeze(1) + _STEPS) & (h - 1))].long()
            hit = (cur >= 0) & (sid[sbase.unsqueeze(1) + cur.clamp_min(0)] == q.unsqueeze(1))
            stop = hit | (cur == EMPTY)
            first = stop.int().argmax(1)
            ends = stop.any(1)
            at = cur.gather(1, first.unsqueeze(1)).squeeze(1)
            found = ends & hit.gather(1, first.unsqueeze(1)).squeeze(1)
            out[idx[found]] = at[found]
            go = ~ends
            if not bool(go.any()):
                break
            idx, q, base, sbase, pos = idx[go], q[go], base[go], sbase[go], (pos[go] + WINDOW) & (h - 1)
        return out

    def insert(self, tix: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """Enter ids ``(n,)`` (in no table's map yet, distinct per table) at ``slots`` ``(n,)`` of ``tix``."""
        h, cap = self.hsize, self.capacity
        hs = self.hslot.view(-1)
        pos = mix64_torch(ids) & (h - 1)
        while tix.numel():
            near = (pos.unsqueeze(1) + _STEPS) & (h - 1)
            cur = hs[(tix * h).unsqueeze(1) + near]
            free = cur < 0
            some = free.any(1)
            j = free.int().argmax(1)
            pos = torch.where(some, near.gather(1, j.unsqueeze(1)).squeeze(1), (pos + WINDOW) & (h - 1))
            at = tix * h + pos
            was = cur.gather(1, j.unsqueeze(1)).squeeze(1)
            # one id per empty entry, the last asking: claims written into the entries themselves (< -2)
            claim = -3 - torch.arange(tix.numel(), dtype=torch.int32)
            hs.scatter_reduce_(0, at[some], claim[some], "amin")
            win = some & (hs[at] == claim)
            hs[at[win]] = slots[win].int()
            self.deleted.index_add_(0, tix[win], (was[win] == DELETED).long().neg())
            self.hpos.view(-1)[tix[win] * cap + slots[win]] = pos[win].int()
            keep = ~win                                      # losers retry from the same entry, now taken
            tix, slots, pos = tix[keep], slots[keep], pos[keep]

    def remove(self, tix: torch.Tensor, slots: torch.Tensor) -> None:
        """Delete the map entries of occupied ``slots`` ``(n,)`` of tables ``tix`` ``(n,)``."""
        pos = self.hpos.view(-1)[tix * self.capacity + slots].long()
        self.hslot.view(-1)[tix * self.hsize + pos] = DELETED
        self.deleted.index_add_(0, tix, torch.ones_like(tix))

    def maintain(self, slot_id: torch.Tensor) -> None:
        """Rehash the tables with over ``H / 4`` deleted entries (amortized over their removals)."""
        for t in (self.deleted > self.hsize // 4).nonzero().flatten().tolist():
            self._rehash(t, slot_id)

    def _rehash(self, t: int, slot_id: torch.Tensor) -> None:
        """Table ``t``'s hash table built anew in one pass: occupied slots stably sorted by home entry, each placed at
        ``max(home, previous + 1)`` (a ``cummax``), those past the end moved to the front (linear probing wraps)."""
        h = self.hsize
        occ = (slot_id[t] >= 0).nonzero().flatten()
        home, order = torch.sort(mix64_torch(slot_id[t, occ]) & (h - 1), stable=True)
        rest, wrapped = occ[order], occ[:0]
        while True:
            homes = torch.cat([torch.zeros_like(wrapped), home])
            i = torch.arange(homes.numel())
            pos = i + torch.cummax(homes - i, 0).values if homes.numel() else homes
            over = int((pos >= h).sum())
            if not over:
                break
            wrapped = torch.cat([wrapped, rest[rest.numel() - over:]])
            rest, home = rest[:rest.numel() - over], home[:home.numel() - over]
        slots = torch.cat([wrapped, rest])
        self.hslot[t] = EMPTY
        self.hslot[t, pos] = slots.int()
        self.hpos[t, slots] = pos.int()
        self.deleted[t] = 0

    # ---- LRU log --------------------------------------------------------------------------------------
    def _entries(self, tix: torch.Tensor, width: int, slot_id: torch.Tensor, last_seen: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The ``width`` log entries from each table's head: steps, slots ``(k, width)``, in the log, live."""
        length, cap = self.log.shape[1], self.capacity
        pos = self.head[tix].unsqueeze(1) + torch.arange(width)
        inb = pos < self.tail[tix].unsqueeze(1)
        e = self.log.view(-1)[(tix * length).unsqueeze(1) + pos.clamp_max(length - 1)]
        step, slot = e // cap, e % cap
        at = (tix * cap).unsqueeze(1) + slot
        live = inb & (last_seen.view(-1)[at] == step) & (slot_id.view(-1)[at] >= 0)
        return step, slot, inb, live

    def victims(self, tix: torch.Tensor, need: torch.Tensor, slot_id: torch.Tensor, last_seen: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to ``need[r]`` LRU victims of each table ``tix[r]``: the first live log entries (rows of the
        current lookup have none yet: their entries are stale until appended). Returns slots ``(k, max need)``
        oldest first and how many each table got ``(k,)``; the head moves past them (they are evicted)."""
        k = tix.numel()
        out = torch.zeros(k, int(need.max()) + 1, dtype=torch.int64)
        got = torch.zeros(k, dtype=torch.int64)
        rem = need.clone()
        while True:
            act = (rem > 0) & (self.head[tix] < self.tail[tix])
            if not bool(act.any()):
                break
            width = 2 * int(rem.max()) + 32
            _, slot, inb, live = self._entries(tix, width, slot_id, last_seen)
            live &= act.unsqueeze(1)
            rank = live.cumsum(1)
            take = live & (rank <= rem.unsqueeze(1))
            r, c = take.nonzero(as_tuple=True)
            out[r, got[r] + rank[r, c] - 1] = slot[r, c]
            n = take.sum(1)
            last = torch.where(take, torch.arange(width), -1).max(1).values
            done = act & (n == rem)
            ahead = torch.where(done, last + 1, torch.where(act, inb.sum(1), 0))
            self.head[tix] += ahead
            got += n
            rem -= n
        return out[:, :-1], got

    def expired(self, tix: torch.Tensor, horizon: torch.Tensor, slot_id: torch.Tensor, last_seen: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The occupied slots last seen before ``horizon[r]`` of tables ``tix[r]``, as flat ``(rows of tix,
        slots)`` ``(n,)`` each (log entries are in step order: those are a prefix, which the head leaves)."""
        rows, slots, width = [], [], 256
        while True:
            step, slot, inb, live = self._entries(tix, width, slot_id, last_seen)
            old = inb & (step < horizon.unsqueeze(1))
            r, c = (old & live).nonzero(as_tuple=True)
            rows.append(r)
            slots.append(slot[r, c])
            ahead = old.sum(1)
            self.head[tix] += ahead
            if not bool((ahead == width).any()):
                break
            width *= 2
        return torch.cat(rows), torch.cat(slots)

    def append(self, tix: torch.Tensor, entries: torch.Tensor, n: torch.Tensor, slot_id: torch.Tensor,
               last_seen: torch.Tensor) -> None:
        """Append the first ``n[r]`` of ``entries`` ``(k, W)`` (``step * C + slot``) to table ``tix[r]``'s log."""
        if bool((self.tail[tix] + n > self.log.shape[1]).any()):
            for t in tix[self.tail[tix] + n > self.log.shape[1]].tolist():
                self._compact(t, slot_id, last_seen)
            over = int((self.tail[tix] + n).max())
            if over > self.log.shape[1]:
                grown = torch.zeros(self.log.shape[0], max(over, 2 * self.log.shape[1]), dtype=torch.int64)
                grown[:, :self.log.shape[1]] = self.log
                self.log = grown
        length = self.log.shape[1]
        real = torch.arange(entries.shape[1]) < n.unsqueeze(1)
        at = (tix * length + self.tail[tix]).unsqueeze(1) + torch.arange(entries.shape[1])
        self.log.view(-1)[at[real]] = entries[real]
        self.tail[tix] += n

    def _compact(self, t: int, slot_id: torch.Tensor, last_seen: torch.Tensor) -> None:
        cap = self.capacity
        e = self.log[t, int(self.head[t]):int(self.tail[t])]
        slot = e % cap
        keep = e[(last_seen[t, slot] == e // cap) & (slot_id[t, slot] >= 0)]
        self.log[t, :keep.numel()] = keep
        self.head[t], self.tail[t] = 0, keep.numel()

    # ---- free slots -----------------------------------------------------------------------------------
    def take_free(self, tabs: Sequence[int], tix: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """The ``n[r]`` lowest free slots of each table ``tabs[r]`` (``tix`` the same as a tensor), as
        ``(k, max n)`` (zeros after ``n[r]``); they stop being free."""
        width = int(n.max())
        cols = torch.arange(width)
        out = self.high[tix].unsqueeze(1) + cols
        for r, t in enumerate(tabs):
            f = self.freed[t]
            if f.numel() and int(n[r]):
                a = min(int(n[r]), f.numel())
                out[r, :a] = f[:a]
                out[r, a:] = self.high[t] + torch.arange(width - a)
                self.freed[t] = f[a:]
                n = n.clone()
                n[r] -= a
        self.high[tix] += n
        return out

    def release(self, tix: torch.Tensor, slots: torch.Tensor) -> None:
        """Slots ``(n,)`` of tables ``tix`` ``(n,)`` become free (all below their table's ``high``)."""
        for t in torch.unique(tix).tolist():
            self.freed[t] = torch.sort(torch.cat([self.freed[t], slots[tix == t]])).values

    # ---- whole tables ---------------------------------------------------------------------------------
    def reindex(self, t: int, slot_id: torch.Tensor, last_seen: torch.Tensor) -> None:
        """Rebuild table ``t``'s indexes from its ``slot_id`` and ``last_seen`` rows (a restore, a restack)."""
        occ = (slot_id[t] >= 0).nonzero().flatten()
        self.high[t] = int(occ[-1]) + 1 if occ.numel() else 0
        self.freed[t] = (slot_id[t, :int(self.high[t])] < 0).nonzero().flatten()
        by_id = occ[torch.argsort(slot_id[t, occ], stable=True)]
        order = by_id[torch.argsort(last_seen[t, by_id], stable=True)]
        self.log[t, :order.numel()] = last_seen[t, order] * self.capacity + order
        self.head[t], self.tail[t] = 0, order.numel()
        self._rehash(t, slot_id)
