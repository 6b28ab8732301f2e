"""The config checks between keys that concern one feature each (:meth:`jobs.config.JobConfig.validate` calls
them and raises ``ConfigError`` with the config file's name in front of each message): the table optimizer keys and
``[model] plan`` (:func:`train_errors`), and dynamic tables (:func:`dynamic_errors`).

Source: the ``[model]`` / ``[train]`` / ``[cluster]`` keys of :mod:`jobs.config`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["train_errors", "dynamic_errors"]


def train_errors(t: Any, plan: dict, user_model: bool = True) -> list[str]:
    """The optimizer keys and ``[model] plan`` ("local" only for your model: the built-in DLRM's tables are made on
    the servers, the meta device on the trainers); a ``"pkg.mod:fn"`` optimizer is resolved by preflight."""
    import torch

    errors = []
    name = t.optimizer.removeprefix("torch.optim.")
    if ":" not in name and not (isinstance(getattr(torch.optim, name, None), type)
                                and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)):
        errors.append(f"[train] optimizer = {t.optimizer!r}: not a torch.optim class (e.g. \"Adam\") or "
                      "\"package.module:function\"")
    if t.table_optimizer not in ("rowwise_adagrad", "adagrad", "sgd"):
        errors.append(f'[train] table_optimizer = {t.table_optimizer!r}: must be "rowwise_adagrad", "adagrad" or '
                      '"sgd" (the optimizers the parameter servers run)')
    if t.table_grad_reduction not in ("mean", "sum"):
        errors.append(f'[train] table_grad_reduction = {t.table_grad_reduction!r}: must be "mean" or "sum"')
    for table, how in plan.items():
        if how not in ("table_wise", "row_wise", "local") and not (isinstance(how, int) and how >= 0):
            errors.append(f'[model] plan: {table} = {how!r}: must be "table_wise", "row_wise", "local" or a server index')
        elif how == "local" and not user_model:
            errors.append(f'[model] plan: {table} = "local": only your model\'s tables ([model] factory) can stay on '
                          "the trainers; for the built-in DLRM's set [cluster] parameter_servers = 0")
    return errors


def dynamic_errors(m: Any, c: Any, user_model: bool) -> list[str]:
    """``[model] table_sizes = "dynamic"``: the built-in DLRM's 26 tables as collisionless dynamic tables on the
    parameter servers, so it needs servers (``[cluster] parameter_servers >= 1``), the built-in model (your
    model's tables are yours to declare: the ``parameter_servers`` pass's ``dynamic=``), and table-wise placement
    (raw ids have no row ranges: no ``"row_wise"`` in ``[model] plan``). ``m``, ``c``: the ``[model]`` and
    ``[cluster]`` sections; ``dynamic_capacity`` and the other ``dynamic_*`` keys are range-checked with every key."""
    if m.table_sizes != "dynamic":
        return []
    errors = []
    if c.parameter_servers < 1:
        errors.append('[model] table_sizes = "dynamic" needs [cluster] parameter_servers >= 1 (dynamic tables live on '
                      "the parameter servers; got parameter_servers = 0)")
    if user_model:
        errors.append('[model] table_sizes = "dynamic" is for the built-in DLRM, not [model] factory = '
                      f'{m.factory!r}: declare your dynamic tables with the parameter_servers pass\'s dynamic= argument')
    rows = [t for t, how in m.plan.items() if how == "row_wise"]
    if rows:
        errors.append(f'[model] plan: {rows[0]} = "row_wise": dynamic tables ([model] table_sizes = "dynamic") are '
                      "placed table-wise only (raw ids have no row ranges)")
    return errors
