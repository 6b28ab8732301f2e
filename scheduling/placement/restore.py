"""Checkpoints of the moved tables that any number of servers can restore (resharding on restore).

:func:`table_checkpoint` reads every table the ``parameter_servers`` pass moved, whole, under the model's state-dict
names: ``"<path>.weight"`` ``(N, D)``, ``"<path>.momentum"`` ``(N,)`` (row-wise Adagrad's accumulator, when the
optimizer has one) and, for a dynamic table, ``"<path>.dynamic"`` (its id -> slot map, rows, optimizer state and
counters: :meth:`scheduling.ps.dynamic.DynamicTable.state_dict`). Nothing in it says which server held what.

:func:`load_table_checkpoint` writes such a checkpoint to the servers of a model that went through the pass again,
on any number of servers: the pass placed every table by its rule for *those* servers, and each table's rows,
optimizer state and dynamic map go to the shards it chose (:func:`scheduling.ps.reshard.scatter_tables`). Restore
on ``M`` servers what ``N`` servers saved, and training continues exactly as it would have on the ``N``.

:func:`table_layout` says which server holds each table, and :func:`replan` where the pass's rule puts the same
tables on other servers (a plan's before and after). :func:`track_table_changes` and :func:`table_changes` give the
rows the servers changed since the previous call, under the same names (a model's deltas, :mod:`scheduling.ps.changes`).

Source: torchrec ``DistributedModelParallel`` (a whole-table state dict restored under another sharding plan).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..ps.reshard import gather_tables, scatter_tables

__all__ = ["table_checkpoint", "load_table_checkpoint", "table_layout", "replan", "track_table_changes",
           "table_changes"]


def _meta(gm: Any) -> dict[str, Any]:
    from .after import _placement_meta

    return _placement_meta(gm)


def _per_client(meta: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Client name -> the placement records of the tables it serves."""
    out: dict[str, list[dict[str, Any]]] = {}
    for qualname, name in meta["clients"].items():
        out.setdefault(name, []).extend(t for t in meta["tables"] if t["module"] == qualname)
    return out


def table_checkpoint(gm: Any) -> dict[str, Any]:
    """Every moved table of ``gm`` (a GraphModule after the pass, or a DDP around one), whole: ``"<path>.weight"``
    ``(N, D)`` float32, ``"<path>.momentum"`` ``(N,)`` when the optimizer keeps state, ``"<path>.dynamic"`` (a dict)
    for a dynamic table. Waits this trainer's pushes first.

    Raises:
        ValueError: ``gm`` has no tables on parameter servers.
    """
    from ..ps.client import get_client

    out: dict[str, Any] = {}
    for name, records in _per_client(_meta(gm)).items():
        tables = gather_tables(get_client(name).server_states()).get(name, {})
        for t in records:
            src = tables[t["table"]]
            out[f"{t['path']}.weight"] = src["weight"]
            if src["state"] is not None:
                out[f"{t['path']}.momentum"] = src["state"]
            if src["dynamic"] is not None:
                out[f"{t['path']}.dynamic"] = src["dynamic"]
    return out


def track_table_changes(gm: Any) -> None:
    """Every server of ``gm``'s moved tables starts (again) recording the rows it changes in them
    (:meth:`scheduling.ps.client.PSClient.track_changes`); :func:`table_changes` reads them.

    Raises:
        ValueError: ``gm`` has no tables on parameter servers.
    """
    from ..ps.client import get_client

    for name in _per_client(_meta(gm)):
        get_client(name).track_changes()


def table_changes(gm: Any) -> dict[str, dict[str, Any]]:
    """The rows of ``gm``'s moved tables that the servers changed since :func:`track_table_changes` or the previous
    call (only those rows travel), under the model's state-dict names: ``"<path>.weight"``: ``{"rows": (K,) int64,
    "values": (K, D) float32}`` (a dynamic table's rows are its slots) and, for a dynamic table, ``"<path>.dynamic"``:
    ``{"ids", "slots"}`` ``(K',)`` int64 (ids now at slots whose id changed) and ``"evicted"`` ``(E,)`` (ids no
    longer held). Clears the servers' records. Waits this trainer's pushes first.

    Raises:
        ValueError: ``gm`` has no tables on parameter servers, or a server does not track them.
    """
    from ..ps.client import get_client

    out: dict[str, dict[str, Any]] = {}
    for name, records in _per_client(_meta(gm)).items():
        changes = get_client(name).take_changes()
        for t in records:
            got = changes.get(t["table"])
            if got is None:
                continue
            out[f"{t['path']}.weight"] = {"rows": got["rows"], "values": got["values"]}
            if "ids" in got:
                out[f"{t['path']}.dynamic"] = {k: got[k] for k in ("ids", "slots", "evicted")}
    return out


