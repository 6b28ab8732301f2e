"""Which rows a parameter server changed since the last delta of a model: a record per shard, kept by the push path.

A training job that hands its model to a live server every ``N`` steps (``[export] every_steps``, :mod:`jobs.deltas`)
sends only the rows that changed. Each server keeps, per tracked namespace (a client's tables), a record that the
push path sets and a ``changes`` request reads and clears:

* fixed tables: a bool per row (``(R,)``, one byte a row), set for the rows each push updates. A namespace on the
  stacked path (:class:`~scheduling.ps.fused.FusedTables`) has one mask over its stacked rows, set by one NumPy
  fancy assignment per push (a few microseconds for a few thousand ids), its shards viewing their slices;
* dynamic tables (:mod:`scheduling.ps.dynamic`): a bool per slot of the group, set for the slots each push updates
  and for the slots each admission fills with a fresh row; the slot -> id array at the last delta (``(C,)`` int64 per
  table) and the ids admitted since. At a delta, the slots whose id differs from that copy give the new ids and
  their slots (an id moved to another slot included); the ids held at the last delta or admitted since that are no
  longer held are the evicted ones (expiry included).

:func:`take_changes` answers, per shard, the rows set (as the table's global rows, ascending) and their float32
values, reads the dynamic maps, and clears the record, all under the shard's lock, which every push holds while it
updates and marks: a push is in a delta or in the next one, never half. Tracking starts with
:func:`start_tracking` (a namespace's record, empty); loading or configuring the namespace's shards starts it again
(the server calls :func:`retrack` after it stacks them): the job asks for its first delta after any restore.

Source: Liu et al. 2022, "Monolith: Real Time Recommendation System With Collisionless Embedding Table" §2.3
(parameter synchronisation: the training servers track the ids touched since the last sync and send only those);
FBGEMM's table-batched embeddings for the stacked rows.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["start_tracking", "stop_tracking", "retrack", "take_changes", "track_group", "take_group"]


def _shards(server: Any, namespace: str) -> list[tuple[str, Any]]:
    """``(shard key, Shard)`` of ``namespace`` held by ``server``, in layout order (each shard once)."""
    keys = dict.fromkeys(f"{namespace}/{spec.key}" for spec, _ in server.layouts.get(namespace, ()))
    return [(k, server.shards[k]) for k in keys if k in server.shards]


def start_tracking(server: Any, namespace: str) -> None:
    """Start (or restart) recording the rows ``server`` changes in ``namespace``'s shards: every record empty, the
    dynamic tables' slot -> id arrays copied as they are now.

    Raises:
        ValueError: the server holds no tables of ``namespace``.
    """
    if namespace not in server.layouts:
        raise ValueError(f"server {server.name}: no tables of client {namespace!r} to track (have "
                         f"{sorted(server.layouts)})")
    server.tracked.add(namespace)
    retrack(server, namespace)


def stop_tracking(server: Any, namespace: str) -> None:
    """Stop recording ``namespace``'s changed rows on ``server`` and drop its records (nothing when not tracked)."""
    if namespace not in server.tracked:
        return
    server.tracked.discard(namespace)
    fused = server.fused.get(namespace)
    if fused is not None and hasattr(fused, "_changed_np"):
        fused.changed, fused._changed_np = None, None
    for key, shard in _shards(server, namespace):
        server.changes.pop(key, None)
        if shard.dynamic is not None:
            with shard.lock:
                group = shard.dynamic.group
                group.changed, group.base_slot, group.admitted = None, None, []


def retrack(server: Any, namespace: str) -> None:
    """After ``server`` (re)stacked ``namespace``'s shards: fresh, empty records for them when it is tracked."""
    if namespace not in server.tracked:
        return
    from .fused import FusedTables

    fused = server.fused.get(namespace)
    views = fused.track_changes() if type(fused) is FusedTables else {}
    for key, shard in _shards(server, namespace):
        with shard.lock:
            if shard.dynamic is not None:
                track_group(shard.dynamic.group, shard.dynamic.index)
                server.changes.pop(key, None)
            else:
                server.changes[key] = views.get(shard.spec.key, torch.zeros(shard.spec.num_rows, dtype=torch.bool))


