"""After the ``parameter_servers`` pass: a placed model's clients, and its tables as ``state_dict`` entries.

``gm`` is the GraphModule the pass returned (or a ``DistributedDataParallel`` around it); the pass recorded its
clients and tables in ``gm.meta["fxdist"]["placement"]``.

Source: torch's ``nn.Module.state_dict`` / ``load_state_dict`` (the keys and shapes of the original tables).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["client_names", "close", "flush", "load_table_state_dict", "table_state_dict"]


def client_names(gm: Any) -> list[str]:
    """Names of the clients the pass created for ``gm`` (a GraphModule, or a DDP around one)."""
    gm = getattr(gm, "module", gm) if isinstance(gm, nn.parallel.DistributedDataParallel) else gm
    return list(dict.fromkeys(gm.meta.get("fxdist", {}).get("placement", {}).get("clients", {}).values()))


def flush(gm: Any) -> None:
    """Wait every push still in flight (and every prefetched lookup) of ``gm``'s clients; call after training."""
    from ..ps.client import get_client

    for name in client_names(gm):
        get_client(name).flush()


def close(gm: Any) -> None:
    """:func:`flush`, then unregister ``gm``'s clients (their tables stay on the servers)."""
    from ..ps.client import get_client

    for name in client_names(gm):
        get_client(name).close()


def table_state_dict(gm: Any, optimizer_state: bool = False) -> dict[str, torch.Tensor]:
    """The moved tables as in the original model's ``state_dict``: ``{"<path>.weight": (N, D)}``; with
    ``optimizer_state`` also the servers' row-wise Adagrad state ``{"<path>.momentum": (N,)}`` (when the
    optimizer has one). Waits this trainer's pushes first."""
    from ..ps.client import get_client

    meta = _placement_meta(gm)
    out, states = {}, {}
    for qualname, name in meta["clients"].items():
        if name not in states:  # a group's modules share one client
            states[name] = get_client(name).state_dict()
        state = states[name]
        for t in meta["tables"]:
            if t["module"] == qualname:
                out[f"{t['path']}.weight"] = state[f"{t['table']}.weight"]
                if optimizer_state and f"{t['table']}.momentum" in state:
                    out[f"{t['path']}.momentum"] = state[f"{t['table']}.momentum"]
    return out


def load_table_state_dict(gm: Any, state: Mapping[str, torch.Tensor]) -> None:
    """Write tables (as from :func:`table_state_dict`, optionally with ``"<path>.momentum"``) to the servers.

    Shapes: ``"<path>.weight"`` ``(N, D)``; ``"<path>.momentum"`` ``(N,)`` (absent: the servers' optimizer
    state of that table starts from zero).

    Raises:
        KeyError: a moved table's ``"<path>.weight"`` is missing from ``state`` (the message lists the keys).
        ValueError: a weight's shape differs from the table's.
    """
    from ..ps.client import get_client

    meta = _placement_meta(gm)
    per_client: dict[str, dict[str, torch.Tensor]] = {}
    for qualname, name in meta["clients"].items():
        mine = per_client.setdefault(name, {})   # a group's modules share one client: one load for all
        for t in (t for t in meta["tables"] if t["module"] == qualname):
            key = f"{t['path']}.weight"
            if key not in state:
                raise KeyError(f"load_table_state_dict: no {key!r} in the state (keys: {sorted(state)})")
            if tuple(state[key].shape) != (t["rows"], t["dim"]):
                raise ValueError(f"load_table_state_dict: {key!r} has shape {tuple(state[key].shape)}, the table on "
                                 f"the servers is ({t['rows']}, {t['dim']})")
            mine[f"{t['table']}.weight"] = state[key]
            if f"{t['path']}.momentum" in state:
                mine[f"{t['table']}.momentum"] = state[f"{t['path']}.momentum"]
    for name, mine in per_client.items():
        get_client(name).load_state_dict(mine)


def _placement_meta(gm: Any) -> dict[str, Any]:
    gm = getattr(gm, "module", gm) if isinstance(gm, nn.parallel.DistributedDataParallel) else gm
    meta = getattr(gm, "meta", {}).get("fxdist", {}).get("placement", {})
    if "clients" not in meta:
        raise ValueError(f"{type(gm).__name__} has no tables on parameter servers (run the parameter_servers "
                         "pass on it first)")
    return meta
