"""The configuration and checkpoint requests of :class:`~scheduling.ps.client.PSClient` (a mixin it inherits):
create the shards on the servers, gather and scatter whole tables, per-server shard states (the input of
:mod:`scheduling.ps.reshard`), server-side checkpoint files and checkpoints by shard (:mod:`scheduling.ps.dcp_shards`:
each server writes and reads its own rows; nothing passes through this client but small reports).

Source: torch.fx paper §6.2.3 (tables on parameter servers); torch's ``nn.Module.state_dict`` naming
(``"<table>.weight"``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .device import to_host
from .shard_plan import ShardSpec

__all__ = ["ClientState"]


class ClientState:
    """Configuration and checkpoints of a client's tables; needs the client's ``servers``, ``shards``, ``name``,
    ``optimizer``, ``optimizer_kwargs``, ``seed``, ``storage``, ``flush``, ``_call`` and ``_call_async``."""

    servers: list[str]
    shards: list[ShardSpec]
    name: str
    optimizer: str
    optimizer_kwargs: dict[str, float]
    seed: int
    storage: str

    if TYPE_CHECKING:  # provided by PSClient
        def flush(self, drop_prefetched: bool = False) -> None: ...
        def _call(self, server: int, method: str, args: tuple, what: str) -> Any: ...
        def _call_async(self, server: int, method: str, args: tuple, what: str, ordered: bool = False,
                        push: bool = False) -> torch.futures.Future: ...
        def _wait(self, fut: torch.futures.Future, server: int, what: str) -> Any: ...

    def configure(self, init_weights: Mapping[str, torch.Tensor] | None = None) -> None:
        """Create the shards on every server (in parallel)."""
        futs = []
        for s in range(len(self.servers)):
            mine = {t: to_host(w) for t, w in (init_weights or {}).items()
                    if any(sp.server == s and sp.table.name == t for sp in self.shards)}
            futs.append(self._call_async(s, "configure", (self.name, self.shards, s, self.optimizer,
                                                                   self.optimizer_kwargs, self.seed, mine or None,
                                                                   self.storage),
                                         "configure"))
        for s, fut in enumerate(futs):
            self._wait(fut, s, "configure")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full tables gathered from the servers: ``"<table>.weight"`` ``(N, D)`` and, with row-wise Adagrad,
        ``"<table>.momentum"`` ``(N,)``."""
        self.flush()
        out: dict[str, torch.Tensor] = {}
        for s in range(len(self.servers)):
            for entry in self._call(s, "state_dict", (self.name,), "state_dict").values():
                spec: ShardSpec = entry["spec"]
                t = spec.table
                if spec.row_start == 0 and spec.row_end == t.num_embeddings:  # a whole table: the answer's copy
                    out[f"{t.name}.weight"] = entry["weight"]
                    if entry["state"] is not None:
                        out[f"{t.name}.momentum"] = entry["state"]
                    continue
                w = out.setdefault(f"{t.name}.weight", torch.zeros(t.num_embeddings, t.embedding_dim))
                w[spec.row_start:spec.row_end] = entry["weight"]
                if entry["state"] is not None:
                    m = out.setdefault(f"{t.name}.momentum", torch.zeros(t.num_embeddings))
                    m[spec.row_start:spec.row_end] = entry["state"]
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Scatter full tables (as from :meth:`state_dict`) to the shards on the servers.

        Raises:
            KeyError: a table's weight is missing from ``state``.
        """
        self.flush(drop_prefetched=True)  # prefetched rows are stale after the load
        for s in range(len(self.servers)):
            payload = {}
            for spec in (sp for sp in self.shards if sp.server == s):
                name = spec.table.name
                if f"{name}.weight" not in state:
                    raise KeyError(f"load_state_dict: no '{name}.weight' in the state (keys: {sorted(state)})")
                mom = state.get(f"{name}.momentum")
                payload[f"{self.name}/{spec.key}"] = {
                    "spec": spec, "weight": to_host(state[f"{name}.weight"][spec.row_start:spec.row_end]),
                    "state": None if mom is None else to_host(mom[spec.row_start:spec.row_end])}
            self._call(s, "load_state_dict", (payload,), "load_state_dict")

    def server_states(self) -> list[dict[str, Any]]:
        """Per server, its shards of this client's tables as ``PSServer.state_dict`` gives them (``{"<name>/<shard
        key>": {"spec", "weight", "state", "dynamic"}}``, a dynamic table with its id -> slot map): the input of
        :func:`scheduling.ps.reshard.gather_tables`. Waits this client's pushes first."""
        self.flush()
        return [self._call(s, "state_dict", (self.name,), "state_dict") for s in range(len(self.servers))]

    def load_server_states(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Write per-server shard states (as :meth:`server_states`, or :func:`scheduling.ps.reshard.scatter_tables`
        for this client's current :attr:`shards`) to the servers: ``states[s]`` goes to server ``s``.

        Raises:
            ValueError: ``states`` has another length than this client's servers.
        """
        if len(states) != len(self.servers):
            raise ValueError(f"load_server_states: {len(states)} server states for the {len(self.servers)} servers "
                             f"of client {self.name!r}")
        self.flush(drop_prefetched=True)  # prefetched rows are stale after the load
        for s, payload in enumerate(states):
            if payload:
                self._call(s, "load_state_dict", (dict(payload),), "load_state_dict")

    def checkpoint(self, directory: str | Path) -> list[str]:
        """Every server writes ``<directory>/<server name>.pt`` (on its own file system); returns the paths.
        Restart a server from its file with ``start_server(..., checkpoint=path)``."""
        self.flush()
        futs = [self._call_async(s, "save", (str(directory),), "checkpoint")
                for s in range(len(self.servers))]
        return [self._wait(f, s, "checkpoint") for s, f in enumerate(futs)]

    def _each(self, method: str, args: tuple, what: str) -> list[Any]:
        """``method(*args)`` on every server at once; their answers, in server order."""
        futs = [self._call_async(s, method, args, what) for s in range(len(self.servers))]
        return [self._wait(f, s, what) for s, f in enumerate(futs)]

    def save_shards(self, directory: str | Path, paths: Mapping[str, str]) -> list[dict[str, Any]]:
        """Every server copies its shards of this client's tables and answers, then writes them as a DCP
        checkpoint under ``directory`` in the background (``PSServer.save_shards``; ``paths``: table name -> its
        state-dict path). Waits this client's pushes first. Returns each server's ``{"copy_s", "rows"}``;
        :meth:`save_status` reports the writes."""
        self.flush()
        return self._each("save_shards", (self.name, str(directory), dict(paths)), "save_shards")

    def save_status(self, directory: str | Path, wait: bool = True) -> list[dict[str, Any] | None]:
        """Each server's report of its :meth:`save_shards` write into ``directory`` (``PSServer.save_status``:
        None while it runs, with ``wait`` False)."""
        return self._each("save_status", (self.name, str(directory), wait), "save_status")

    def load_shards(self, directory: str | Path, paths: Mapping[str, str]) -> list[dict[str, int]]:
        """Every server fills its shards of this client's tables from the DCP checkpoint folder ``directory``
        (``PSServer.load_shards``: it reads the rows itself). Prefetched rows are dropped first. Returns each
        server's fingerprints of what it loaded."""
        self.flush(drop_prefetched=True)
        return self._each("load_shards", (self.name, str(directory), dict(paths)), "load_shards")
