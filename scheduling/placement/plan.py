"""The sharding plan of :func:`scheduling.parameter_servers`: which server holds which embedding table.

Rule (deterministic, from table sizes and the number of servers ``N``):

1. A table's size is its float32 weight, ``rows * dim * 4`` bytes (the servers store float32).
2. Every table is placed *table-wise*, largest first, each on the server holding the fewest bytes so far
   (ties to the lower index): the greedy "longest processing time" balance.
3. While the fullest server holds more than ``(1 + tolerance)`` times the fair share ``total_bytes / N``, the
   largest table still placed table-wise, if it has at least ``row_wise_min_bytes`` (1 MiB), becomes *row-wise* (rows cut into ``N`` contiguous blocks, block ``i``
   on server ``i``, as :func:`scheduling.ps.plan_shards`) and step 2 is redone for the rest. So small tables
   stay whole (one lookup request each) and a table too large to balance is spread over every server.
4. ``overrides`` (``{table: "table_wise" | "row_wise" | server index}``) win over rules 2 and 3; an index pins a
   table-wise table to that server.

Before that, :func:`split_local` takes out the modules that stay on the trainer (``"local"``): those the overrides
keep there (a module moves as a whole, so every table of a multi-table module must be named, or the module), and,
with ``local_below_rows > 0``, those whose tables all have fewer rows and that no override places.

Source: torchrec's planner (``EmbeddingShardingPlanner``: ``TABLE_WISE`` / ``ROW_WISE`` sharding types, the
plan printed as a table of shards, ranks and storage); Graham 1969 (LPT greedy balancing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..ps.dynamic import DynamicSpec
from ..ps.shard_plan import ShardSpec, TableSpec, plan_shards

__all__ = ["TableInfo", "TablePlacement", "plan_tables", "split_local", "shards_of", "format_plan", "FLOAT32_BYTES",
           "LOCAL"]

FLOAT32_BYTES = 4
LOCAL = "local"
"""The placement value that keeps a table on the trainer (its module stays in the model: a DDP parameter)."""


@dataclass(frozen=True)
class TableInfo:
    """One embedding table found in the user's model."""

    spec: TableSpec
    """The table as the servers see it (name unique within its module's client)."""
    module: str
    """Qualified name of the module holding it (e.g. ``sparse_arch.embedding_bag_collection``)."""
    path: str
    """State-dict prefix of its weight in the user's model (``<path>.weight``)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the float32 weight, ``rows * dim * 4``."""
        return self.spec.num_embeddings * self.spec.embedding_dim * FLOAT32_BYTES

    def matches(self, key: str) -> bool:
        """Whether an override key names this table: its table name, weight path, or module (single-table)."""
        return key in (self.spec.name, self.path, self.module)


@dataclass(frozen=True)
class TablePlacement:
    """Where one table goes."""

    table: TableInfo
    """The table."""
    sharding: str
    """``"table_wise"`` or ``"row_wise"``."""
    servers: tuple[int, ...]
    """Server indices holding a part of it (one for table-wise)."""
    reason: str
    """Why: ``"override"``, ``"large"`` (over the row-wise threshold) or ``"balanced"``."""


def _check_overrides(tables: Sequence[TableInfo], overrides: Mapping[str, Any], num_servers: int) -> dict[int, Any]:
    """Override per table index; raises ValueError on unknown keys or values."""
    out: dict[int, Any] = {}
    for key, value in overrides.items():
        hits = [i for i, t in enumerate(tables) if t.matches(key)]
        if not hits:
            known = ", ".join(sorted({t.spec.name for t in tables} | {t.path for t in tables}))
            raise ValueError(f"parameter_servers: plan names table {key!r}, which is not among the tables moved "
                             f"to the servers ({known})")
        ok = value in ("table_wise", "row_wise") or (isinstance(value, int) and not isinstance(value, bool)
                                                     and 0 <= value < num_servers)
        if not ok:
            raise ValueError(f"parameter_servers: plan[{key!r}] = {value!r}; use 'table_wise', 'row_wise', 'local' "
                             f"or a server index 0..{num_servers - 1}")
        for i in hits:
            out[i] = value
    return out


