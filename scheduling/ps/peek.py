"""Read-only lookups ("peeks"): the rows a lookup would answer, without changing any table.

A lookup of a dynamic table (:mod:`scheduling.ps.dynamic`) is a *step*: it counts candidate occurrences,
admits ids, makes rows, refreshes the LRU last-seen steps, evicts and expires. Held-out evaluation must not do
that (it would admit held-out ids and evict training rows, so training would depend on when one evaluates), so
it sends ``peek`` requests instead:

- **Server** (:func:`peek`, the ``peek`` request of :data:`scheduling.ps.endpoints.METHODS`): the pooled sums a
  lookup would answer, a dynamic table's rows read with :meth:`~scheduling.ps.dynamic.DynamicTable.rows_of`
  (zeros for ids not admitted; no counting, admission, last-seen refresh, eviction or expiry, and the table's
  ``step`` does not advance). Fixed tables answer exactly as a lookup (a lookup changes nothing there). A peek
  is ordered like a lookup (:mod:`scheduling.ps.ordering`): it sees every push its client issued before it
  and, in a group of trainers, the pushes of the same count of every trainer.
- **Client** (:func:`read_only`, ``PSClient.read_only()``, ``scheduling.placement.read_only(gm)`` for a model's
  clients): while active, every lookup of those clients (``ps_lookup``, ``ps_lookup_start``: from any thread) is
  a peek. Peeks neither use nor drop a prefetched lookup (a training step's prefetch of the next batch stays
  for that step), are not counted in ``prefetch_hits`` or ``staleness``, and prefetches asked for meanwhile are
  not sent; a push meanwhile raises (evaluation must not train).

Source: Liu et al. 2022, "Monolith: Real Time Recommendation System With Collisionless Embedding Table" (§2.2:
admission and expiry are driven by training traffic); torch.fx paper §6.2.3 (parameter-server fetches).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["peek", "read_only", "peek_async"]


def peek(server: Any, namespace: str, batch: Any, compress: str | None = None) -> torch.Tensor:
    """Pooled sums ``(B, D_s)`` float32 of ``server`` (a :class:`~scheduling.ps.server.PSServer`) for ``batch``
    (the wire tuple of :mod:`scheduling.ps.server`), as ``server.lookup`` answers, without a step of any dynamic
    table: its rows are those it holds now, zeros for ids not admitted. Counted in the server's lookups.

    Raises:
        ValueError: no tables of ``namespace`` here, a feature missing from the batch, an id out of a fixed
            table's range, or an unknown ``compress``.
    """
    layout = server._layout(namespace)
    shards = [server.shards[f"{namespace}/{spec.key}"] for spec, _ in layout]
    if all(shard.dynamic is None for shard in shards):
        return server.lookup(namespace, batch, compress)  # fixed tables: a lookup has no side effect
    if server.fetch_delay_s > 0:
        time.sleep(server.fetch_delay_s)
    return server.answer(server._lookup_per_shard(namespace, batch, read_only=True), compress)


@contextlib.contextmanager
def read_only(*clients: Any) -> Iterator[None]:
    """While active, the lookups of ``clients`` (:class:`~scheduling.ps.client.PSClient`) are read-only peeks
    (see the module docstring); nestable. Use it around evaluation; it applies to every thread using them."""
    for client in clients:
        client._read_only += 1
    try:
        yield
    finally:
        for client in clients:
            client._read_only -= 1


def peek_async(client: Any, server: int, kjt: Any) -> Any:
    """Send ``client``'s read-only lookup of ``kjt`` to ``server`` (``PSClient.lookup_async`` in
    :func:`read_only` mode); waited like a lookup (``finish_lookup``). A prefetched lookup and the deferred pushes
    stay where they are (an ordered client's server applies those pushes first); an unordered client (``ordered=
    False``) waits its deferred pushes to ``server`` first, so that the peek sees them."""
    if not client.ordered:
        client.drain(server, 0)
    return client._lookup(client._call_async(server, "peek", (client.name, client._wire(kjt), client.compress),
                                             "lookup", ordered=True), kjt)
