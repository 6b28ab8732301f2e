"""``PSEmbeddingBagCollection``: torchrec's ``EmbeddingBagCollection`` with its tables on parameter servers.

Shapes: ``forward(kjt)`` -> ``KeyedTensor`` with values ``(B, sum_f D_f)``, keys = the client's feature
names (tables in declaration order, then each table's features), as torchrec's EBC returns.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import ops as _ops
from .client import PSClient, get_client

__all__ = ["PSEmbeddingBagCollection"]


class PSEmbeddingBagCollection(nn.Module):
    """Pooled embedding lookups served by a :class:`PSClient`'s servers.

    ``forward`` = :meth:`lookup` (one blocking ``ps_lookup`` leaf per server holding a shard) + :meth:`pool`.
    For training, call :meth:`push` after backward with the looked-up parts, or build
    it with ``push_in_backward=True`` to push each gradient from an autograd hook during backward (eager
    mode only).

    Args:
        client: the client or its registry name.
        push_in_backward: push gradients from backward hooks (blocking) instead of explicit :meth:`push`.
    """

    def __init__(self, client: PSClient | str = "ps", push_in_backward: bool = False) -> None:
        super().__init__()
        ps = get_client(client) if isinstance(client, str) else client
        self.client_name = ps.name
        self.server_ids = ps.servers_for()
        self.push_in_backward = push_in_backward

    @property
    def client(self) -> PSClient:
        """The live client."""
        return get_client(self.client_name)

    def lookup(self, kjt: Any) -> list[torch.Tensor]:
        """One lookup per server: ``[(B, D_s)]`` in :attr:`server_ids` order."""
        parts = [_ops.ps_lookup(self.client_name, s, kjt) for s in self.server_ids]
        if self.push_in_backward and self._eager(parts):
            for s, part in zip(self.server_ids, parts):
                part.register_hook(_PushHook(self.client_name, s, kjt))
        return parts

    @staticmethod
    def _eager(parts: list[Any]) -> bool:
        return all(isinstance(p, torch.Tensor) and p.requires_grad for p in parts)

    def pool(self, kjt: Any, parts: list[Any]) -> Any:
        """Per-server parts -> ``KeyedTensor`` (row-wise partials summed, mean pooling applied)."""
        return _ops.ps_pool(self.client_name, kjt, *parts)

    def forward(self, kjt: Any) -> Any:
        """Pooled embeddings of ``kjt`` as a ``KeyedTensor``."""
        return self.pool(kjt, self.lookup(kjt))

    def push(self, kjt: Any, parts: list[Any], after: Any = None) -> list[Any]:
        """Blocking push of each part's ``.grad`` to its server (``after`` orders the nodes after backward)."""
        return [_ops.ps_push(self.client_name, s, kjt, part, after) for s, part in zip(self.server_ids, parts)]


class _PushHook:
    """Autograd hook: push the gradient of one looked-up part during backward."""

    def __init__(self, client: str, server: int, kjt: Any) -> None:
        self.client, self.server, self.kjt = client, server, kjt

    def __call__(self, grad: torch.Tensor) -> None:
        ps = get_client(self.client)
        ps.finish_push(ps.push_grad_async(self.server, self.kjt, grad), self.server)
