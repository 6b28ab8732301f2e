"""A collisionless dynamic row store for a parameter server: raw 64-bit ids, rows made on first admission.

Fixed tables hash every id into ``num_embeddings`` rows (``recsys.criteo_format.hash_ids``), so ids collide.
A :class:`DynamicTable` instead keeps one row per admitted raw id, in a pool of ``capacity`` slots:

* **Admission by frequency.** An id not yet in the table is a *candidate*; lookups count its occurrences
  (every position of the id in the looked-up ids counts). When its count reaches ``min_count`` it is admitted
  in that lookup: it gets a slot and a fresh row. Until then a lookup answers zeros for it and a push to it is
  dropped; both are counted in ``rejected`` (lookups: positions, pushes: positions).
* **Fresh rows** are initialised as the fixed tables are (torchrec's default, uniform in ``(-b, b)`` with
  ``b = 1/sqrt(N)``, here ``N = capacity``), but each row from a counter-based generator keyed by
  ``(seed, salt, id, column)`` (splitmix64's finaliser, as ``recsys.criteo_format.mix64``): deterministic
  given the id and the seed, independent of the order ids arrive in, and reproducible by a local reference
  (:func:`initial_rows`).
* **Eviction: LRU.** With all ``capacity`` slots taken, admitting an id evicts the least recently looked-up
  row (smallest last-seen step, ties: smallest id) among those not looked up in the current lookup; its slot
  is reused (row re-initialised, optimizer state reset). An evicted id starts again as a new candidate. Ids
  that would need more slots than can be freed stay candidates (counted in ``rejected``).
* **Expiry** (optional): a row, or a candidate, not looked up for more than ``expire_steps`` steps is dropped
  at the start of the next lookup, and its slot freed. A *step* is one call of :meth:`DynamicTable.lookup`.

Pushes address rows by id, never by slot, so a push that arrives after its row was evicted (prefetch looks up
step ``t + 1`` before step ``t`` pushes) is dropped rather than applied to the slot's next owner.

Maps are vectorised with torch: the id -> slot map and the candidate counters are sorted int64 arrays probed
with ``torch.searchsorted`` (inserts and deletes re-sort: ``O(K log K)`` per lookup with ``K`` ids mapped).
Candidates are bounded only by expiry (no count-min sketch yet, unlike Monolith's probabilistic filter).

Source: Liu et al. 2022, "Monolith: Real Time Recommendation System With Collisionless Embedding Table"
(§2.1 collisionless hash table, §2.2 frequency filtering and expiry); Steele et al., OOPSLA 2014 (splitmix64).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .optimizer import RowWiseOptimizer
from .storage import RowStore

__all__ = ["DynamicSpec", "DynamicTable", "initial_rows", "mix64_torch", "table_salt", "lookup_tables"]

_GOLDEN = 0x9E3779B97F4A7C15


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


def initial_rows(ids: torch.Tensor, dim: int, bound: float, seed: int, salt: int = 0) -> torch.Tensor:
    """Fresh rows of raw ids: uniform in ``[-bound, bound)``, element ``(i, j)`` a function of
    ``(seed, salt, ids[i], j)`` only.

    Shapes: ids ``(N,)`` int64 -> ``(N, dim)`` float32.
    """
    key = mix64_torch(ids.long() + _i64((seed * 1_000_003 + salt + 1) * _GOLDEN % (1 << 64)))
    cols = torch.arange(1, dim + 1, dtype=torch.int64) * _i64(_GOLDEN)
    bits = _shr(mix64_torch(key.unsqueeze(1) + cols), 11)                    # 53 random bits
    unit = bits.double() * 2.0 ** -53                                         # [0, 1)
    return ((2.0 * unit - 1.0) * bound).float()


@dataclass(frozen=True)
class DynamicSpec:
    """How a dynamic table grows: ``capacity`` rows at most, admission after ``min_count`` occurrences,
    expiry after ``expire_steps`` lookups unseen (None: never)."""

    capacity: int
    min_count: int = 1
    expire_steps: int | None = None

    def __post_init__(self) -> None:
        """Raises:
            ValueError: ``capacity`` < 1, ``min_count`` < 1 or ``expire_steps`` < 1.
        """
        if self.capacity < 1 or self.min_count < 1 or (self.expire_steps is not None and self.expire_steps < 1):
            raise ValueError(f"dynamic table: capacity, min_count and expire_steps must be >= 1, got {self}")


def _find(keys: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of ``q`` in sorted ``keys`` and whether each is present. Shapes: ``(K,)``, ``(N,)``."""
    pos = torch.searchsorted(keys, q)
    found = pos < keys.numel()
    found[found.clone()] = keys[pos[found]] == q[found]
    return pos.clamp_max(max(keys.numel() - 1, 0)), found