def split_local(modules: Mapping[str, Sequence[TableInfo]], overrides: Mapping[str, Any] | None,
                local_below_rows: int = 0, staying: Sequence[str] = ()) -> tuple[dict[str, str], dict[str, Any]]:
    """Which modules stay on the trainer, and the overrides left for :func:`plan_tables`.

    Args:
        modules: module path -> its tables (the movable modules, in graph order).
        overrides: the plan, ``{table name | weight path | module: "local" | "table_wise" | "row_wise" | index}``.
        local_below_rows: modules whose tables all have fewer rows stay local when no override names one of
            their tables (0: none).
        staying: modules that stay local anyway (the pass cannot move them): a ``"local"`` key may name them.

    Returns:
        ``({module: why it stays, e.g. "20 rows < local_below_rows=32" or "plan['pos'] = 'local'"}, the other
        overrides)``.

    Raises:
        ValueError: a ``"local"`` key names no table, or only some tables of a module (it moves as a whole).
    """
    overrides = dict(overrides or {})
    rest = {k: v for k, v in overrides.items() if v != LOCAL}
    named: dict[str, dict[str, str]] = {}  # module -> {table path: the key keeping it local}
    for key in (k for k, v in overrides.items() if v == LOCAL):
        hits = {q: [t.path for t in ts if t.matches(key)] for q, ts in modules.items()}
        hits = {q: paths for q, paths in hits.items() if paths}
        if not hits and not any(key == m or key.startswith(f"{m}.") for m in staying):
            known = ", ".join(sorted({t.spec.name for ts in modules.values() for t in ts}
                                     | {t.path for ts in modules.values() for t in ts}))
            raise ValueError(f"parameter_servers: plan[{key!r}] = 'local' names no embedding table of the model "
                             f"({known})")
        for q, paths in hits.items():
            named.setdefault(q, {}).update(dict.fromkeys(paths, key))
    local: dict[str, str] = {}
    for q, keys in named.items():
        missing = [t.path for t in modules[q] if t.path not in keys]
        if missing:
            raise ValueError(f"parameter_servers: plan keeps {', '.join(sorted(keys))} of module '{q}' local but not "
                             f"{', '.join(missing)}: a module moves as a whole; name the module ({q} = 'local') to "
                             "keep all its tables on the trainer")
        local[q] = f"plan[{next(iter(keys.values()))!r}] = 'local'"
    for q, ts in modules.items():
        rows = max(t.spec.num_embeddings for t in ts)
        placed = any(t.matches(key) for t in ts for key in rest)
        if q not in local and not placed and rows < local_below_rows:
            local[q] = f"{rows} rows < local_below_rows={local_below_rows}" if len(ts) == 1 else (
                f"{len(ts)} tables of at most {rows} rows < local_below_rows={local_below_rows}")
    return {q: local[q] for q in modules if q in local}, rest


def plan_tables(tables: Sequence[TableInfo], num_servers: int,
                overrides: Mapping[str, Any] | None = None, tolerance: float = 0.1,
                row_wise_min_bytes: int = 1 << 20) -> list[TablePlacement]:
    """Choose table-wise or row-wise sharding and the servers of every table (see the module docstring).

    Args:
        tables: the tables, in graph order.
        num_servers: servers in the group (>= 1).
        overrides: ``{table name | weight path | module name: "table_wise" | "row_wise" | server index}``.
        tolerance: accepted excess of the fullest server over the fair share ``total_bytes / N`` (0.1: 10%).
        row_wise_min_bytes: smaller tables are never made row-wise automatically (a row-wise table costs one
            request per server and lookup; below this size the imbalance is cheaper).

    Returns:
        One placement per table, in the order of ``tables``.

    Raises:
        ValueError: ``num_servers < 1``, or an override names no table or has a bad value.
    """
    if num_servers < 1:
        raise ValueError(f"parameter_servers: need at least one server, got {num_servers}")
    forced = _check_overrides(tables, overrides or {}, num_servers)
    fair = sum(t.nbytes for t in tables) / num_servers
    row_wise = {i for i, v in forced.items() if v == "row_wise"}
    while True:
        placements = _assign(tables, num_servers, forced, row_wise)
        if max(server_bytes(placements, num_servers)) <= fair * (1 + tolerance):
            return placements
        large = [i for i, p in enumerate(placements) if i not in forced and p.sharding == "table_wise"
                 and tables[i].spec.num_embeddings >= num_servers and tables[i].nbytes >= row_wise_min_bytes
                 and tables[i].spec.dynamic is None]
        if not large:
            return placements
        row_wise.add(max(large, key=lambda i: (tables[i].nbytes, -i)))


