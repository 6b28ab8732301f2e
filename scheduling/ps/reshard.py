"""Resharding parameter-server checkpoints: the shards of ``N`` servers onto the layout of ``M`` servers.

A server's checkpoint (``PSServer.state_dict``, ``PSClient.server_states``, the files of ``PSClient.checkpoint``) is
``{"<namespace>/<table>@<first row>": {"spec", "weight", "state", "dynamic"}}``: each shard's float32 rows, its
row-wise optimizer state (Adagrad's accumulator, one per row; None for SGD) and, for a dynamic table
(:mod:`scheduling.ps.dynamic`), the whole table's state (id -> slot map, slots' rows and optimizer state, last-seen
steps, candidates, step and counters). Resharding is two pure steps:

1. :func:`gather_tables`: the ``N`` server states -> every table whole, per namespace (a row-wise table's blocks
   joined; each row must be on exactly one server);
2. :func:`scatter_tables`: whole tables -> ``M`` server states for a new layout (``{namespace: [ShardSpec]}``, e.g.
   the shards the placement pass chose for ``M`` servers, ``PSClient.shards``): each new shard gets its rows and
   their optimizer state; a dynamic table moves whole (its map, rows, state and counters as they were).

:func:`reshard` is both. Nothing is recomputed, so training continued on the new layout matches training continued
on the old one exactly, for ``fp32`` and ``fp16`` rows (``fp16`` rows are stored from their float32 values, which
re-encode to the same halves). ``fused8bit`` rows move as their decoded float32 values and are re-encoded on the new
server (what any restore from a checkpoint does), and its stochastic-rounding generator starts afresh there.

Source: torchrec's ``DistributedModelParallel`` checkpoint resharding (a state dict of whole tables, loaded under
another sharding plan: ``ShardedTensor`` re-scatter); Monolith (Liu et al. 2022) §2.1 for the dynamic tables' state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .shard_plan import ShardSpec, TableSpec

__all__ = ["gather_tables", "scatter_tables", "reshard", "layout_of", "format_moves"]


def _split_key(key: str, where: str) -> tuple[str, str]:
    namespace, sep, shard = key.rpartition("/")
    if not sep or not namespace:
        raise ValueError(f"{where}: shard key {key!r} is not '<namespace>/<table>@<first row>'")
    return namespace, shard


def gather_tables(states: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Every table whole, from the servers' states (``states[s]``: server ``s``'s ``PSServer.state_dict``).

    Returns:
        ``{namespace: {table name: {"spec": TableSpec, "weight": (N, D) float32, "state": (N,) or None, "dynamic":
        the dynamic table's state dict or None}}}`` (for a dynamic table ``N`` is its capacity and ``weight`` its
        slots' rows).

    Raises:
        ValueError: a key that is not a shard key, two shards of one table that disagree on its shape or kind, a
            row held by two servers, or rows that no server holds (each message names the table, its namespace
            and the servers).
    """
    specs: dict[tuple[str, str], TableSpec] = {}
    parts: dict[tuple[str, str], list[tuple[int, ShardSpec, dict[str, Any]]]] = {}
    for s, state in enumerate(states):
        for key, entry in state.items():
            namespace, _ = _split_key(key, f"server {s}")
            spec: ShardSpec = entry["spec"]
            table = spec.table
            have = specs.setdefault((namespace, table.name), table)
            if (have.num_embeddings, have.embedding_dim, have.dynamic) != (table.num_embeddings, table.embedding_dim,
                                                                          table.dynamic):
                raise ValueError(f"table {table.name!r} of {namespace!r}: server {s} holds it as "
                                 f"{table.num_embeddings} x {table.embedding_dim} (dynamic {table.dynamic}), another "
                                 f"server as {have.num_embeddings} x {have.embedding_dim} (dynamic {have.dynamic})")
            parts.setdefault((namespace, table.name), []).append((s, spec, dict(entry)))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (namespace, name), shards in parts.items():
        out.setdefault(namespace, {})[name] = _join(namespace, specs[(namespace, name)], shards)
    return out


