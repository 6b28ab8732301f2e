"""Your model and data in ``fxdist launch``: entry points, the batch contract, losses and quality metrics.

A job trains your model instead of the built-in DLRM when its config names three entry points, each
``"package.module:function"`` (``module:Class.method`` works too); the module must be importable by the
Ray workers as well (on one machine they inherit the launcher's ``PYTHONPATH``)::

    [model]
    factory = "mypkg.models:make_model"    # factory(config) -> nn.Module, or factory() -> nn.Module
    [data]
    batches = "mypkg.data:batches"         # batches(ctx: DataContext) -> iterable of batches
    [train]
    loss = "mse"                           # "bce_with_logits" | "mse" | "mypkg.losses:my_loss"
    train_step = "mypkg.train:step"        # optional: step(model, batch) -> loss, used instead of loss

``factory`` is called after ``torch.manual_seed([job] seed)``, once per phase and trainer (every call must
give the same weights, so that both phases start alike). ``batches(ctx)`` is called with a
:class:`DataContext` for ``ctx.split == "train"`` (this trainer's batches: shard by ``ctx.rank`` /
``ctx.world_size``) and ``"eval"`` (the held-out batches, read on rank 0; return ``[]`` for none). The train
iterable is one epoch: when it ends, the job calls ``batches`` again. It must be deterministic (the same
batches for the same ``ctx``): each phase reads its own copy and they are compared step by step.

With ``[train] loss`` a batch is split into the model's inputs and its labels, in one of three forms (labels: a
``(B,)`` or ``(B, 1)`` float tensor; the inputs: tensors, torchrec ``KeyedJaggedTensor`` s or anything your
``forward`` takes; :func:`split_batch`)::

    (input_1, ..., input_n, labels)        # a tuple or list: model(input_1, ..., input_n)
    {"name": input, ..., "labels": labels} # a dict: model(name=input, ...)
    a dataclass with a ``labels`` field    # model(field=value, ...) for its other fields, when forward takes
                                           # them as keywords; else model(batch), when forward takes one
                                           # argument (torchrec's ``Batch`` with ``DLRMTrain.forward(batch)``)

A dataclass whose fields ``forward`` takes neither way is a :class:`jobs.config.ConfigError` naming ``[data]
batches`` and ``forward``'s signature. Held-out ("eval") batches are always split so, with ``train_step`` too.

Every batch moves to the trainer's device keeping its type (:func:`move_batch`): tensors inside tuples, lists,
dicts and dataclasses move, and an object with its own ``.to(device)`` (a ``KeyedJaggedTensor``, torchrec's
``Batch`` or any ``Pipelineable``) is moved by it; with parameter servers the ``KeyedJaggedTensor`` s stay on the
CPU (the servers' lookups take them there). With ``async_rpc_prefetch`` the optimized module takes
``next_<input>`` arguments: the job passes the next batch's input of the same name (see
:class:`jobs.trainer.pipeline.TrainPipeline`).

``train_step(model, batch) -> loss`` (optional) is your own forward and loss for one training batch: ``batch`` is
the batch exactly as ``batches`` yielded it, of any type (not split, not checked against ``forward``; moved to the
trainer's device as above), ``model`` the phase's trained module (eager or optimized, wrapped in DDP with several
trainers; call it once per step: with prefetch the call also carries the next batch's lookups), and it returns a
scalar tensor; the job then runs ``loss.backward()`` and the optimizer step. ``[train] loss`` still names the
held-out quality metric (:func:`quality`). A batch's sample count (the QPS) is its labels' length when it
splits, else the first dimension of the first tensor in it (:func:`batch_rows`).

Every entry point is imported and checked before Ray starts (:func:`jobs.user_code.check`): the factory is called once
and must return an ``nn.Module``, the first train batch must follow the contract, and its loss must have a gradient
(preflight runs forward, the loss and ``loss.backward()`` on it); a problem is a :class:`jobs.config.ConfigError`
naming the key and your file and line (``fxdist launch`` exits with status 2).

Source: Ray Train ``train_loop_per_worker`` (user code run in every worker); torchrec ``KeyedJaggedTensor``.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from jobs.config import ConfigError, JobConfig
from jobs.records import Quality

__all__ = ["DataContext", "resolve", "split_batch", "move_batch", "batch_rows", "make_model", "data_context",
           "epoch_batches", "endless", "loss_fn", "train_step_fn", "quality", "binary_score", "BUILTIN_LOSSES"]

BUILTIN_LOSSES = ("bce_with_logits", "mse")


@dataclass(frozen=True)
class DataContext:
    """What ``batches(ctx)`` gets."""

    split: str
    """"train" (this trainer's share of the training data) or "eval" (the held-out data)."""
    rank: int
    """This trainer's rank in ``[0, world_size)`` (0 for "eval")."""
    world_size: int
    """Trainers sharing the training data (1 for "eval")."""
    batch_size: int
    """``[job] batch_size``: samples per step and trainer."""
    seed: int
    """``[job] seed``."""
    path: str = ""
    """``[data] path`` ("" = your function's default)."""
    eval_fraction: float = 0.1
    """``[data] eval_fraction``: the share of the data to hold out for "eval"."""
    options: dict = field(default_factory=dict)
    """``[data] options``."""


def resolve(spec: str, key: str, source: str = "<config>") -> Callable:
    """The callable ``"package.module:attr.path"`` names.

    Raises:
        ConfigError: naming ``key``: not of that form, the module does not import (with the import error),
            no such attribute, or not callable.
    """
    module_name, colon, attr = spec.partition(":")
    where = f"{source}: {key} = {spec!r}"
    if not colon or not module_name or not attr:
        raise ConfigError(f"{where}: expected 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises while importing
        raise ConfigError(f"{where}: cannot import {module_name!r}: {type(e).__name__}: {e}{_path_hint(e, module_name)}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{where}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{where}: {attr!r} is a {type(obj).__name__}, not a function")
    return obj


def _path_hint(e: Exception, module_name: str) -> str:
    """What to do when the entry point's own package (not a module it imports) is not on ``sys.path``."""
    missing = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
    if not missing or not (module_name == missing or module_name.startswith(f"{missing}.")):
        return ""
    return (f" (Python finds {missing!r} only on sys.path: run fxdist from the folder that holds it with "
            f"PYTHONPATH=$PWD, or pip install it; the Ray workers import it too)")


def _takes(fn: Callable, count: int) -> bool:
    try:
        inspect.signature(fn).bind(*([None] * count))
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): let the call decide
        return True
    return True


def make_model(config: JobConfig) -> nn.Module:
    """``factory(config)`` (or ``factory()``) of ``[model] factory``, after ``torch.manual_seed([job] seed)``.

    Raises:
        ConfigError: the factory cannot be resolved, takes other arguments, or returns no ``nn.Module``.
    """
    factory = resolve(config.model.factory, "[model] factory", config.source)
    torch.manual_seed(config.job.seed)
    if _takes(factory, 1):
        model = factory(config)
    elif _takes(factory, 0):
        model = factory()
    else:
        raise ConfigError(f"{config.source}: [model] factory = {config.model.factory!r}: must take the job config "
                          "or no argument")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{config.source}: [model] factory = {config.model.factory!r} returned a "
                          f"{type(model).__name__}, expected an nn.Module")
    return model


