"""Deltas of a run's trained model (``RUN_DIR/model/deltas/``): read, apply and write them, in plain torch.

With ``[export] every_steps = N`` a job writes, every ``N`` steps of its optimized phase (the phase whose model
``RUN_DIR/model/`` holds), a *delta*: the model's state after that step's updates, as the rows of every embedding
table changed since the previous delta, the new and evicted ids of its dynamic tables, and the dense weights (the
module's other ``state_dict`` entries, whole). A server (``fxdist serve``) that holds the model of some step applies
the deltas of the later steps in order (:func:`apply_delta`) and then holds the trained model of the last one, bit
for bit, without reading the whole tables again.

Layout: ``RUN_DIR/model/deltas/<step, 10 digits>/`` holds ``delta.pt`` (read with ``torch.load(weights_only=True)``:
plain tensors, strings and numbers) and ``delta.json`` (the step and the rows per table, for people and tools).
A delta is written whole into a hidden temporary sibling (``.tmp-<step>-<random>``) and then ``os.replace``\\ d
into place, so a reader sees a whole delta or none; :func:`committed_steps` lists only the committed ones.

A full delta written by a job whose tables are on parameter servers holds its tables by shard: the servers wrote
them with ``torch.distributed.checkpoint`` (:mod:`scheduling.placement.sharded`, as a checkpoint's) into a hidden
folder, which :func:`write_delta` moves into the temporary sibling as ``tables/`` before the ``os.replace``;
``delta.pt`` (``"format": 2``) then holds the dense weights and ``"shards": "tables"`` instead of ``"tables"`` /
``"dynamic"``, and :func:`load_delta` reads the tables whole from that folder (the reader holds the model).

``delta.pt``::

    {"format": 1, "step": int, "full": bool,                   # full: the whole model (below); format 2: "shards"
     "dense": {state-dict key: tensor},                         # the non-table entries, whole
     "tables": {"<path>.weight": {"rows": (K,) int64, "values": (K, D) float32}},
     "dynamic": {"<path>": {"ids": (K,) int64, "slots": (K,) int64, "evicted": (E,) int64, "full": bool}}}

Table keys are those of ``RUN_DIR/model/state_dict.pt`` (a dynamic table's weight holds its rows by slot,
``(capacity, D)``); dynamic keys those of ``RUN_DIR/model/dynamic_ids.pt`` (``{"ids", "slots"}`` per table path,
sorted by id). Rows are *set*, never added: applying a delta whose rows are a superset of the changed ones (after a
restart from a checkpoint) gives the same model.

The first delta of a run (step 0), and the first of a run resumed at a step after the newest committed delta, is
*full*: every row of every table and whole id maps, the model of that step, so the chain of deltas never misses a
change. Applying the deltas from a full one on, in order, to any model of the same structure gives the trained
model of the last one; a model of step ``s`` (an exported one) needs the deltas after ``s`` only.

Source: PyTorch docs, "Saving and loading models" (``state_dict``, ``torch.load(weights_only=True)``); Liu et al.
2022, "Monolith: Real Time Recommendation System With Collisionless Embedding Table" §2.3 (a training job syncing
the parameters it changed to the serving model every few minutes, the dense ones whole).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import torch

__all__ = ["MODEL_DIR", "DELTAS_DIR", "DELTA_FILE", "FORMAT", "SHARDED_FORMAT", "SHARDS_DIR", "DeltaError", "TableDelta", "DynamicDelta", "Delta",
           "committed_steps", "latest_step", "load_delta", "whole_tables", "apply_delta", "apply_map", "write_delta", "delta_path",
           "DeltaQueue"]

MODEL_DIR = "model"
"""The folder of a run that holds its trained model (``jobs.launcher.model_export`` writes it)."""
DELTAS_DIR = "deltas"
"""The folder of ``RUN_DIR/model/`` that holds the deltas."""
DELTA_FILE = "delta.pt"
"""A delta's tensors, in its step's folder."""
FORMAT = 1
"""``delta.pt``'s ``format``: bumped when its layout changes."""
SHARDED_FORMAT = 2
"""``delta.pt``'s ``format`` when the delta's tables are by shard in its :data:`SHARDS_DIR` (``"shards"``)."""
SHARDS_DIR = "tables"
"""The sub-folder of a delta's folder that holds its tables by shard (a ``torch.distributed.checkpoint`` folder)."""
_STEP = re.compile(r"^[0-9]{10}$")