def _merge(keys: torch.Tensor, values: torch.Tensor, new_keys: torch.Tensor,
           new_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted ``keys`` ``(K,)`` with sorted ``new_keys`` ``(n,)`` (none of them in ``keys``) merged, and their
    ``values`` alongside, without a sort: each key's place is its rank among the other array's keys."""
    pos = torch.searchsorted(keys, new_keys)
    new_at = pos + torch.arange(new_keys.numel())
    old_at = torch.arange(keys.numel()) + torch.bincount(pos, minlength=keys.numel() + 1).cumsum(0)[:keys.numel()]
    out_keys, out_values = keys.new_empty(keys.numel() + new_keys.numel()), values.new_empty(
        keys.numel() + new_keys.numel())
    out_keys[old_at], out_keys[new_at] = keys, new_keys
    out_values[old_at], out_values[new_at] = values, new_values
    return out_keys, out_values


class DynamicTable:
    """One dynamic embedding table of width ``dim`` (see the module docstring for the rules).

    Shapes: ``weight`` ``(capacity, dim)`` stored rows of ``store`` (float32 by default); ``slot_id``
    ``(capacity,)`` int64, the id in each slot (-1 free); ``last_seen`` ``(capacity,)`` int64 steps.
    """

    def __init__(self, dim: int, spec: DynamicSpec, optimizer: RowWiseOptimizer, *, seed: int = 0,
                 salt: int = 0, store: RowStore | None = None) -> None:
        self.dim, self.spec, self.optimizer, self.seed, self.salt = dim, spec, optimizer, seed, salt
        self.store = store or RowStore()
        self.bound = spec.capacity ** -0.5
        cap = spec.capacity
        self.weight = self.store.encode(torch.zeros(cap, dim))
        self.state = optimizer.init_state(cap, dim)
        self.slot_id = torch.full((cap,), -1, dtype=torch.int64)
        self.last_seen = torch.zeros(cap, dtype=torch.int64)
        self.map_ids = torch.empty(0, dtype=torch.int64)       # sorted admitted ids
        self.map_slots = torch.empty(0, dtype=torch.int64)     # their slots
        self.cand_ids = torch.empty(0, dtype=torch.int64)      # sorted candidate ids
        self.cand_counts = torch.empty(0, dtype=torch.int64)
        self.cand_seen = torch.empty(0, dtype=torch.int64)
        self.step = 0
        self.lock = threading.Lock()
        """Held by :func:`lookup_tables` and by the server around pushes and checkpoints."""
        self.counters = {"inserts": 0, "admitted": 0, "evictions": 0, "expired": 0, "rejected": 0}

    # ---- counters --------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """``rows`` (live), ``capacity``, ``candidates``, ``step``, and the running counters: ``inserts``
        (ids first seen as candidates), ``admitted`` (rows made), ``evictions`` (LRU), ``expired``,
        ``rejected`` (lookup and push positions of ids not admitted)."""
        return {"rows": int(self.map_ids.numel()), "capacity": self.spec.capacity,
                "candidates": int(self.cand_ids.numel()), "step": self.step, **self.counters}

    # ---- maps ------------------------------------------------------------------------------------------
    def slots_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id, -1 where not admitted. Shapes: ``(N,)`` int64 -> ``(N,)`` int64."""
        pos, found = _find(self.map_ids, ids)
        return torch.where(found, self.map_slots[pos] if self.map_ids.numel() else pos, -1)

    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows of ``ids`` without a step (no counting, admission or expiry): zeros where not
        admitted. Shapes: ``(N,)`` int64 -> ``(N, dim)`` float32."""
        slots = self.slots_of(ids.long())
        hit = slots >= 0
        rows = torch.zeros(ids.numel(), self.dim)
        if bool(hit.any()):
            rows[hit] = self.store.gather(self.weight, slots[hit])
        return rows

    def _drop_rows(self, slots: torch.Tensor) -> None:
        gone = torch.zeros(self.spec.capacity, dtype=torch.bool)
        gone[slots] = True
        keep = ~gone[self.map_slots]
        self.map_ids, self.map_slots = self.map_ids[keep], self.map_slots[keep]
        self.slot_id[slots] = -1

    def _expire(self) -> None:
        if self.spec.expire_steps is None:
            return
        horizon = self.step - self.spec.expire_steps
        old = self.map_slots[self.last_seen[self.map_slots] < horizon]
        if old.numel():
            self._drop_rows(old)
            self.counters["expired"] += int(old.numel())
        keep = self.cand_seen >= horizon
        self.cand_ids, self.cand_counts, self.cand_seen = \
            self.cand_ids[keep], self.cand_counts[keep], self.cand_seen[keep]

    def _count_candidates(self, ids: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor]:
        """Occurrences of sorted unique non-admitted ``ids`` so far, this lookup's ``counts`` included, with
        the candidates' positions and whether each is already one (the candidate arrays are not changed here:
        :meth:`_settle_candidates` does that once admission is known)."""
        if self.cand_ids.numel() == 0:
            return counts, torch.zeros_like(ids), torch.zeros(ids.numel(), dtype=torch.bool)
        pos, found = _find(self.cand_ids, ids)
        return counts + torch.where(found, self.cand_counts[pos], 0), pos, found

    def _settle_candidates(self, ids: torch.Tensor, total: torch.Tensor, pos: torch.Tensor, found: torch.Tensor,
                           admitted: torch.Tensor) -> None:
        """Candidates after a lookup: ``ids`` (sorted, unique, not admitted before it) with their ``total``
        counts and last-seen step, except those ``admitted`` now (bool, same order), which leave."""
        self.counters["inserts"] += int(ids.numel() - int(found.sum()))
        stay = ~admitted
        if bool(found.any()):
            old = pos[found]
            self.cand_counts[old], self.cand_seen[old] = total[found], self.step
            gone = pos[found & admitted]
            if gone.numel():
                keep = torch.ones(self.cand_ids.numel(), dtype=torch.bool)
                keep[gone] = False
                self.cand_ids, self.cand_counts, self.cand_seen = \
                    self.cand_ids[keep], self.cand_counts[keep], self.cand_seen[keep]
        new = stay & ~found
        if bool(new.any()):
            n = int(new.sum())
            all_ids = torch.cat([self.cand_ids, ids[new]])
            order = torch.argsort(all_ids)
            self.cand_ids = all_ids[order]
            self.cand_counts = torch.cat([self.cand_counts, total[new]])[order]
            self.cand_seen = torch.cat([self.cand_seen, torch.full((n,), self.step, dtype=torch.int64)])[order]

    def _free_slots(self, n: int) -> torch.Tensor:
        """Up to ``n`` slots for new rows: free slots (lowest first), then LRU evictions of rows not seen in
        this step (oldest last-seen first, ties: smallest id)."""
        free = (self.slot_id < 0).nonzero().flatten()[:n] if self.map_ids.numel() < self.spec.capacity \
            else self.map_ids.new_empty(0)
        need = n - free.numel()
        if need <= 0:
            return free
        used = self.map_slots[self.last_seen[self.map_slots] < self.step]   # in id order (the map is sorted)
        if used.numel() == 0:
            return free
        # oldest first, ties by id: (last seen, position in id order) is a unique key
        key = self.last_seen[used] * used.numel() + torch.arange(used.numel())
        victims = used[torch.topk(key, min(need, used.numel()), largest=False, sorted=True).indices]
        self._drop_rows(victims)
        self.counters["evictions"] += int(victims.numel())
        return torch.cat([free, victims])

    def _admit(self, ids: torch.Tensor) -> torch.Tensor:
        """Give sorted unique ``ids`` rows, as many as slots allow (smallest ids first); their slots."""
        slots = self._free_slots(ids.numel())
        ids = ids[:slots.numel()]
        if ids.numel() == 0:
            return slots
        self.weight.index_copy_(0, slots, self.store.encode(initial_rows(ids, self.dim, self.bound, self.seed,
                                                                          self.salt)))
        fresh = self.optimizer.init_state(ids.numel(), self.dim)
        if self.state is not None and fresh is not None:
            self.state.index_copy_(0, slots, fresh)
        self.slot_id[slots] = ids
        self.last_seen[slots] = self.step
        self.map_ids, self.map_slots = _merge(self.map_ids, self.map_slots, ids, slots)
        self.counters["admitted"] += int(ids.numel())
        return slots

    # ---- lookup and push -------------------------------------------------------------------------------
    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step: expire, count, admit, then answer the rows of ``ids``.

        Shapes: ids ``(N,)`` int64 raw ids -> rows ``(N, dim)`` float32 (zeros where not admitted) and slots
        ``(N,)`` int64 (-1 where not admitted).
        """
        self.step += 1
        self._expire()
        uniq, inverse, counts = torch.unique(ids.long(), return_inverse=True, return_counts=True)
        slots = self.slots_of(uniq)
        known = slots >= 0
        self.last_seen[slots[known]] = self.step
        if not bool(known.all()):
            where = (~known).nonzero().flatten()
            pending = uniq[where]
            total, pos, found = self._count_candidates(pending, counts[where])
            reached = total >= self.spec.min_count
            admitted = torch.zeros_like(reached)
            if bool(reached.any()):
                given = self._admit(pending[reached])
                chosen = reached.nonzero().flatten()[:given.numel()]
                admitted[chosen] = True
                slots[where[chosen]] = given
            self._settle_candidates(pending, total, pos, found, admitted)
        slots = slots[inverse]
        hit = slots >= 0
        rows = self.store.gather(self.weight, slots.clamp_min(0))
        if not bool(hit.all()):
            self.counters["rejected"] += int((~hit).sum())
            rows[~hit] = 0.0
        return rows, slots

    def push(self, ids: torch.Tensor, grads: torch.Tensor) -> int:
        """Apply the optimizer to the rows of ``ids`` (gradients of repeated ids summed); ids not admitted
        are dropped (counted in ``rejected``). Returns the number of rows updated.

        Shapes: ids ``(N,)`` int64 raw ids, grads ``(N, dim)`` float32.
        """
        slots = self.slots_of(ids.long())
        hit = slots >= 0
        self.counters["rejected"] += int((~hit).sum())
        if not bool(hit.any()):
            return 0
        uniq, inverse = torch.unique(slots[hit], return_inverse=True)
        summed = torch.zeros(uniq.numel(), self.dim).index_add_(0, inverse, grads[hit].float())
        self.optimizer.step(self.weight, self.state, uniq, summed, self.store)
        return int(uniq.numel())

    # ---- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a restart needs: the id -> slot map, float32 rows, optimizer state, last-seen steps,
        candidates, step and counters (tensors cloned)."""
        return {"map_ids": self.map_ids.clone(), "map_slots": self.map_slots.clone(),
                "weight": self.store.decode(self.weight).clone(),
                "state": None if self.state is None else self.state.clone(),
                "slot_id": self.slot_id.clone(), "last_seen": self.last_seen.clone(),
                "cand_ids": self.cand_ids.clone(), "cand_counts": self.cand_counts.clone(),
                "cand_seen": self.cand_seen.clone(), "step": self.step, "counters": dict(self.counters),
                "capacity": self.spec.capacity, "dim": self.dim, "seed": self.seed, "salt": self.salt}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output.

        Raises:
            ValueError: the checkpoint's capacity or width differs from this table's, or it is no dynamic
                table's state (e.g. rows without the id -> slot map, as a ``PSClient.state_dict`` has).
        """
        if "map_ids" not in state:
            raise ValueError("not a dynamic table's state (no id -> slot map): restore dynamic tables from the "
                             "servers' checkpoints (PSServer.state_dict / save), not from a client's full tables")
        if (state["capacity"], state["dim"]) != (self.spec.capacity, self.dim):
            raise ValueError(f"dynamic table checkpoint has capacity {state['capacity']} and dim {state['dim']}, "
                             f"this table {self.spec.capacity} and {self.dim}")
        self.map_ids, self.map_slots = state["map_ids"].clone(), state["map_slots"].clone()
        self.weight = self.store.encode(state["weight"].clone())
        self.state = None if state["state"] is None else state["state"].clone()
        self.slot_id, self.last_seen = state["slot_id"].clone(), state["last_seen"].clone()
        self.cand_ids, self.cand_counts = state["cand_ids"].clone(), state["cand_counts"].clone()
        self.cand_seen, self.step = state["cand_seen"].clone(), int(state["step"])
        self.counters = dict(state["counters"])
        self.seed, self.salt = int(state.get("seed", self.seed)), int(state.get("salt", self.salt))


def table_salt(name: str) -> int:
    """A stable 63-bit salt of a table name (blake2b), so two dynamic tables never share fresh rows."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1


def lookup_tables(requests: Sequence[tuple[DynamicTable | None, torch.Tensor]]) -> list[torch.Tensor | None]:
    """Rows of each request's ids, one :meth:`DynamicTable.lookup` (one step) per table for all its
    requests together (a table read by several features still advances one step per batch); None for
    requests without a table.

    Shapes: each ids ``(N_i,)`` int64 -> rows ``(N_i, dim)`` float32.
    """
    out: list[torch.Tensor | None] = [None] * len(requests)
    tables: dict[int, list[int]] = {}
    for i, (table, _) in enumerate(requests):
        if table is not None:
            tables.setdefault(id(table), []).append(i)
    for members in tables.values():
        table = requests[members[0]][0]
        assert table is not None
        with table.lock:
            rows, _ = table.lookup(torch.cat([requests[i][1] for i in members]))
        for i, part in zip(members, rows.split([requests[i][1].numel() for i in members])):
            out[i] = part
    return out