def data_context(config: JobConfig, split: str, rank: int = 0, world_size: int = 1) -> DataContext:
    d = config.data
    return DataContext(split, rank, world_size, config.job.batch_size, config.job.seed, d.path, d.eval_fraction,
                       dict(d.options))


def _batches(config: JobConfig, ctx: DataContext) -> Iterable[Any]:
    fn = resolve(config.data.batches, "[data] batches", config.source)
    if not _takes(fn, 1):
        raise ConfigError(f"{config.source}: [data] batches = {config.data.batches!r}: must take one argument, "
                          "a jobs.entry.DataContext")
    out = fn(ctx)
    if out is None or not isinstance(out, Iterable):
        raise ConfigError(f"{config.source}: [data] batches = {config.data.batches!r} returned "
                          f"{type(out).__name__}, expected an iterable of batches ({ctx.split} split)")
    return out


def epoch_batches(config: JobConfig, ctx: DataContext) -> list[Any]:
    """One epoch of ``ctx.split``'s batches (a list)."""
    return list(_batches(config, ctx))


def endless(config: JobConfig, ctx: DataContext, start: int = 0) -> Iterator[Any]:
    """Train batches without end: ``batches(ctx)`` again after each epoch, from batch ``start`` on.

    Raises:
        ConfigError: an epoch without any batch.
    """
    seen = 0
    while True:
        empty = True
        for batch in _batches(config, ctx):
            empty = False
            if seen >= start:
                yield batch
            seen += 1
        if empty:
            raise ConfigError(f"{config.source}: [data] batches = {config.data.batches!r} gave no batch for the "
                              f"train split of rank {ctx.rank} of {ctx.world_size}")