class DeltaError(ValueError):
    """A delta that cannot be read or applied: missing, not a delta, of another format, or not fitting the model it is
    applied to (the message names the folder or the key).

    See docs/troubleshooting.md#deltaerror.
    """


def _int64() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True)
class TableDelta:
    """The changed rows of one table: ``values[i]`` is the new row ``rows[i]`` of the state-dict weight.

    Shapes: ``rows`` ``(K,)`` int64 (distinct, ascending), ``values`` ``(K, D)`` float32.
    """

    rows: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class DynamicDelta:
    """The id map changes of one dynamic table: raw ids ``ids`` ``(K,)`` int64 now at slots ``slots`` ``(K,)`` int64
    (new ids, or ids moved to another slot), and raw ids ``evicted`` ``(E,)`` int64 removed (evicted or expired) and
    not admitted again since the previous delta; ``full``: ``ids`` and ``slots`` are the whole map, which replaces
    the one it is applied to (a delta that starts a chain, :attr:`Delta.full`)."""

    ids: torch.Tensor
    slots: torch.Tensor
    evicted: torch.Tensor = field(default_factory=_int64)
    full: bool = False


@dataclass(frozen=True)
class Delta:
    """One delta: the model after step ``step``'s updates, relative to the previous delta (see the module docstring).

    ``dense``: the module's non-table ``state_dict`` entries, whole; ``tables``: per state-dict key of a table's weight
    (``"emb.embedding_bags.t_C1.weight"``), its changed rows; ``dynamic``: per dynamic table path (the keys of
    ``dynamic_ids.pt``), its id map changes. ``full``: the whole model (every row of every table, whole id maps): the
    first delta of a run, or of a run resumed where the deltas before it were not committed, which later deltas
    build on; applied to any model of the same structure it gives the model of its step.
    """

    step: int
    dense: dict[str, torch.Tensor]
    tables: dict[str, TableDelta]
    dynamic: dict[str, DynamicDelta] = field(default_factory=dict)
    full: bool = False

    @property
    def num_rows(self) -> int:
        """The table rows the delta carries, all tables together."""
        return sum(int(t.rows.numel()) for t in self.tables.values())


class TableRecord(TypedDict):
    """A table's changed rows as ``delta.pt`` stores them: ``rows`` (K,) int64, ``values`` (K, D) float32."""
    rows: torch.Tensor
    values: torch.Tensor


class DynamicRecord(TypedDict):
    """A dynamic table's id changes as ``delta.pt`` stores them: (K,) int64 ``ids`` now at (K,) ``slots``, (E,)
    ``evicted`` ids, and ``full`` (the whole id map)."""
    ids: torch.Tensor
    slots: torch.Tensor
    evicted: torch.Tensor
    full: bool


class DynamicCount(TypedDict):
    """``delta.json``'s count of a dynamic table's changed ids and evicted ids."""
    ids: int
    evicted: int


class ShardCounts(TypedDict):
    """``delta.json``'s ``rows`` per table weight and ``dynamic`` counts per dynamic table."""
    rows: dict[str, int]
    dynamic: dict[str, DynamicCount]


class DeltaRecord(ShardCounts, total=False):
    """``delta.json``: what a delta holds, counted (``shards``: the folder of its tables by shard, format 2)."""
    format: int
    step: int
    full: bool
    dense: int
    shards: str


