"""Row-wise optimizers applied on the parameter server to sparse gradients.

A push delivers, per shard, the unique local rows touched in the step and their summed gradients; the
optimizer updates only those rows, in place.

Source: FBGEMM ``EmbOptimType.SGD`` and ``EXACT_ROWWISE_ADAGRAD`` (as used by torchrec's fused optimizers):
row-wise Adagrad keeps one accumulator per row, ``m[r] += mean_j(g[r, j]^2)``,
``w[r] -= lr * g[r] / (sqrt(m[r]) + eps)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dynamic_native import scatter_rows
from .storage import RowStore

_FP32 = RowStore()

__all__ = ["RowWiseOptimizer", "RowWiseSGD", "RowWiseAdagrad", "make_optimizer"]


class RowWiseOptimizer:
    """Base class: ``state_shape(num_rows, dim)`` and ``step(weight, state, rows, grads)``."""

    name: str = "base"

    def init_state(self, num_rows: int, dim: int) -> torch.Tensor | None:
        """The per-shard optimizer state (None when stateless)."""
        return None

    def step(self, weight: torch.Tensor, state: torch.Tensor | None, rows: torch.Tensor,
             grads: torch.Tensor, store: RowStore | None = None) -> None:
        """Update ``weight[rows]`` in place.

        Shapes: weight ``(R, D)`` float32, or stored rows of ``store`` (:mod:`scheduling.ps.storage`:
        decoded, updated in float32, encoded back); rows ``(U,)`` unique local row ids (int64); grads
        ``(U, D)``.

        Raises:
            NotImplementedError: on the base class; each optimizer (``RowWiseSGD``, ...) implements it.
        """
        raise NotImplementedError


@dataclass
class RowWiseSGD(RowWiseOptimizer):
    """Plain SGD on the touched rows: ``w[r] -= lr * g[r]``."""

    lr: float = 0.01
    """Learning rate."""
    name = "sgd"

    def step(self, weight, state, rows, grads, store=None):  # noqa: D102 - see base class
        _apply(weight, rows, grads, self.lr, store)


@dataclass
class RowWiseAdagrad(RowWiseOptimizer):
    """Row-wise Adagrad (FBGEMM ``EXACT_ROWWISE_ADAGRAD``): one accumulator per row."""

    lr: float = 0.01
    """Learning rate."""
    eps: float = 1e-8
    """Added to ``sqrt(m)`` in the denominator."""
    initial_accumulator_value: float = 0.0
    """Start value of every row's accumulator."""
    name = "rowwise_adagrad"

    def init_state(self, num_rows, dim):  # noqa: D102 - see base class
        return torch.full((num_rows,), float(self.initial_accumulator_value))

    def step(self, weight, state, rows, grads, store=None):  # noqa: D102 - see base class
        assert state is not None
        acc = state.index_select(0, rows) + grads.pow(2).mean(dim=1)
        scatter_rows(state, rows, acc)
        _apply(weight, rows, grads / (acc.sqrt() + self.eps).unsqueeze(1), self.lr, store)


def _apply(weight: torch.Tensor, rows: torch.Tensor, update: torch.Tensor, lr: float,
           store: RowStore | None) -> None:
    """``weight[rows] -= lr * update`` for unique ``rows`` (see :meth:`RowStore.apply`)."""
    (store or _FP32).apply(weight, rows, update, lr)


def make_optimizer(name: str, **kwargs: float) -> RowWiseOptimizer:
    """``"sgd"`` or ``"rowwise_adagrad"`` (alias ``"adagrad"``) with its hyper-parameters.

    Raises:
        ValueError: unknown optimizer name.
    """
    if name == "sgd":
        return RowWiseSGD(**kwargs)
    if name in ("rowwise_adagrad", "adagrad"):
        return RowWiseAdagrad(**kwargs)
    raise ValueError(f"unknown parameter-server optimizer {name!r} (use 'sgd' or 'rowwise_adagrad')")