def split_batch(batch: Any, where: str = "batch", forward: Callable | inspect.Signature | None = None,
                ) -> tuple[tuple, dict[str, Any], torch.Tensor]:
    """``(args, kwargs, labels)`` of a batch, the model then called as ``model(*args, **kwargs)`` (the three forms
    of the module docstring; the parts are the batch's own objects).

    Args:
        where: What the batch is, for errors (e.g. ``"test.toml: [data] batches = 'm:f': first batch"``).
        forward: The model's ``forward`` (or its signature), which decides a dataclass batch: its fields other
            than ``labels`` as keyword arguments when ``forward`` takes them, else ``args = (batch,)`` when it
            takes one argument. None: the keyword form.

    Raises:
        ConfigError: naming ``where``: another type, no labels, labels that are not a ``(B,)`` tensor, or a
            dataclass whose fields ``forward`` takes neither way.
    """
    if isinstance(batch, (tuple, list)) and not hasattr(batch, "_fields"):
        if len(batch) < 2:
            raise ConfigError(f"{where}: a tuple batch is (input_1, ..., input_n, labels); got {len(batch)} item(s)")
        args, kwargs, labels = tuple(batch[:-1]), {}, batch[-1]
    elif isinstance(batch, dict) or (dataclasses.is_dataclass(batch) and not isinstance(batch, type)):
        items = dict(batch) if isinstance(batch, dict) else {f.name: getattr(batch, f.name)
                                                              for f in dataclasses.fields(batch)}
        if "labels" not in items:
            raise ConfigError(f"{where}: a {type(batch).__name__} batch needs a 'labels' entry (has "
                              f"{sorted(items)})")
        labels = items.pop("labels")
        args, kwargs = (), items
        if not isinstance(batch, dict) and forward is not None:
            args, kwargs = _dataclass_call(batch, items, where, forward)
    else:
        raise ConfigError(f"{where}: expected a tuple (inputs..., labels), a dict or a dataclass with 'labels', got "
                          f"{type(batch).__name__}")
    if not isinstance(labels, torch.Tensor) or labels.dim() == 0:
        raise ConfigError(f"{where}: labels must be a (B,) tensor, got {type(labels).__name__}"
                          f"{tuple(labels.shape) if isinstance(labels, torch.Tensor) else ''}")
    return args, kwargs, labels


def _dataclass_call(batch: Any, fields: dict[str, Any], where: str,
                    forward: Callable | inspect.Signature) -> tuple[tuple, dict[str, Any]]:
    """``((), fields)`` when ``forward`` binds the fields as keywords, else ``((batch,), {})`` when it binds one
    positional argument (see :func:`split_batch`)."""
    try:
        sig = forward if isinstance(forward, inspect.Signature) else inspect.signature(forward)
    except (TypeError, ValueError):  # no signature: the keyword form, the call decides
        return (), fields
    for args, kwargs in (((), fields), ((batch,), {})):
        try:
            sig.bind(*args, **kwargs)
        except TypeError:
            continue
        return args, kwargs
    raise ConfigError(f"{where}: a {type(batch).__name__} (dataclass) batch goes to forward{sig} either as its "
                      f"fields other than 'labels' as keyword arguments ({', '.join(fields)}) or whole, as "
                      "forward's one argument; this forward takes neither. Rename forward's parameters after the "
                      "fields, give it one parameter for the batch, or set [train] train_step to call the model "
                      "yourself")