def _join(namespace: str, table: TableSpec, shards: list[tuple[int, ShardSpec, dict[str, Any]]]) -> dict[str, Any]:
    """One table from its shards (sorted by first row), checking that they cover its rows exactly once."""
    shards = sorted(shards, key=lambda p: p[1].row_start)
    where = f"table {table.name!r} of {namespace!r}"
    if table.dynamic is not None or any(e.get("dynamic") is not None for _, _, e in shards):
        if len(shards) != 1:
            raise ValueError(f"{where}: a dynamic table is on servers {[s for s, _, _ in shards]}; it must be whole "
                             "on one server")
        _, spec, entry = shards[0]
        if entry.get("dynamic") is None:
            raise ValueError(f"{where}: a dynamic table's shard without its id -> slot map (a client's full-table "
                             "state, not a server's)")
        return {"spec": table, "weight": entry["weight"], "state": entry["state"], "dynamic": entry["dynamic"]}
    end = 0
    for s, spec, _ in shards:
        if spec.row_start != end:
            what = "held twice" if spec.row_start < end else "on no server"
            raise ValueError(f"{where}: rows [{min(end, spec.row_start)}, {max(end, spec.row_start)}) are {what} "
                             f"(server {s} holds [{spec.row_start}, {spec.row_end}))")
        end = spec.row_end
    if end != table.num_embeddings:
        raise ValueError(f"{where}: rows [{end}, {table.num_embeddings}) are on no server")
    weights = [e["weight"] for _, _, e in shards]
    states = [e["state"] for _, _, e in shards]
    if any(x is None for x in states) and not all(x is None for x in states):
        raise ValueError(f"{where}: some shards have optimizer state and some do not")
    return {"spec": table, "weight": weights[0] if len(weights) == 1 else torch.cat(weights),
            "state": None if states[0] is None else (states[0] if len(states) == 1 else torch.cat(states)),
            "dynamic": None}


def scatter_tables(tables: Mapping[str, Mapping[str, Mapping[str, Any]]], layout: Mapping[str, Sequence[ShardSpec]],
                   num_servers: int) -> list[dict[str, Any]]:
    """The server states of ``layout`` filled from whole tables (:func:`gather_tables`'s form).

    Args:
        tables: ``{namespace: {table name: {"spec", "weight" (N, D), "state" (N,) or None, "dynamic"}}}``.
        layout: ``{namespace: the new shards}``; a shard's ``server`` is its index in ``0 .. num_servers - 1``.
        num_servers: ``M``, the servers of the new layout.

    Returns:
        ``M`` dicts, ``PSServer.load_state_dict``'s input: ``{"<namespace>/<shard key>": {"spec", "weight" (R, D),
        "state" (R,) or None, "dynamic"}}`` (tensors are copies).

    Raises:
        ValueError: a namespace or table of ``layout`` that ``tables`` lacks, or one of ``tables`` that ``layout``
            would drop; another shape or kind (fixed / dynamic, capacity) than the checkpoint's; a dynamic table
            split over servers; a server index outside ``0 .. num_servers - 1``.
    """
    if num_servers < 1:
        raise ValueError(f"reshard: need at least one server, got {num_servers}")
    out: list[dict[str, Any]] = [{} for _ in range(num_servers)]
    for namespace, shards in layout.items():
        have = tables.get(namespace)
        if have is None:
            raise ValueError(f"reshard: the checkpoint has no tables of {namespace!r} (it has {sorted(tables)})")
        placed: dict[str, list[ShardSpec]] = {}
        for spec in shards:
            placed.setdefault(spec.table.name, []).append(spec)
        dropped = sorted(set(have) - set(placed))
        if dropped:
            raise ValueError(f"reshard: the new layout of {namespace!r} has no shard of tables {dropped}: their "
                             "rows would be lost")
        for name, specs in placed.items():
            for spec in specs:
                key, entry = _entry(namespace, spec, have.get(name), len(specs), num_servers)
                out[spec.server][key] = entry
    missing = sorted(set(tables) - set(layout))
    if missing:
        raise ValueError(f"reshard: the new layout has no shards of {missing}: their tables would be lost")
    return out