def _assign(tables: Sequence[TableInfo], num_servers: int, forced: Mapping[int, Any],
            row_wise: set[int]) -> list[TablePlacement]:
    """Row-wise tables and pinned ones first, then the rest table-wise, largest first, to the emptiest server."""
    load = [0] * num_servers
    placed: dict[int, TablePlacement] = {}
    for i in sorted(row_wise):
        shards = plan_shards([tables[i].spec], num_servers, "row_wise")
        for sp in shards:
            load[sp.server] += sp.num_rows * sp.table.embedding_dim * FLOAT32_BYTES
        placed[i] = TablePlacement(tables[i], "row_wise", tuple(sp.server for sp in shards),
                                   "override" if i in forced else "large")
    for i, choice in forced.items():
        if isinstance(choice, int) and not isinstance(choice, bool):
            load[choice] += tables[i].nbytes
            placed[i] = TablePlacement(tables[i], "table_wise", (choice,), "override")
    rest = sorted((i for i in range(len(tables)) if i not in placed), key=lambda i: -tables[i].nbytes)
    for i in rest:
        server = min(range(num_servers), key=lambda s: (load[s], s))
        load[server] += tables[i].nbytes
        placed[i] = TablePlacement(tables[i], "table_wise", (server,), "override" if i in forced else "balanced")
    return [placed[i] for i in range(len(tables))]


def with_dynamic(tables: Mapping[str, list[tuple[TableInfo, Any]]], dynamic: Mapping[str, Mapping[str, Any]] | None
                 ) -> dict[str, list[tuple[TableInfo, Any]]]:
    """``tables`` (module -> (table, weight) pairs) with the tables ``dynamic`` names (``{table name | weight
    path | module: {"capacity", "min_count", "expire_steps"}}``) made dynamic: raw ids, ``capacity`` rows
    (:mod:`scheduling.ps.dynamic`); they are always placed table-wise.

    Raises:
        ValueError: a key names no table, or a bad or missing setting (``capacity`` is required).
    """
    dynamic = dict(dynamic or {})
    used: set[str] = set()
    out: dict[str, list[tuple[TableInfo, Any]]] = {}
    for module, pairs in tables.items():
        out[module] = []
        for t, w in pairs:
            key = next((k for k in dynamic if t.matches(k)), None)
            if key is not None:
                try:
                    spec = DynamicSpec(**dynamic[key])
                except TypeError as e:
                    raise ValueError(f"parameter_servers: dynamic[{key!r}]: {e}") from None
                used.add(key)
                t = TableInfo(replace(t.spec, num_embeddings=spec.capacity, dynamic=spec), t.module, t.path)
            out[module].append((t, w))
    if set(dynamic) - used:
        raise ValueError(f"parameter_servers: dynamic names no table: {sorted(set(dynamic) - used)}")
    return out


def shards_of(placement: TablePlacement, num_servers: int) -> list[ShardSpec]:
    """The :class:`~scheduling.ps.ShardSpec` list realising one placement."""
    spec = placement.table.spec
    if placement.sharding == "row_wise":
        return plan_shards([spec], num_servers, "row_wise")
    return [ShardSpec(spec, placement.servers[0], 0, spec.num_embeddings)]


def server_bytes(placements: Sequence[TablePlacement], num_servers: int) -> list[int]:
    """Bytes of float32 weights each server holds under ``placements``."""
    load = [0] * num_servers
    for p in placements:
        for sp in shards_of(p, num_servers):
            load[sp.server] += sp.num_rows * sp.table.embedding_dim * FLOAT32_BYTES
    return load


def format_plan(placements: Sequence[TablePlacement], server_names: Sequence[str], header: str) -> str:
    """The plan as a text table (like torchrec's planner output): one row per table, then bytes per server.

    >>> user = TableInfo(TableSpec("t_user", 100_000, 8, ("user",)), "ebc", "ebc.embedding_bags.t_user")
    >>> item = TableInfo(TableSpec("t_item", 1_000, 8, ("item",)), "ebc", "ebc.embedding_bags.t_item")
    >>> print(format_plan(plan_tables([user, item], 2), ["ps0", "ps1"], "plan"))
    plan
      table   module  rows x dim  sharding    server(s)  bytes
      t_user  ebc     100000 x 8  row_wise    ps0,ps1    3200000
      t_item  ebc     1000 x 8    table_wise  ps0        32000
      bytes per server: ps0 1632000, ps1 1600000
    """
    rows = [("table", "module", "rows x dim", "sharding", "server(s)", "bytes")]
    for p in placements:
        spec = p.table.spec
        rows.append((spec.name, p.table.module, f"{spec.num_embeddings} x {spec.embedding_dim}", p.sharding,
                     ",".join(server_names[s] for s in p.servers), str(p.table.nbytes)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [header] + ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    load = server_bytes(placements, len(server_names))
    lines.append("  bytes per server: " + ", ".join(f"{n} {b}" for n, b in zip(server_names, load)))
    return "\n".join(lines)
