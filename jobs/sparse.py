"""Where a job's embedding tables live: in the trainers, or on parameter servers.

``make_tables(config, ...)`` returns a *tables backend* with one interface used by the training loop:

- ``prepare(ids)``: the model's sparse input for a batch's ``(B, 26)`` ids;
- ``view(phase)``: the backend of one phase's tables (phases train side by side, each with its own
  tables, from the same initial weights); a view has the methods below;
- ``sparse_arch()``: the module mapping ids ``(B, 26)`` to embeddings ``(B, 26, D)``, or ``None``
  for the model's own :class:`jobs.model.LocalEmbeddings`;
- ``after_backward()``: push embedding gradients (servers) or nothing (local tables are DDP parameters);
- ``sync()``: wait for this trainer's updates in flight (before checkpoints and evaluation);
- ``fetch_seconds()``: seconds blocked on embedding fetches since the last call, or ``None``;
- ``prefetch_hits()``: lookups answered by a prefetch so far;
- ``placement_pass()`` / ``attach(gm)`` (only for your model on servers): the ``parameter_servers`` pass the
  phase's module gets first, and the module it produced;
- ``state_dict()`` / ``load_state_dict(state)``: the tables' contents for checkpoints (rank 0);
- ``close()``.

The parameter-server backend lives in :mod:`jobs.ps`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["LocalTables", "make_tables"]


class LocalTables:
    """Embedding tables inside the model (DDP parameters with sparse gradients)."""

    def prepare(self, ids: Any) -> Any:
        return ids

    def view(self, phase: str) -> "LocalTables":
        """Itself: each phase's tables are in its own model."""
        return self

    def sparse_arch(self) -> nn.Module | None:
        return None

    def after_backward(self) -> None:
        """Nothing to do: DDP all-reduces the sparse gradients and the optimizer applies them."""

    def fetch_seconds(self) -> float | None:
        return None

    def prefetch_hits(self) -> int:
        return 0

    def sync(self) -> None:
        """Nothing in flight."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to do: the tables are in the model's state dict."""

    def close(self, graceful: bool = True) -> None:
        pass


def make_tables(config, rank: int, world: int, loop_config: dict[str, Any], exporter) -> Any:
    """The tables backend of this trainer: local when ``[cluster] parameter_servers = 0``."""
    if config.cluster.parameter_servers == 0:
        return LocalTables()
    from jobs.ps import ServerTables, UserServerTables

    phases = ("baseline", "optimized") if config.phases.baseline else ("optimized",)
    cls = UserServerTables if config.user_model else ServerTables
    return cls(config, rank, world, loop_config, exporter, phases)