class DeltaFile(TypedDict, total=False):
    """``delta.pt``: the delta's step, dense weights and changed rows (format 1), or with ``shards`` the folder of its
    tables by shard and no rows inline (format 2)."""
    format: int
    step: int
    full: bool
    dense: dict[str, torch.Tensor]
    tables: dict[str, TableRecord]
    dynamic: dict[str, DynamicRecord]
    shards: str


class ShardTables(TypedDict):
    """A format-2 delta's tables read whole from its folder by shard, as ``delta.pt`` would hold them."""
    tables: dict[str, TableRecord]
    dynamic: dict[str, DynamicRecord]


def delta_path(model_dir: str | os.PathLike[str], step: int) -> Path:
    """The folder of step ``step``'s delta under ``model_dir`` (``RUN_DIR/model``)."""
    return Path(model_dir) / DELTAS_DIR / f"{int(step):010d}"


def committed_steps(model_dir: str | os.PathLike[str]) -> list[int]:
    """The steps of the deltas committed under ``model_dir`` (``RUN_DIR/model``), ascending; ``[]`` when there is no
    ``deltas/`` folder. Temporary folders of deltas being written are not listed."""
    root = Path(model_dir) / DELTAS_DIR
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in names if _STEP.match(n) and (root / n / DELTA_FILE).is_file())


def latest_step(model_dir: str | os.PathLike[str]) -> int | None:
    """The newest committed delta's step, or None without one."""
    steps = committed_steps(model_dir)
    return steps[-1] if steps else None


