"""A :class:`~scheduling.ps.client.PSClient`'s options, in one frozen dataclass, checked when built.

Source: the options of ``PSClient`` (:mod:`scheduling.ps.client`); step order: :mod:`scheduling.ps.ordering`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from .shard_plan import Sharding
from .storage import STORAGES

__all__ = ["ClientOptions", "GRAD_REDUCTIONS"]

GRAD_REDUCTIONS = ("mean", "sum")


@dataclasses.dataclass(frozen=True)
class ClientOptions:
    """How a ``PSClient`` shards, trains, stores and reaches its tables (every field has a default).

    Attributes:
        sharding: ``"table_wise"``, ``"row_wise"`` or a mapping table name -> scheme.
        optimizer: ``"rowwise_adagrad"`` or ``"sgd"``, applied on the servers; ``optimizer_kwargs`` e.g.
            ``{"lr": 0.05}``.
        name: registry name (graph nodes refer to the client by it) and the servers' namespace of its
            tables: trainers sharing tables use the same name.
        timeout_s: every request fails with ``PSUnavailableError`` after this many seconds.
        compress: ``"fused8bit"`` to receive lookups quantized with FBGEMM's fused 8-bit row-wise format.
        seed: seed of the initial weights.
        ordered: each server applies this client's lookups and pushes in the order they were issued.
        rank, world_size, group: this trainer's rank among the ``world_size`` trainers sharing these tables,
            and the key the group shares (needed, with ``ordered``, when ``world_size > 1``: step order).
        storage: ``"fp32"``, ``"fp16"`` or ``"fused8bit"`` (:mod:`scheduling.ps.storage`).
        transport: ``"torch_rpc"``, ``"ray"`` or None (picked from the servers).
        grad_reduction: ``"mean"`` (each push divided by ``world_size``, as DDP) or ``"sum"``.
        device: where looked-up rows go when the batch's ids are on the CPU; None: the CPU.

    Raises:
        ValueError: a ``rank`` outside ``[0, world_size)``, ``world_size > 1`` without ``ordered`` and
            ``group``, or an unknown ``grad_reduction``, ``storage`` or ``compress``.
    """

    sharding: Sharding | Mapping[str, Sharding] = "table_wise"
    optimizer: str = "rowwise_adagrad"
    optimizer_kwargs: Mapping[str, float] | None = None
    name: str = "ps"
    timeout_s: float = 30.0
    compress: str | None = None
    seed: int = 0
    ordered: bool = True
    rank: int = 0
    world_size: int = 1
    group: str | None = None
    storage: str = "fp32"
    transport: str | None = None
    grad_reduction: str = "mean"
    device: str | torch.device | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"PSClient: rank {self.rank} is not in [0, world_size={self.world_size})")
        if self.world_size > 1 and (not self.group or not self.ordered):
            raise ValueError(f"PSClient {self.name!r}: world_size={self.world_size} needs ordered=True and a group "
                             "key shared by the trainers (group=...)")
        if self.grad_reduction not in GRAD_REDUCTIONS:
            raise ValueError(f"PSClient: unknown grad_reduction={self.grad_reduction!r} (use 'mean' or 'sum')")
        if self.storage not in STORAGES:
            raise ValueError(f"PSClient: unknown storage={self.storage!r} (use one of {', '.join(STORAGES)})")
        if self.compress not in (None, "fused8bit"):
            raise ValueError(f"PSClient: unknown compress={self.compress!r} (use None or 'fused8bit')")

    @property
    def grad_divisor(self) -> int:
        """What each pushed gradient is divided by: ``world_size`` for ``"mean"``, else 1."""
        return self.world_size if self.grad_reduction == "mean" else 1

    def replace(self, **changes: Any) -> "ClientOptions":
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)