def move_batch(batch: Any, device: torch.device | str, *, own_to: bool = True) -> Any:
    """``batch`` with its tensors on ``device``, of the same type and structure (tuples, named tuples, lists, dicts
    and dataclasses are rebuilt around their moved items; anything else is kept as it is).

    Args:
        own_to: Move an object that has its own ``.to(device)`` (a ``KeyedJaggedTensor``, torchrec's ``Batch``
            or another ``Pipelineable``) by it. False (tables on parameter servers): such objects stay where
            they are, except dataclasses, whose fields are moved one by one.
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    is_dataclass = dataclasses.is_dataclass(batch) and not isinstance(batch, type)
    if own_to and callable(getattr(batch, "to", None)) and not isinstance(batch, (tuple, list, dict)):
        return batch.to(device)
    if is_dataclass:
        moved = {f.name: move_batch(getattr(batch, f.name), device, own_to=own_to)
                 for f in dataclasses.fields(batch) if f.init}
        same = all(v is getattr(batch, k) for k, v in moved.items())
        return batch if same else dataclasses.replace(batch, **moved)
    if isinstance(batch, dict):
        out = copy.copy(batch)
        for k, v in batch.items():
            out[k] = move_batch(v, device, own_to=own_to)
        return out
    if isinstance(batch, (tuple, list)):
        items = [move_batch(v, device, own_to=own_to) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def batch_rows(batch: Any, default: int) -> int:
    """The samples in a batch: its labels' length when it splits (:func:`split_batch`), else the first dimension
    of the first tensor found in it (depth first through tuples, lists, dicts and dataclass fields), else
    ``default`` (``[job] batch_size``)."""
    try:
        return split_batch(batch)[2].shape[0]
    except ConfigError:
        pass
    stack = [batch]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            if item.dim() > 0:
                return item.shape[0]
        elif isinstance(item, dict):
            stack[:0] = list(item.values())
        elif isinstance(item, (tuple, list)):
            stack[:0] = list(item)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack[:0] = [getattr(item, f.name) for f in dataclasses.fields(item)]
    return default


def train_step_fn(config: JobConfig) -> Callable[[Any, Any], torch.Tensor] | None:
    """``train_step(model, batch) -> loss`` of ``[train] train_step``, or None when it is not set.

    Raises:
        ConfigError: the entry point does not resolve or does not take ``(model, batch)``.
    """
    spec = config.train.train_step
    if not spec:
        return None
    fn = resolve(spec, "[train] train_step", config.source)
    if not _takes(fn, 2):
        raise ConfigError(f"{config.source}: [train] train_step = {spec!r}: must take (model, batch)")
    return fn


def loss_fn(config: JobConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss(output, labels)`` of ``[train] loss``; built-ins flatten ``(B, 1)`` outputs to ``(B,)``.

    Raises:
        ConfigError: neither a built-in name nor ``'package.module:function'``, an entry point that cannot be
            imported, or one that does not take ``(output, labels)``.
    """
    name = config.train.loss
    if name == "bce_with_logits":
        return lambda out, y: nn.functional.binary_cross_entropy_with_logits(out.reshape(y.shape), y.float())
    if name == "mse":
        return lambda out, y: nn.functional.mse_loss(out.reshape(y.shape), y.float())
    if ":" not in name:
        raise ConfigError(f"{config.source}: [train] loss = {name!r}: expected one of {', '.join(BUILTIN_LOSSES)} "
                          "or 'package.module:function'")
    fn = resolve(name, "[train] loss", config.source)
    if not _takes(fn, 2):
        raise ConfigError(f"{config.source}: [train] loss = {name!r}: must take (output, labels)")
    return fn


def quality(config: JobConfig, outputs: list[Any], labels: list[torch.Tensor]) -> Quality:
    """Held-out quality of the outputs of every eval batch: AUC / log loss ("bce_with_logits"), RMSE with its
    standard error ("mse", :func:`jobs.stats.regression_metrics`), else the mean loss over batches with its
    standard error (``eval_loss``, ``eval_loss_se``) and, when every label is 0 or 1, the AUC and log loss of
    the score :func:`binary_score` finds (``auc``, ``log_loss``, ``positives``, ``score``: which output it
    is), or ``score_note`` saying why there is none."""
    if not outputs:
        return {}
    base = _builtin_quality(config, outputs, labels)
    if config.train.metric:
        base["metric"] = user_metric(config, outputs, labels)
    return base


