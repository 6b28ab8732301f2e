"""The job's optimizers from ``[train]``: the dense part's (a ``torch.optim`` class or your factory) and the
arguments of the parameter servers' table optimizer.

Raises ``ConfigError`` naming the key for a class or factory that does not resolve, keyword arguments it does
not take, or a factory that does not return a ``torch.optim.Optimizer`` (preflight calls
:func:`dense_optimizer` once on the launcher, so these show before Ray starts).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypedDict

import torch

from jobs.config import ConfigError, JobConfig

__all__ = ["dense_optimizer", "TableOptimizerArgs", "table_optimizer_args"]


def dense_optimizer(config: JobConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``[train] optimizer`` over ``params`` with ``[train] optimizer_kwargs`` (``lr`` defaults to ``[job] lr``).

    Raises:
        ConfigError: the class or factory does not resolve, rejects the keyword arguments, or returns no
            ``torch.optim.Optimizer``.
    """
    t = config.train
    where = f"{config.source}: [train] optimizer = {t.optimizer!r}"
    kwargs = {"lr": config.job.lr, **t.optimizer_kwargs}
    if ":" in t.optimizer:
        from jobs.entry import resolve

        make: Any = resolve(t.optimizer, "[train] optimizer", config.source)
    else:
        make = getattr(torch.optim, t.optimizer.removeprefix("torch.optim."), None)
        if not (isinstance(make, type) and issubclass(make, torch.optim.Optimizer)):
            raise ConfigError(f"{where}: not a torch.optim class")
    try:
        optimizer = make(list(params), **kwargs)
    except TypeError as e:
        raise ConfigError(f"{where} with [train] optimizer_kwargs = {kwargs}: {e}") from None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"{where}: returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
    return optimizer


class TableOptimizerArgs(TypedDict):
    """Keyword arguments of ``scheduling.placement.parameter_servers`` from the config (:func:`table_optimizer_args`)."""

    optimizer: str
    """``[train] table_optimizer``."""
    lr: float
    """``[train] table_lr``, else ``[job] lr``."""
    grad_reduction: str
    """``[train] table_grad_reduction``."""
    plan: dict[str, str | int] | None
    """``[model] plan``: table, weight path or module -> ``"table_wise"`` | ``"row_wise"`` | server index |
    ``"local"``; None when empty."""
    local_below_rows: int
    """``[model] local_below_rows``."""


def table_optimizer_args(config: JobConfig) -> TableOptimizerArgs:
    """Keyword arguments of the ``parameter_servers`` pass from ``[train]``, ``[model] plan`` and ``[model]
    local_below_rows``."""
    t = config.train
    return {"optimizer": t.table_optimizer, "lr": t.table_lr or config.job.lr,
            "grad_reduction": t.table_grad_reduction, "plan": dict(config.model.plan) or None,
            "local_below_rows": config.model.local_below_rows}