def _entry(namespace: str, spec: ShardSpec, src: Mapping[str, Any] | None, pieces: int,
           num_servers: int) -> tuple[str, dict[str, Any]]:
    table, where = spec.table, f"reshard: table {spec.table.name!r} of {namespace!r}"
    if src is None:
        raise ValueError(f"{where}: not in the checkpoint")
    old: TableSpec = src["spec"]
    if (old.num_embeddings, old.embedding_dim) != (table.num_embeddings, table.embedding_dim):
        raise ValueError(f"{where}: the checkpoint holds {old.num_embeddings} x {old.embedding_dim} rows, the new "
                         f"layout {table.num_embeddings} x {table.embedding_dim}")
    if old.dynamic != table.dynamic:
        raise ValueError(f"{where}: dynamic settings differ (checkpoint {old.dynamic}, new layout {table.dynamic})")
    if not 0 <= spec.server < num_servers:
        raise ValueError(f"{where}: server index {spec.server} outside 0 .. {num_servers - 1}")
    key = f"{namespace}/{spec.key}"
    if table.dynamic is not None:
        if pieces != 1 or (spec.row_start, spec.row_end) != (0, table.num_embeddings):
            raise ValueError(f"{where}: a dynamic table moves whole; the new layout splits it")
        return key, {"spec": spec, "weight": src["weight"].clone(),
                     "state": None if src["state"] is None else src["state"].clone(),
                     "dynamic": _clone(src["dynamic"])}
    rows = slice(spec.row_start, spec.row_end)
    return key, {"spec": spec, "weight": src["weight"][rows].clone(),
                 "state": None if src["state"] is None else src["state"][rows].clone(), "dynamic": None}


def _clone(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    return state


def reshard(states: Sequence[Mapping[str, Any]], layout: Mapping[str, Sequence[ShardSpec]],
            num_servers: int) -> list[dict[str, Any]]:
    """``N`` server states (``PSServer.state_dict``) -> the ``num_servers`` server states of ``layout``:
    :func:`scatter_tables` of :func:`gather_tables` (see the module docstring).

    Raises:
        ValueError: see :func:`gather_tables` and :func:`scatter_tables`.
    """
    return scatter_tables(gather_tables(states), layout, num_servers)


def layout_of(states: Sequence[Mapping[str, Any]]) -> dict[str, tuple[int, ...]]:
    """``{"<namespace>/<table>": the servers holding it}`` (sorted) of server states (``states[s]``: server ``s``).

    Raises:
        ValueError: a key that is not a shard key.
    """
    out: dict[str, set[int]] = {}
    for s, state in enumerate(states):
        for key, entry in state.items():
            namespace, _ = _split_key(key, f"server {s}")
            out.setdefault(f"{namespace}/{entry['spec'].table.name}", set()).add(s)
    return {k: tuple(sorted(v)) for k, v in sorted(out.items())}


def format_moves(before: Mapping[str, Sequence[str]], after: Mapping[str, Sequence[str]]) -> str:
    """One line per table, ``"  <table>  ps0 -> ps2"`` (``(stays)`` when unchanged; ``-`` where a side lacks it).

    >>> print(format_moves({"t_a": ["ps0"], "t_b": ["ps1"]}, {"t_a": ["ps0"], "t_b": ["ps2"]}))
      t_a  ps0 -> ps0  (stays)
      t_b  ps1 -> ps2
    """
    names = list(dict.fromkeys([*before, *after]))
    width = max((len(n) for n in names), default=0)
    lines = []
    for name in names:
        old, new = ",".join(before.get(name, ())) or "-", ",".join(after.get(name, ())) or "-"
        lines.append(f"  {name.ljust(width)}  {old} -> {new}" + ("  (stays)" if old == new else ""))
    return "\n".join(lines)
