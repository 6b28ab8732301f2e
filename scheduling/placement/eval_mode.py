"""Evaluation of a model whose tables the ``parameter_servers`` pass moved: read-only lookups.

``with scheduling.placement.read_only(gm): gm(...)`` runs the model with every lookup of its clients sent as a
read-only peek (:mod:`scheduling.ps.peek`): a dynamic table makes no step (no admission, LRU refresh, eviction or
expiry), a prefetch that training started for its next step is neither used nor dropped, and a push raises. So
training that follows is the same whether and how often one evaluates in between.

Source: Liu et al. 2022, "Monolith: Real Time Recommendation System With Collisionless Embedding Table" (§2.2);
torch.fx paper §6.2.3 (parameter-server fetches).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["read_only"]


@contextlib.contextmanager
def read_only(gm: Any) -> Iterator[None]:
    """While active, the lookups of ``gm``'s clients (a GraphModule after the pass, a DDP around one; any other
    module: nothing changes) are read-only (``PSClient.read_only``). Nestable.

    Raises:
        KeyError: a client of ``gm`` was closed (``scheduling.ps.get_client``).
    """
    from ..ps.client import get_client
    from ..ps.peek import read_only as clients_read_only

    inner = gm.module if isinstance(gm, nn.parallel.DistributedDataParallel) else gm
    meta = getattr(inner, "meta", None) or {}  # the pass's record, as scheduling.placement.client_names reads it
    names = dict.fromkeys(meta.get("fxdist", {}).get("placement", {}).get("clients", {}).values())
    with clients_read_only(*(get_client(n) for n in names)):
        yield
