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

Maps are vectorised with torch: tables of one shape on a server share a
:class:`~scheduling.ps.dynamic_group.DynamicTableGroup` (stacked tensors; a table is a handle on one of its
rows), so one request's lookups and pushes of all its dynamic tables run one set of tensor ops
(:func:`lookup_tables`, :func:`push_tables`, :func:`group_tables`). The id -> slot maps are hash tables, LRU order an
append-only log (:mod:`scheduling.ps.dynamic_index`): a step costs work in its ids, not in ``capacity``; compiled
kernels run them where a C++ compiler is found (:mod:`scheduling.ps.dynamic_native`; ``FXDIST_NATIVE=0``: torch). Candidates are bounded only by expiry (no
count-min sketch yet, unlike Monolith's probabilistic filter).

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

from .dynamic_group import COUNTERS, DynamicTableGroup, initial_rows, mix64_torch, row_key
from .optimizer import RowWiseOptimizer
from .storage import RowStore

__all__ = ["DynamicSpec", "DynamicTable", "initial_rows", "mix64_torch", "table_salt", "lookup_tables",
           "push_tables", "group_tables"]

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


class DynamicTable:
    """One dynamic embedding table of width ``dim`` (see the module docstring for the rules): a handle on row
    :attr:`index` of its :attr:`group` (its own group of one until :func:`group_tables` stacks it with others).

    Shapes: ``weight`` ``(capacity, dim)`` stored rows of ``store`` (float32 by default); ``slot_id``
    ``(capacity,)`` int64, the id in each slot (-1 free); ``last_seen`` ``(capacity,)`` int64 steps (views of
    the group's tensors).
    """

    def __init__(self, dim: int, spec: DynamicSpec, optimizer: RowWiseOptimizer, *, seed: int = 0,
                 salt: int = 0, store: RowStore | None = None) -> None:
        self.dim, self.spec, self.optimizer = dim, spec, optimizer
        self.store = store or RowStore()
        self.bound = spec.capacity ** -0.5
        self.group = DynamicTableGroup(dim, spec, optimizer, self.store, [seed], [salt])
        self.index = 0

    # ---- views of the group's state ----------------------------------------------------------------------
    @property
    def seed(self) -> int:
        """The seed of this table's fresh rows."""
        return self.group.seeds[self.index]

    @property
    def salt(self) -> int:
        """The salt of this table's fresh rows (:func:`table_salt`)."""
        return self.group.salts[self.index]

    @property
    def lock(self) -> threading.Lock:
        """The group's lock: held by :func:`lookup_tables` and :func:`push_tables`, and by the server around
        checkpoints."""
        return self.group.lock

    @property
    def weight(self) -> torch.Tensor:
        """The stored rows ``(capacity, dim)`` (a view)."""
        cap = self.spec.capacity
        return self.group.weight[self.index * cap:(self.index + 1) * cap]

    @property
    def state(self) -> torch.Tensor | None:
        """The optimizer state ``(capacity,)`` (a view), None for a stateless optimizer."""
        cap, st = self.spec.capacity, self.group.state
        return None if st is None else st[self.index * cap:(self.index + 1) * cap]

    @property
    def slot_id(self) -> torch.Tensor:
        """The id in each slot ``(capacity,)``, -1 where free (a view)."""
        return self.group.slot_id[self.index]

    @property
    def last_seen(self) -> torch.Tensor:
        """The step each slot was last looked up ``(capacity,)`` (a view)."""
        return self.group.last_seen[self.index]

    @property
    def map_ids(self) -> torch.Tensor:
        """The admitted ids ``(K,)``, sorted."""
        return self.group.map_of(self.index)[0]

    @property
    def map_slots(self) -> torch.Tensor:
        """The slots ``(K,)`` of :attr:`map_ids`."""
        return self.group.map_of(self.index)[1]

    @property
    def cand_ids(self) -> torch.Tensor:
        """The candidate ids ``(K',)``, sorted; ``cand_counts`` and ``cand_seen`` alongside."""
        return self.group.cands[self.index][0]

    @property
    def cand_counts(self) -> torch.Tensor:
        """Occurrences of each candidate so far ``(K',)``."""
        return self.group.cands[self.index][1]

    @property
    def cand_seen(self) -> torch.Tensor:
        """The step each candidate was last looked up ``(K',)``."""
        return self.group.cands[self.index][2]

    @property
    def step(self) -> int:
        """Lookups so far."""
        return int(self.group.step[self.index])

    @property
    def counters(self) -> dict[str, int]:
        """The running counters (see :meth:`stats`)."""
        return dict(zip(COUNTERS, self.group.counters[self.index].tolist()))

    # ---- counters --------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """``rows`` (live), ``capacity``, ``candidates``, ``step``, and the running counters: ``inserts``
        (ids first seen as candidates), ``admitted`` (rows made), ``evictions`` (LRU), ``expired``,
        ``rejected`` (lookup and push positions of ids not admitted)."""
        return {"rows": int(self.group.rows[self.index]), "capacity": self.spec.capacity,
                "candidates": int(self.cand_ids.numel()), "step": self.step, **self.counters}

    # ---- maps ------------------------------------------------------------------------------------------
    def slots_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id, -1 where not admitted. Shapes: ``(N,)`` int64 -> ``(N,)`` int64."""
        return self.group.probe(torch.tensor([self.index]), ids.long().view(1, -1))[0]

    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows of ``ids`` without a step (no counting, admission or expiry): zeros where not
        admitted. Shapes: ``(N,)`` int64 -> ``(N, dim)`` float32."""
        slots = self.slots_of(ids.long())
        hit = slots >= 0
        rows = torch.zeros(ids.numel(), self.dim)
        if bool(hit.any()):
            rows[hit] = self.store.gather(self.weight, slots[hit])
        return rows

    # ---- lookup and push -------------------------------------------------------------------------------
    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step: expire, count, admit, then answer the rows of ``ids``.

        Shapes: ids ``(N,)`` int64 raw ids -> rows ``(N, dim)`` float32 (zeros where not admitted) and slots
        ``(N,)`` int64 (-1 where not admitted).
        """
        rows, slots = self.group.lookup([self.index], [ids])
        return rows[0], slots[0]

    def push(self, ids: torch.Tensor, grads: torch.Tensor) -> int:
        """Apply the optimizer to the rows of ``ids`` (gradients of repeated ids summed); ids not admitted
        are dropped (counted in ``rejected``). Returns the number of rows updated.

        Shapes: ids ``(N,)`` int64 raw ids, grads ``(N, dim)`` float32.
        """
        return self.group.push([self.index], [ids], [grads])

    # ---- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a restart needs: the id -> slot map, float32 rows, optimizer state, last-seen steps,
        candidates, step and counters (tensors cloned)."""
        state = self.state
        map_ids, map_slots = self.group.map_of(self.index)
        return {"map_ids": map_ids, "map_slots": map_slots,
                "weight": self.store.decode(self.weight).clone(),
                "state": None if state is None else state.clone(),
                "slot_id": self.slot_id.clone(), "last_seen": self.last_seen.clone(),
                "cand_ids": self.cand_ids.clone(), "cand_counts": self.cand_counts.clone(),
                "cand_seen": self.cand_seen.clone(), "step": self.step, "counters": self.counters,
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
        g, i = self.group, self.index
        self.weight.copy_(self.store.encode(state["weight"]))
        own = self.state
        if own is not None and state["state"] is not None:
            own.copy_(state["state"])
        self.slot_id.copy_(state["slot_id"])
        self.last_seen.copy_(state["last_seen"])
        g.cands[i] = [state["cand_ids"].clone(), state["cand_counts"].clone(), state["cand_seen"].clone()]
        g.step[i] = int(state["step"])
        g.counters[i] = torch.tensor([int(state["counters"][k]) for k in COUNTERS])
        g.seeds[i], g.salts[i] = int(state.get("seed", self.seed)), int(state.get("salt", self.salt))
        g.row_keys[i] = row_key(g.seeds[i], g.salts[i])
        g.reindex(i)


def table_salt(name: str) -> int:
    """A stable 63-bit salt of a table name (blake2b), so two dynamic tables never share fresh rows."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1


def group_tables(tables: Sequence[DynamicTable]) -> list[DynamicTableGroup]:
    """Stack tables of one shape, rules, optimizer and storage into shared groups (state copied as stored,
    bit for bit); each table then views its group's tensors and shares its lock. Returns the groups made.
    Callers holding a table's ``weight``, ``state`` or ``lock`` must take them again."""
    buckets: list[list[DynamicTable]] = []
    for table in dict.fromkeys(tables):                      # unique, in order
        for bucket in buckets:
            if bucket[0].group.compatible(table.group):
                bucket.append(table)
                break
        else:
            buckets.append([table])
    groups = []
    for bucket in buckets:
        if len({id(t.group) for t in bucket}) == 1 and bucket[0].group.size == len(bucket):
            groups.append(bucket[0].group)                   # already exactly this group
            continue
        first = bucket[0]
        seeds, salts = [t.seed for t in bucket], [t.salt for t in bucket]
        # fresh tables hold nothing to copy: drop their old groups before the stack is allocated (no 2x peak)
        old: list[tuple[DynamicTableGroup, int] | None] = [None if _fresh(t) else (t.group, t.index) for t in bucket]
        for table in bucket:
            del table.group
        group = DynamicTableGroup(first.dim, first.spec, first.optimizer, first.store, seeds, salts)
        cap = first.spec.capacity
        for j, table in enumerate(bucket):
            source, old[j] = old[j], None                   # each old group freed once its tables moved
            if source is not None:
                g, i = source
                group.weight[j * cap:(j + 1) * cap] = g.weight[i * cap:(i + 1) * cap]
                if group.state is not None and g.state is not None:
                    group.state[j * cap:(j + 1) * cap] = g.state[i * cap:(i + 1) * cap]
                for name in ("slot_id", "last_seen", "step", "counters"):
                    getattr(group, name)[j] = getattr(g, name)[i]
                group.cands[j] = list(g.cands[i])
                group.reindex(j)
                del g, source
            table.group, table.index = group, j
        groups.append(group)
    return groups


def _fresh(table: DynamicTable) -> bool:
    """Whether a table is as made (no step, row, candidate or count): its state is a new group's."""
    g, i = table.group, table.index
    return int(g.step[i]) == 0 and int(g.rows[i]) == 0 and g.cands[i][0].numel() == 0 and not bool(
        g.counters[i].any())


def _by_group(tables: Sequence[DynamicTable]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, table in enumerate(tables):
        out.setdefault(id(table.group), []).append(i)
    return out


def lookup_tables(requests: Sequence[tuple[DynamicTable | None, torch.Tensor]]) -> list[torch.Tensor | None]:
    """Rows of each request's ids, one step per table for all its requests together (a table read by several
    features still advances one step per batch), all tables of a group in one batched lookup; None for
    requests without a table.

    Shapes: each ids ``(N_i,)`` int64 -> rows ``(N_i, dim)`` float32.
    """
    out: list[torch.Tensor | None] = [None] * len(requests)
    members: dict[DynamicTable, list[int]] = {}
    for i, (table, _) in enumerate(requests):
        if table is not None:
            members.setdefault(table, []).append(i)
    tables = list(members)
    for idx in _by_group(tables).values():
        group = tables[idx[0]].group
        ids = [torch.cat([requests[i][1] for i in members[tables[j]]]) if len(members[tables[j]]) > 1
               else requests[members[tables[j]][0]][1] for j in idx]
        with group.lock:
            rows, _ = group.lookup([tables[j].index for j in idx], ids)
        for j, part in zip(idx, rows):
            mine = members[tables[j]]
            for i, p in zip(mine, part.split([requests[i][1].numel() for i in mine]) if len(mine) > 1 else [part]):
                out[i] = p
    return out


def push_tables(requests: Sequence[tuple[DynamicTable | None, torch.Tensor, torch.Tensor]]) -> int:
    """:meth:`DynamicTable.push` of each ``(table, ids (N_i,), grads (N_i, dim))`` (distinct tables; None
    tables skipped), all tables of a group in one batched push under its lock. Returns the number of rows
    updated."""
    touched = 0
    tables = [t for t, _, _ in requests if t is not None]
    requests = [r for r in requests if r[0] is not None]
    for idx in _by_group(tables).values():
        group = tables[idx[0]].group
        with group.lock:
            touched += group.push([tables[j].index for j in idx], [requests[j][1] for j in idx],
                                  [requests[j][2] for j in idx])
    return touched
