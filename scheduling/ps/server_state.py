"""The checkpoint requests of :class:`~scheduling.ps.server.PSServer` (a mixin it inherits): copies of its shards,
loading them back, the memory they hold and server-side checkpoint files; and :class:`Shard`, one shard it holds.

Checkpoints by shard (:mod:`scheduling.ps.dcp_shards`): :meth:`ServerState.save_shards` copies a namespace's shards
(each under its lock, as a push takes it), answers, and writes the copy with ``torch.distributed.checkpoint`` on a
background thread; :meth:`ServerState.save_status` reports that write (done, or still running);
:meth:`ServerState.load_shards` fills this server's shards of a namespace, whatever their rows now, from a
checkpoint folder any number of servers wrote.

Source: torch.fx paper §6.2.3 (tables on parameter servers); torch's ``nn.Module.state_dict`` / ``load_state_dict``;
``torch.distributed.checkpoint`` (``async_save``'s split: a copy that blocks, a write that does not).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import dcp_shards
from .shard_plan import ShardSpec
from .storage import RowStore

if TYPE_CHECKING:
    from .dynamic import DynamicTable

__all__ = ["ServerState", "Shard"]


@dataclass
class Shard:
    """One shard a server holds: its spec, rows (``weight``, in the form of ``store``) and optimizer ``state``."""

    spec: ShardSpec
    weight: torch.Tensor
    """The rows, in the form of ``store``."""
    state: torch.Tensor | None
    lock: threading.Lock = field(default_factory=threading.Lock)
    store: RowStore = field(default_factory=RowStore)
    dynamic: DynamicTable | None = None  # a dynamic table's row store; weight and state are then its slots


class ServerState:
    """Checkpoints of a server's shards; needs the server's ``name``, ``shards``, ``stores``, ``layouts``,
    ``_dynamic_shard`` and ``_fuse``."""

    name: str
    shards: dict[str, Shard]
    stores: dict[str, RowStore]
    layouts: dict[str, Any]

    if TYPE_CHECKING:  # provided by PSServer
        def _dynamic_shard(self, spec: ShardSpec, seed: int, store: RowStore,
                           state: dict[str, Any] | None = None) -> Shard: ...
        def _fuse(self, namespace: str) -> None: ...

    def state_dict(self, namespace: str | None = None) -> dict[str, Any]:
        """``{"<namespace>/<shard key>": {"spec", "weight" (R, D), "state" (R,) or None}}`` (copies), for one
        namespace or all."""
        out = {}
        for key, shard in self.shards.items():
            if namespace is not None and not key.startswith(namespace + "/"):
                continue
            with shard.lock:
                weight = shard.store.decode(shard.weight)  # fp32 rows are the stored tensor itself: copy them
                out[key] = {"spec": shard.spec, "weight": weight.clone() if weight is shard.weight else weight,
                            "state": None if shard.state is None else shard.state.clone(),
                            "dynamic": None if shard.dynamic is None else shard.dynamic.state_dict()}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the shards named in ``state`` (float32 weights; others are kept), stored as their
        namespace's storage says.

        Raises:
            ValueError: a dynamic table's entry without its map (a client's full-table state dict)."""
        for key, entry in state.items():
            old = self.shards.get(key)
            store = old.store if old is not None else self.stores.get(key.rpartition("/")[0], RowStore())
            if entry.get("dynamic") is not None or (old is not None and old.dynamic is not None):  # seed: state's
                self.shards[key] = self._dynamic_shard(entry["spec"], 0, store, entry.get("dynamic") or {})
                continue
            self.shards[key] = Shard(entry["spec"], store.encode(entry["weight"].clone()),
                                      None if entry["state"] is None else entry["state"].clone(), store=store)
        for namespace in self.layouts:
            self._fuse(namespace)

    def memory(self) -> dict[str, int]:
        """``{"rows", "bytes"}`` held: embedding rows of every shard, and the bytes of their stored rows plus
        optimizer state."""
        rows = sum(sh.spec.num_rows for sh in self.shards.values())
        size = sum(sh.weight.numel() * sh.weight.element_size()
                   + (0 if sh.state is None else sh.state.numel() * sh.state.element_size())
                   for sh in self.shards.values())
        return {"rows": rows, "bytes": size}

    def save(self, directory: str) -> str:
        """Write ``<directory>/<name>.pt`` atomically; returns its path."""
        path = Path(directory) / f"{self.name}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, path)
        return str(path)

    def _writes(self) -> dict[str, Future]:
        """The background writes of :meth:`save_shards` not yet reported, by sub-folder."""
        return self.__dict__.setdefault("_shard_writes", {})

    def save_shards(self, namespace: str, directory: str, paths: Mapping[str, str]) -> dict[str, Any]:
        """Copy this server's shards of ``namespace`` and write them on a background thread as a DCP checkpoint in
        ``<directory>/<namespace>@<name>`` (:func:`scheduling.ps.dcp_shards.write_shards`): ``"<path>.weight"``
        ``(N, D)`` and ``"<path>.momentum"`` ``(N,)`` chunks at the shard's row offset, a dynamic table's state
        whole (``paths``: table name -> its state-dict path). Returns once copied: ``{"copy_s": seconds, "rows"}``;
        :meth:`save_status` reports the write.

        Raises:
            KeyError: a table of ``namespace`` held here that ``paths`` does not name.
            RuntimeError: a write to the same sub-folder is still running.
        """
        start = time.perf_counter()
        copy = self.state_dict(namespace)
        tensors: dict[str, tuple[torch.Tensor, int, int]] = {}
        for entry in copy.values():
            spec: ShardSpec = entry["spec"]
            if spec.table.name not in paths:
                raise KeyError(f"server {self.name}: save_shards got no path for table {spec.table.name!r} of "
                               f"{namespace!r} (paths for {sorted(paths)})")
            path, rows = paths[spec.table.name], spec.table.num_embeddings
            if entry["dynamic"] is not None:
                tensors.update({k: (v, 0, v.shape[0] if v.dim() else 0)
                                for k, v in dcp_shards.flatten_dynamic(path, entry["dynamic"]).items()})
                continue
            tensors[f"{path}.weight"] = (entry["weight"], spec.row_start, rows)
            if entry["state"] is not None:
                tensors[f"{path}.momentum"] = (entry["state"], spec.row_start, rows)
        copy_s = time.perf_counter() - start
        target = str(dcp_shards.subfolder(directory, namespace, self.name))
        writes = self._writes()
        if target in writes and not writes[target].done():
            raise RuntimeError(f"server {self.name}: a checkpoint write to {target} is still running")
        for old in [k for k, f in writes.items() if f.done()][:max(0, len(writes) - 15)]:
            writes.pop(old)   # the oldest finished ones
        future: Future = Future()
        writes[target] = future
        if not tensors:   # nothing of this namespace here: no sub-folder
            future.set_result({"fingerprints": {}, "bytes": 0, "write_s": 0.0})
            return {"copy_s": copy_s, "rows": 0}
        threading.Thread(target=_write, args=(tensors, target, future), name=f"fxdist-dcp-{self.name}",
                         daemon=True).start()
        return {"copy_s": copy_s, "rows": sum(e["spec"].num_rows for e in copy.values())}

    def save_status(self, namespace: str, directory: str, wait: bool = True) -> dict[str, Any] | None:
        """The write :meth:`save_shards` started for ``namespace`` into ``directory``: None while it runs (``wait``
        False), else ``{"fingerprints": {key: int}, "bytes", "write_s"}`` (the last 16 writes are remembered).
        Per key its :func:`scheduling.ps.dcp_shards.fingerprint` over this server's rows: a table's sum over the
        servers does not depend on the layout.

        Raises:
            KeyError: no write of ``namespace`` into ``directory`` was started here (or it was long ago).
            Exception: the write's own error (e.g. OSError).
        """
        target = str(dcp_shards.subfolder(directory, namespace, self.name))
        writes = self._writes()
        if target not in writes:
            raise KeyError(f"server {self.name}: no checkpoint write to {target} to report")
        future = writes[target]
        if not wait and not future.done():
            return None
        return future.result()

    def load_shards(self, namespace: str, directory: str, paths: Mapping[str, str]) -> dict[str, int]:
        """Fill this server's shards of ``namespace`` (their rows as configured now) from the DCP checkpoint in
        ``directory`` (its merged ``.metadata``), reading only the saved chunks over their rows; a table whose
        optimizer state the checkpoint lacks keeps its own. Returns the loaded tensors' fingerprints (as
        :meth:`save_status`).

        Raises:
            KeyError: a table held here that ``paths`` does not name, or that the checkpoint lacks.
            ValueError: a saved table of another shape (:func:`scheduling.ps.dcp_shards.read_rows`).
        """
        meta = dcp_shards.read_metadata(os.path.join(directory, dcp_shards.METADATA)).state_dict_metadata
        targets: dict[str, tuple[torch.Tensor, int]] = {}
        entries: dict[str, dict[str, Any]] = {}
        for key, shard in self.shards.items():
            if not key.startswith(namespace + "/"):
                continue
            spec = shard.spec
            if spec.table.name not in paths:
                raise KeyError(f"server {self.name}: load_shards got no path for table {spec.table.name!r}")
            path = paths[spec.table.name]
            if shard.dynamic is not None:
                mine = {k: (torch.empty(tuple(v.size), dtype=v.properties.dtype), 0) for k, v in meta.items()
                        if k.startswith(f"{path}.dynamic.") and isinstance(v, dcp_shards.md.TensorStorageMetadata)}
                if not mine:
                    raise KeyError(f"server {self.name}: the checkpoint in {directory} has no {path + '.dynamic'!r}")
                targets.update(mine)
                entries[key] = {"spec": spec, "dynamic": mine, "path": path}
                continue
            weight = torch.empty(spec.num_rows, spec.table.embedding_dim)
            targets[f"{path}.weight"] = (weight, spec.row_start)
            state = None if shard.state is None else shard.state.clone()
            if state is not None and f"{path}.momentum" in meta:
                targets[f"{path}.momentum"] = (state, spec.row_start)
            entries[key] = {"spec": spec, "weight": weight, "state": state, "dynamic": None}
        dcp_shards.read_rows(directory, targets)
        for entry in entries.values():
            if entry["dynamic"] is not None:
                entry["dynamic"] = dcp_shards.unflatten_dynamic(
                    entry.pop("path"), {k: t for k, (t, _) in entry["dynamic"].items()})
        self.load_state_dict(entries)
        return {k: dcp_shards.fingerprint(t, off) for k, (t, off) in targets.items()}


def _write(tensors: dict[str, tuple[torch.Tensor, int, int]], target: str, future: Future) -> None:
    """:meth:`ServerState.save_shards`' background write; its result or error goes to ``future``."""
    try:
        start = time.perf_counter()
        size = dcp_shards.write_shards(tensors, target)
        prints = {k: dcp_shards.fingerprint(t, off) for k, (t, off, _) in tensors.items()}
        future.set_result({"fingerprints": prints, "bytes": size, "write_s": time.perf_counter() - start})
    except BaseException as e:  # noqa: BLE001  (reported by save_status)
        future.set_exception(e)