def load_table_checkpoint(gm: Any, state: Mapping[str, Any]) -> None:
    """Write a :func:`table_checkpoint` (made on any number of servers) to the servers of ``gm``, in the layout its
    pass chose; ``"<path>.momentum"`` absent: that table's optimizer state is left as the pass made it.

    Raises:
        KeyError: a moved table's ``"<path>.weight"``, or a dynamic table's ``"<path>.dynamic"``, is missing (the
            message lists the keys).
        ValueError: a weight's shape differs from the table's; ``gm`` has no tables on parameter servers.
    """
    from ..ps.client import get_client

    for name, records in _per_client(_meta(gm)).items():
        client = get_client(name)
        specs = {sp.table.name: sp.table for sp in client.shards}
        current = gather_tables(client.server_states()).get(name, {}) if any(
            f"{t['path']}.momentum" not in state for t in records) else {}
        tables: dict[str, dict[str, Any]] = {}
        for t in records:
            key, spec = f"{t['path']}.weight", specs[t["table"]]
            if key not in state:
                raise KeyError(f"load_table_checkpoint: no {key!r} in the checkpoint (keys: {sorted(state)})")
            weight = state[key]
            if tuple(weight.shape) != (spec.num_embeddings, spec.embedding_dim):
                raise ValueError(f"load_table_checkpoint: {key!r} has shape {tuple(weight.shape)}, the table on the "
                                 f"servers is ({spec.num_embeddings}, {spec.embedding_dim})")
            dynamic = state.get(f"{t['path']}.dynamic")
            if spec.dynamic is not None and dynamic is None:
                raise KeyError(f"load_table_checkpoint: {t['path']!r} is a dynamic table and the checkpoint has no "
                               f"{t['path'] + '.dynamic'!r} (its id -> slot map; keys: {sorted(state)})")
            momentum = state.get(f"{t['path']}.momentum")
            if momentum is None and t["table"] in current:
                momentum = current[t["table"]]["state"]
            tables[t["table"]] = {"spec": spec, "weight": weight.detach().float(), "state": momentum,
                                  "dynamic": dynamic if spec.dynamic is not None else None}
        client.load_server_states(scatter_tables({name: tables}, {name: client.shards}, len(client.servers)))


def table_layout(gm: Any) -> dict[str, dict[str, Any]]:
    """Where the pass put each moved table of ``gm``, in the pass's (graph) order: ``{"<path>": {"servers": [names],
    "table", "module", "rows", "dim", "dynamic": bool}}`` (``rows``: a dynamic table's capacity): what
    :func:`replan` needs to place the same tables on other servers.

    Raises:
        ValueError: ``gm`` has no tables on parameter servers.
    """
    from ..ps.client import get_client

    meta = _meta(gm)
    dynamic = {(t["module"], sp.table.name) for t in meta["tables"]
               for sp in get_client(meta["clients"][t["module"]]).shards if sp.table.dynamic is not None}
    return {t["path"]: {"servers": list(t["servers"]), "table": t["table"], "module": t["module"], "rows": t["rows"],
                        "dim": t["dim"], "dynamic": (t["module"], t["table"]) in dynamic} for t in meta["tables"]}


def replan(layout: Mapping[str, Mapping[str, Any]], server_names: Sequence[str]) -> dict[str, list[str]]:
    """``{"<path>": [server names]}``: where the pass's rule (:func:`scheduling.placement.plan.plan_tables`, no
    overrides) puts the tables of a :func:`table_layout` (in its order) on ``server_names``: the layout a model
    gets on those servers, e.g. after a restore on another number of servers.

    Raises:
        ValueError: no servers.
    """
    from ..ps.dynamic import DynamicSpec
    from ..ps.shard_plan import TableSpec
    from .plan import TableInfo, plan_tables

    tables = [TableInfo(TableSpec(t["table"], int(t["rows"]), int(t["dim"]), (),
                                  dynamic=DynamicSpec(int(t["rows"])) if t.get("dynamic") else None),
                        t["module"], path) for path, t in layout.items()]
    placements = plan_tables(tables, len(server_names))
    return {p.table.path: [server_names[s] for s in p.servers] for p in placements}