def _tensor(value: Any, where: str, dtype: torch.dtype | None = None, dim: int | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or (dtype is not None and value.dtype != dtype) or (
            dim is not None and value.dim() != dim):
        raise DeltaError(f"{where}: expected a {dim}-D {dtype} tensor, got "
                         f"{type(value).__name__}{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}")
    return value


def load_delta(model_dir: str | os.PathLike[str], step: int) -> Delta:
    """Read step ``step``'s delta under ``model_dir`` (``RUN_DIR/model``), with ``torch.load(weights_only=True)``.

    Raises:
        DeltaError: no committed delta of that step, or its file is not a delta of this format (the message names
            the file and what is wrong).
    """
    path = delta_path(model_dir, step) / DELTA_FILE
    if not path.is_file():
        have = committed_steps(model_dir)
        raise DeltaError(f"{path}: no delta of step {step} (committed: {have[:5]}{' ...' if len(have) > 5 else ''})")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a torn, truncated or hostile file: one clear error
        raise DeltaError(f"{path}: not a readable delta ({type(e).__name__}: {e})") from e
    if not isinstance(data, dict) or data.get("format") not in (FORMAT, SHARDED_FORMAT) or data.get("step") != step:
        got = (data.get("format"), data.get("step")) if isinstance(data, dict) else type(data).__name__
        raise DeltaError(f"{path}: not a delta of format {FORMAT} or {SHARDED_FORMAT} and step {step} (got {got})")
    where = str(path)
    if data["format"] == SHARDED_FORMAT:
        data = {**data, **_read_shards(path.parent, data.get("shards"))}
    tables = {}
    for key, t in (data.get("tables") or {}).items():
        rows = _tensor(t.get("rows"), f"{where}: tables[{key!r}].rows", torch.int64, 1)
        values = _tensor(t.get("values"), f"{where}: tables[{key!r}].values", None, 2)
        if values.shape[0] != rows.shape[0]:
            raise DeltaError(f"{where}: tables[{key!r}] has {rows.shape[0]} rows and {values.shape[0]} values")
        tables[key] = TableDelta(rows, values)
    dynamic = {}
    for key, d in (data.get("dynamic") or {}).items():
        ids = _tensor(d.get("ids"), f"{where}: dynamic[{key!r}].ids", torch.int64, 1)
        slots = _tensor(d.get("slots"), f"{where}: dynamic[{key!r}].slots", torch.int64, 1)
        evicted = _tensor(d.get("evicted"), f"{where}: dynamic[{key!r}].evicted", torch.int64, 1)
        if ids.shape != slots.shape:
            raise DeltaError(f"{where}: dynamic[{key!r}] has {ids.numel()} ids and {slots.numel()} slots")
        dynamic[key] = DynamicDelta(ids, slots, evicted, bool(d.get("full", False)))
    dense = {k: _tensor(v, f"{where}: dense[{k!r}]") for k, v in (data.get("dense") or {}).items()}
    return Delta(step, dense, tables, dynamic, bool(data.get("full", False)))


def _read_shards(folder: Path, name: Any) -> ShardTables:
    """A format-2 delta's tables as ``delta.pt``'s ``"tables"`` / ``"dynamic"``: read whole from ``folder/name``
    (:func:`scheduling.placement.sharded.read_tables`, without optimizer state).

    Raises:
        DeltaError: no such folder, or it is not a finished checkpoint by shard.
    """
    from scheduling.placement.sharded import is_sharded_checkpoint, read_tables

    shards = folder / str(name)
    if name != SHARDS_DIR or not is_sharded_checkpoint(shards):
        raise DeltaError(f"{folder}: its tables by shard ({name!r}) are not a finished checkpoint folder")
    try:
        tables, dynamic = whole_tables(read_tables(shards, optimizer_state=False))
    except Exception as e:  # noqa: BLE001 - a torn or hostile folder: one clear error
        raise DeltaError(f"{shards}: not readable tables by shard ({type(e).__name__}: {e})") from e
    return {"tables": {k: {"rows": t.rows, "values": t.values} for k, t in tables.items()},
            "dynamic": {k: {"ids": d.ids, "slots": d.slots, "evicted": d.evicted, "full": True}
                        for k, d in dynamic.items()}}


def whole_tables(tables: Mapping[str, Any]) -> tuple[dict[str, TableDelta], dict[str, DynamicDelta]]:
    """A full delta's tables from whole ones (as :func:`scheduling.placement.restore.table_checkpoint` or
    :func:`scheduling.placement.sharded.read_tables` give them): every row of each ``"<path>.weight"`` ``(N, D)``
    (float32), and each dynamic table's whole id map from its ``"<path>.dynamic"`` state (``map_ids`` /
    ``map_slots``; ``full``); optimizer state left out."""
    weights = {k: TableDelta(torch.arange(v.shape[0]), v.detach().float())
               for k, v in tables.items() if k.endswith(".weight")}
    dynamic = {k.removesuffix(".dynamic"): DynamicDelta(torch.as_tensor(v["map_ids"], dtype=torch.int64),
                                                          torch.as_tensor(v["map_slots"], dtype=torch.int64), full=True)
               for k, v in tables.items() if k.endswith(".dynamic") and v is not None}
    return weights, dynamic


def apply_delta(state: dict[str, torch.Tensor], dynamic_ids: dict[str, dict[str, torch.Tensor]], delta: Delta) -> None:
    """Apply ``delta`` in place: ``state`` a module's ``state_dict()`` (tensors sharing storage with the module, so the
    module changes too; a ``torch.load``\\ ed ``state_dict.pt`` works the same), ``dynamic_ids`` as
    ``RUN_DIR/model/dynamic_ids.pt`` (``{path: {"ids", "slots"}}``, replaced per table by the new map, sorted by id).

    After applying the deltas of steps ``s_1 < ... < s_k`` in order, ``s_1``'s full (:attr:`Delta.full`) and the
    model any of the same structure, or ``s_1``'s the first delta after the step of the model (an exported model of a
    step the deltas cover), ``state`` and ``dynamic_ids`` equal the trainer's model at step ``s_k``.

    Raises:
        DeltaError: a key of the delta that ``state`` (or ``dynamic_ids``) lacks, a row outside a table, or values of
            another width than the table's; nothing is changed then (all checks run before the first write).
    """
    for key, t in delta.tables.items():
        target = state.get(key)
        if target is None:
            raise DeltaError(f"delta of step {delta.step}: table {key!r} is not in the state dict")
        if t.values.shape[1:] != target.shape[1:] or (t.rows.numel() and (int(t.rows.min()) < 0 or
                                                                           int(t.rows.max()) >= target.shape[0])):
            raise DeltaError(f"delta of step {delta.step}: table {key!r} {tuple(target.shape)} cannot take rows "
                             f"{_span(t.rows)} of width {tuple(t.values.shape[1:])}")
    for key, value in delta.dense.items():
        if key not in state:
            raise DeltaError(f"delta of step {delta.step}: dense {key!r} is not in the state dict")
        if state[key].shape != value.shape:
            raise DeltaError(f"delta of step {delta.step}: dense {key!r} has shape {tuple(value.shape)}, the state "
                             f"dict's {tuple(state[key].shape)}")
    for key in delta.dynamic:
        if key not in dynamic_ids:
            raise DeltaError(f"delta of step {delta.step}: dynamic table {key!r} is not in dynamic_ids "
                             f"(have {sorted(dynamic_ids)})")
    with torch.no_grad():
        for key, t in delta.tables.items():
            target = state[key]
            target.index_copy_(0, t.rows.to(target.device), t.values.to(target.device, target.dtype))
        for key, value in delta.dense.items():
            state[key].copy_(value)
    for key, d in delta.dynamic.items():
        dynamic_ids[key] = apply_map(dynamic_ids[key], d)


def _span(rows: torch.Tensor) -> str:
    return f"[{int(rows.min())}, {int(rows.max())}]" if rows.numel() else "[]"


def apply_map(old: Mapping[str, torch.Tensor], d: DynamicDelta) -> dict[str, torch.Tensor]:
    """A dynamic table's id map ``{"ids" (R,), "slots" (R,)}`` after ``d``: the evicted ids, the ids ``d`` places and
    the entries of the slots it fills removed, its ``(ids, slots)`` added (a ``full`` one: its map alone); sorted by
    id (as ``dynamic_ids.pt``)."""
    ids, slots = old["ids"].long(), old["slots"].long()
    drop = torch.isin(ids, torch.cat([d.evicted, d.ids])) | torch.isin(slots, d.slots)
    if d.full:
        drop = torch.ones_like(ids, dtype=torch.bool)
    ids, slots = torch.cat([ids[~drop], d.ids]), torch.cat([slots[~drop], d.slots])
    ids, order = torch.sort(ids)
    return {"ids": ids, "slots": slots[order]}


class DeltaQueue:
    """Commits deltas under ``model_dir`` in the order given, on one background thread (:func:`write_delta`), so that
    the caller (a job's rank 0, which the other trainers wait for) goes on as soon as a delta is handed over.

    The deltas given must not change afterwards (copies of the tensors a model trains on). A failed write is raised
    by the next :meth:`put` or by :meth:`close`, and no later delta is committed after it (a gap in the chain would
    make a reader apply a delta to the wrong model).
    """

    def __init__(self, model_dir: str | os.PathLike[str]) -> None:
        self.model_dir = Path(model_dir)
        self._pool: Any = None
        self._last: Any = None
        self.newest = latest_step(model_dir)
        """The newest step committed or handed over (None: none)."""

    def put(self, delta: Delta, extra: Mapping[str, Any] | None = None, shards: str | os.PathLike[str] | None = None
            ) -> bool:
        """Hand ``delta`` over to be committed (``shards``: the finished folder of its tables by shard, moved into
        it: :func:`write_delta`); False (nothing done) when a delta of its step or a later one was committed or handed
        over already.

        Raises:
            OSError: the previous delta could not be written (re-raised from its thread; nothing more is written).
        """
        self._check()
        if self.newest is not None and delta.step <= self.newest:
            return False
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fxdist-deltas")
        self.newest = delta.step
        self._last = self._pool.submit(write_delta, self.model_dir, delta, extra, shards)
        return True

    def _check(self) -> None:
        if self._last is not None and self._last.done() and self._last.exception() is not None:
            error, self._last = self._last.exception(), None
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
            raise error

    def close(self) -> None:
        """Wait until every delta handed over is committed.

        Raises:
            OSError: a delta could not be written.
        """
        if self._pool is None:
            return
        pool, self._pool = self._pool, None
        pool.shutdown(wait=True)
        last, self._last = self._last, None
        if last is not None and last.exception() is not None:
            raise last.exception()


def write_delta(model_dir: str | os.PathLike[str], delta: Delta, extra: Mapping[str, Any] | None = None,
                shards: str | os.PathLike[str] | None = None) -> Path | None:
    """Commit ``delta`` as ``model_dir/deltas/<step>/`` (written in a temporary sibling, then ``os.replace``\\ d:
    readers see all of it or nothing); ``extra``: more keys for ``delta.json``. ``shards``: a finished folder of the
    delta's tables by shard (:mod:`scheduling.placement.sharded`, on the same file system), moved into the temporary
    sibling as :data:`SHARDS_DIR` (``delta.pt`` of format :data:`SHARDED_FORMAT`; ``delta.tables`` / ``.dynamic``
    are then not written). Returns the folder, or None when a delta of this step or a later one is committed already
    (a run resumed from an earlier checkpoint: the committed deltas are kept as they are; ``shards`` is removed).

    Raises:
        OSError: the folder cannot be written (the temporary one is removed).
    """
    root = Path(model_dir) / DELTAS_DIR
    newest = latest_step(model_dir)
    if newest is not None and delta.step <= newest:
        if shards is not None:
            shutil.rmtree(shards, ignore_errors=True)
        return None
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{delta.step:010d}-", dir=root))
    try:
        data: DeltaFile = {"format": FORMAT, "step": delta.step, "full": delta.full, "dense": delta.dense,
                           "tables": {k: {"rows": t.rows, "values": t.values} for k, t in delta.tables.items()},
                           "dynamic": {k: {"ids": d.ids, "slots": d.slots, "evicted": d.evicted, "full": d.full}
                                       for k, d in delta.dynamic.items()}}
        record: DeltaRecord = {
            "format": FORMAT, "step": delta.step, "full": delta.full,
            "rows": {k: int(t.rows.numel()) for k, t in delta.tables.items()}, "dense": len(delta.dense),
            "dynamic": {k: {"ids": int(d.ids.numel()), "evicted": int(d.evicted.numel())} for k, d in delta.dynamic.items()}}
        if shards is not None:
            os.replace(shards, tmp / SHARDS_DIR)
            data["format"], data["shards"], data["tables"], data["dynamic"] = SHARDED_FORMAT, SHARDS_DIR, {}, {}
            counts = _shard_counts(tmp / SHARDS_DIR)
            record["format"], record["shards"] = SHARDED_FORMAT, SHARDS_DIR
            record["rows"], record["dynamic"] = counts["rows"], counts["dynamic"]
        torch.save(data, tmp / DELTA_FILE)
        (tmp / "delta.json").write_text(json.dumps({**record, **(extra or {})}, indent=2, default=str) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        target = delta_path(model_dir, delta.step)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _shard_counts(folder: Path) -> ShardCounts:
    """``delta.json``'s ``rows`` per table weight and ``dynamic`` ids per dynamic table of a folder of tables by shard,
    from its merged metadata (sizes only, no rows read)."""
    from scheduling.ps import dcp_shards

    meta = dcp_shards.read_metadata(folder / dcp_shards.METADATA).state_dict_metadata
    sizes = {k: int(v.size[0]) for k, v in meta.items() if isinstance(v, dcp_shards.md.TensorStorageMetadata)
             and len(v.size)}
    return {"rows": {k.replace(".dynamic.weight", ".weight"): n for k, n in sizes.items() if k.endswith(".weight")},
            "dynamic": {k.removesuffix(".dynamic.map_ids"): {"ids": n, "evicted": 0}
                        for k, n in sizes.items() if k.endswith(".dynamic.map_ids")}}