def user_metric(config: JobConfig, outputs: list[Any], labels: list[torch.Tensor]) -> dict[str, float]:
    """``[train] metric``: your ``fn(outputs, labels) -> {name: float}`` over the held-out batches (each
    ``outputs[i]`` as your model returned it, ``labels[i]`` its ``(B,)`` labels).

    Raises:
        ConfigError: it does not return a dict of names to numbers.
    """
    fn = resolve(config.train.metric, "[train] metric", config.source)
    value = fn(outputs, labels)
    if not (isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, (int, float)) for k, v in value.items())):
        raise ConfigError(f"{config.source}: [train] metric = {config.train.metric!r} returned "
                          f"{type(value).__name__} {value!r:.80}, expected a dict of names to numbers")
    return {k: float(v) for k, v in value.items()}


def _builtin_quality(config: JobConfig, outputs: list[Any], labels: list[torch.Tensor]) -> Quality:
    from jobs.stats import binary_metrics, regression_metrics

    name = config.train.loss
    y = torch.cat([t.reshape(-1).float() for t in labels])
    if name in BUILTIN_LOSSES:
        pred = torch.cat([o.detach().reshape(-1).float().cpu() for o in outputs])
        return binary_metrics(torch.sigmoid(pred), y) if name == "bce_with_logits" else regression_metrics(pred, y)
    fn = loss_fn(config)
    values = torch.tensor([float(fn(o, t)) for o, t in zip(outputs, labels)], dtype=torch.float64)
    sizes = torch.tensor([t.shape[0] for t in labels], dtype=torch.float64)
    mean = float((values * sizes).sum() / sizes.sum())
    se = float(values.std() / math.sqrt(len(values))) if len(values) > 1 else float("nan")
    out: Quality = {"eval_loss": mean, "eval_loss_se": se, "rows": int(sizes.sum())}
    if bool(((y == 0) | (y == 1)).all()):  # binary labels: the AUC of the model's score, whatever its loss
        scores, where = binary_score(outputs, labels)
        if scores is None:
            out["score_note"] = f"no AUC: {where}"
        else:
            p = scores if bool(((scores >= 0) & (scores <= 1)).all()) else torch.sigmoid(scores)
            out.update(binary_metrics(p, y))
            out["score"] = where
    return out


def binary_score(outputs: list[Any], labels: list[torch.Tensor]) -> tuple[torch.Tensor | None, str]:
    """The score the AUC of a binary-label model with its own loss is computed from, by this rule: the output
    when it is a floating tensor with one value per label; for a structure (tuple, list, dict, dataclass
    registered with pytree), its first leaf in ``torch.utils._pytree`` order that is a floating tensor with
    one value per label (``numel == B``), e.g. the logits of torchrec's ``DLRMTrain``, which returns
    ``(loss, (loss, logits, labels))``. The same leaf position in every batch. Values all in [0, 1] are taken
    as probabilities, others as logits (a sigmoid is applied; the AUC does not depend on which).

    Shapes: ``outputs[i]`` the model's output for batch ``i``; ``labels[i]`` ``(B_i,)``.

    Returns:
        ``(scores (N,) float64 over all batches, "output leaf k of <structure>")``, or ``(None, why)`` when no
        leaf qualifies in every batch.
    """
    from torch.utils._pytree import tree_flatten

    found: int | None = None
    flat = [tree_flatten(o)[0] for o in outputs]
    for k in range(len(flat[0]) if flat else 0):
        if all(k < len(leaves) and isinstance(leaves[k], torch.Tensor) and leaves[k].is_floating_point()
               and leaves[k].numel() == t.numel() for leaves, t in zip(flat, labels)):
            found = k
            break
    if found is None:
        kind = type(outputs[0]).__name__ if outputs else "nothing"
        return None, (f"no output leaf is a floating tensor with one value per label in every batch (the model "
                      f"returns a {kind}; rule: jobs.entry.binary_score)")
    where = "the output" if isinstance(outputs[0], torch.Tensor) else \
        f"output leaf {found} of {type(outputs[0]).__name__} (pytree order)"
    return torch.cat([leaves[found].detach().reshape(-1).double().cpu() for leaves in flat]), where
