"""Checkpoints of the moved tables by shard (:mod:`scheduling.ps.dcp_shards`): every server writes its own rows in
parallel with ``torch.distributed.checkpoint``, and restores on any number of servers read only the rows they hold.
No trainer ever holds a whole table: what passes through it is each server's short report and the folder's
metadata (chunk descriptors).

- :func:`start_checkpoint`: each server copies its shards and answers (training may go on; pushes after this do not
  reach the checkpoint), then writes in the background into ``<folder>/<namespace>@<server>/``;
- :func:`finish_checkpoint`: once every server reports its write finished, the servers' metadata are merged into
  ``<folder>/.metadata``: the folder is then one DCP checkpoint of the model's tables under their state-dict names
  (``"<path>.weight"`` ``(N, D)``, ``"<path>.momentum"`` ``(N,)``, ``"<path>.dynamic.<name>"``), which DCP's own
  ``FileSystemReader`` reads whole (:func:`read_tables`, e.g. to export the model);
- :func:`load_checkpoint`: the servers of a model that went through the pass again, on any number of servers, each
  load their shards' rows from the folder (DCP's resharding on load).

Both sides return a digest of the tables (:func:`tables_digest`) that does not depend on the layout: a restore on
``M`` servers gives the digest ``N`` servers saved.

Source: ``torch.distributed.checkpoint`` (``async_save``: stage a copy, write in the background; resharding on load);
torchrec ``DistributedModelParallel`` row-wise sharded checkpoints.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..ps import dcp_shards

__all__ = ["start_checkpoint", "finish_checkpoint", "load_checkpoint", "tables_digest", "read_tables",
           "is_sharded_checkpoint"]


def _clients(gm: Any) -> list[tuple[Any, dict[str, str]]]:
    """``(client, {table name: state-dict path})`` per client of ``gm``'s moved tables, once per client: several
    modules can share one client (their tables grouped on the same servers, e.g. a user and an item table)."""
    from ..ps.client import get_client
    from .after import _placement_meta

    meta = _placement_meta(gm)
    paths: dict[str, dict[str, str]] = {}
    for qualname, name in meta["clients"].items():
        paths.setdefault(name, {}).update({t["table"]: t["path"] for t in meta["tables"] if t["module"] == qualname})
    return [(get_client(name), table_paths) for name, table_paths in paths.items()]


def start_checkpoint(gm: Any, directory: str | os.PathLike) -> dict[str, float]:
    """Every server of ``gm`` (a GraphModule after the ``parameter_servers`` pass) copies its shards and starts
    writing them under ``directory`` (created; it should be new or empty). Waits this trainer's pushes first.
    Returns ``{"copy_s": the slowest server's copy, seconds, "rows": rows copied}``.

    Raises:
        ValueError: ``gm`` has no tables on parameter servers.
        scheduling.ps.PSUnavailableError: a server did not answer.
    """
    Path(directory).mkdir(parents=True, exist_ok=True)
    copy_s, rows = 0.0, 0
    for client, paths in _clients(gm):
        for answer in client.save_shards(directory, paths):
            copy_s, rows = max(copy_s, float(answer["copy_s"])), rows + int(answer["rows"])
    return {"copy_s": copy_s, "rows": rows}


def finish_checkpoint(gm: Any, directory: str | os.PathLike, wait: bool = True) -> str | None:
    """Once every server's write of :func:`start_checkpoint` into ``directory`` finished: merge their metadata into
    ``<directory>/.metadata`` and return the tables' digest (:func:`tables_digest`). ``wait`` False: None at once
    while a write still runs (nothing merged; ask again later).

    Raises:
        KeyError: no write into ``directory`` was started on some server.
        ValueError: the servers' chunks do not cover each table's rows exactly once
            (:func:`scheduling.ps.dcp_shards.merge_metadata`).
        Exception: a server's write failed (its error, e.g. OSError).
    """
    reports: list[dict[str, Any]] = []
    for client, _ in _clients(gm):
        answers = client.save_status(directory, wait)
        if any(a is None for a in answers):
            return None
        reports.extend(answers)
    dcp_shards.merge_metadata(directory)
    return tables_digest([r["fingerprints"] for r in reports])


def load_checkpoint(gm: Any, directory: str | os.PathLike) -> str:
    """The servers of ``gm`` (any number: the layout its pass chose) load their shards from the checkpoint folder
    ``directory``, each reading only the saved chunks over its rows. Returns the loaded tables' digest, equal to
    :func:`finish_checkpoint`'s for the same folder.

    Raises:
        FileNotFoundError: ``directory`` has no merged ``.metadata`` (an unfinished checkpoint).
        KeyError: a moved table the checkpoint lacks.
        ValueError: a table of another shape than the checkpoint's.
    """
    meta = Path(directory) / dcp_shards.METADATA
    if not meta.is_file():
        raise FileNotFoundError(f"{meta}: no merged metadata; the checkpoint in {directory} was never finished")
    prints = [p for client, paths in _clients(gm) for p in client.load_shards(directory, paths)]
    return tables_digest(prints)


def tables_digest(fingerprints: Sequence[Mapping[str, int]]) -> str:
    """SHA-1 over the keys of the servers' fingerprints (:func:`scheduling.ps.dcp_shards.fingerprint`), each key's
    summed over the servers modulo ``2**64``: the same for a table whatever the servers it was split over."""
    total: dict[str, int] = {}
    for prints in fingerprints:
        for key, value in prints.items():
            total[key] = (total.get(key, 0) + int(value)) % (1 << 64)
    h = hashlib.sha1()
    for key in sorted(total):
        h.update(f"{key}={total[key]:016x};".encode())
    return h.hexdigest()


def is_sharded_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a finished checkpoint by shard (its merged ``.metadata``)."""
    return (Path(directory) / dcp_shards.METADATA).is_file()


def _optimizer_key(key: str) -> bool:
    """Whether ``key`` of a checkpoint by shard holds optimizer state (``.momentum``, a dynamic table's ``state``)."""
    return key.endswith(".momentum") or re.search(r"\.dynamic\.state(\.|#|$)", key) is not None


def read_tables(directory: str | os.PathLike, optimizer_state: bool = True) -> dict[str, Any]:
    """A finished checkpoint folder's tables whole, in this process (for a model file: export): ``"<path>.weight"``
    ``(N, D)``, ``"<path>.momentum"`` ``(N,)`` and a dynamic table's state as ``"<path>.dynamic"`` (a dict; its slots'
    rows and optimizer state also as ``.weight`` / ``.momentum``), as
    :func:`scheduling.placement.restore.table_checkpoint` gives them. ``optimizer_state`` False: the row-wise
    Adagrad state is not read (no ``.momentum``; a dynamic table's ``"state"`` None), e.g. for serving.

    Raises:
        FileNotFoundError: no merged ``.metadata`` in ``directory``.
        pickle.UnpicklingError: its metadata names a global outside DCP's metadata types.
    """
    meta = dcp_shards.read_metadata(Path(directory) / dcp_shards.METADATA).state_dict_metadata
    targets = {k: (torch.empty(tuple(v.size), dtype=v.properties.dtype), 0) for k, v in meta.items()
               if isinstance(v, dcp_shards.md.TensorStorageMetadata) and (optimizer_state or not _optimizer_key(k))}
    dcp_shards.read_rows(directory, targets)
    flat = {k: t for k, (t, _) in targets.items()}
    out: dict[str, Any] = {k: t for k, t in flat.items() if ".dynamic." not in k}
    for path in sorted({k.split(".dynamic.")[0] for k in flat if ".dynamic." in k}):
        dynamic = out[f"{path}.dynamic"] = dcp_shards.unflatten_dynamic(path, flat)
        out[f"{path}.weight"] = dynamic["weight"]   # its slots' rows, as table_checkpoint gives them
        if dynamic["state"] is not None:
            out[f"{path}.momentum"] = dynamic["state"]
    return out
