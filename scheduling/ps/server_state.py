"""The checkpoint requests of :class:`~scheduling.ps.server.PSServer` (a mixin it inherits): copies of its shards,
loading them back, the memory they hold and server-side checkpoint files; and :class:`Shard`, one shard it holds.

Source: torch.fx paper §6.2.3 (tables on parameter servers); torch's ``nn.Module.state_dict`` / ``load_state_dict``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

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