def take_changes(server: Any, namespace: str) -> dict[str, dict[str, Any]]:
    """The rows ``server`` changed in ``namespace`` since tracking started or the previous call, and clear the record.

    Returns:
        Per shard key (``"<namespace>/<table>@<first row>"``): ``{"table": name, "rows": (K,) int64 global rows of the
        table (ascending), "values": (K, D) float32}``, a dynamic table's with ``"ids"`` ``(K',)`` and ``"slots"``
        ``(K',)`` (ids now at slots whose id changed) and ``"evicted"`` ``(E,)`` (ids no longer held); ``rows`` are
        its slots.

    Raises:
        ValueError: ``namespace`` is not tracked here (:func:`start_tracking` first; a restarted server tracks
            nothing).
    """
    if namespace not in server.tracked:
        raise ValueError(f"server {server.name}: rows of client {namespace!r} are not tracked; start tracking first "
                         f"(tracked: {sorted(server.tracked)})")
    out: dict[str, dict[str, Any]] = {}
    for key, shard in _shards(server, namespace):
        spec = shard.spec
        with shard.lock:
            if shard.dynamic is not None:
                out[key] = {"table": spec.table.name, **take_group(shard.dynamic.group, shard.dynamic.index)}
                continue
            mask = server.changes[key]
            rows = mask.nonzero().flatten()
            values = shard.store.gather(shard.weight, rows) if rows.numel() else torch.zeros(0, spec.table.embedding_dim)
            mask.zero_()
        out[key] = {"table": spec.table.name, "rows": rows + spec.row_start, "values": values}
    return out


def track_group(group: Any, t: int) -> None:
    """Start recording table ``t`` of a :class:`~scheduling.ps.dynamic_group.DynamicTableGroup` afresh (caller holds
    its lock): no slot changed, its slot -> id array as it is now, no id admitted."""
    cap = group.capacity
    if group.changed is None:
        group.changed = torch.zeros(group.size * cap, dtype=torch.bool)
        group.base_slot = group.slot_id.clone()
        group.admitted = []
    group.changed[t * cap:(t + 1) * cap] = False
    group.base_slot[t] = group.slot_id[t]
    group.admitted = [(tab, ids) for tab, ids in group.admitted if tab != t]


def take_group(group: Any, t: int) -> dict[str, torch.Tensor]:
    """Table ``t``'s changes since :func:`track_group` or the previous call (caller holds the group's lock), then
    cleared: ``rows`` ``(K,)`` slots whose row or id changed, ``values`` ``(K, D)`` float32 their rows, ``ids`` and
    ``slots`` ``(K',)`` the ids now at slots whose id changed, ``evicted`` ``(E,)`` ids no longer held (sorted)."""
    cap = group.capacity
    if group.changed is None:
        raise ValueError("dynamic table group: changes are not tracked (track_group first)")
    current, base = group.slot_id[t], group.base_slot[t]
    moved = current != base
    slots = (group.changed[t * cap:(t + 1) * cap] | moved).nonzero().flatten()
    values = group.store.gather(group.weight, slots + t * cap) if slots.numel() else torch.zeros(0, group.dim)
    new = (moved & (current >= 0)).nonzero().flatten()
    admitted = [ids for tab, ids in group.admitted if tab == t]
    seen = torch.cat([base[base >= 0], *admitted])
    held = current[current >= 0]
    evicted = torch.unique(seen[~torch.isin(seen, held)])
    out = {"rows": slots, "values": values, "ids": current[new].clone(), "slots": new, "evicted": evicted}
    track_group(group, t)
    return out
