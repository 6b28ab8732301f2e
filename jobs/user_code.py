"""Running your entry points once on the launcher, and naming your frame in their errors.

Preflight (:func:`check`) imports your entry points and calls :func:`first_step` on the first train batch before Ray starts, so a
shape or dtype error in your model or loss shows at once, as ``ConfigError`` (exit 2) with the exception's type
and message and the line of your code it came from (:func:`user_frame`).
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

__all__ = ["check", "user_frame", "user_error_frame", "describe", "first_step"]

_LIBRARY_ROOTS = tuple(str(Path(p).resolve()) for p in {Path(torch.__file__).parents[1], Path(sys.base_prefix),
                                                       Path(sys.prefix)})
"""Files under these are not the user's: site-packages (torch, torchrec, ray, ...), the Python library, and this
repository's packages (fxdist, scheduling, quant, jobs, recsys: the Criteo readers; the user's own files elsewhere count as
theirs)."""
_OURS = ("fxdist", "scheduling", "quant", "jobs", "recsys")


def _is_user_file(filename: str) -> bool:
    if filename.startswith("<"):
        return False
    if _is_library(filename):
        return False
    path = Path(filename).resolve()
    repo = Path(__file__).resolve().parents[1]
    return not (path.is_relative_to(repo) and path.relative_to(repo).parts[0] in _OURS)


def user_frame(exc: BaseException) -> str | None:
    """``"file:line in function"`` of the deepest frame of ``exc``'s traceback in the user's files, or None."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_file(f.filename)]
    if not frames:
        return None
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}"


_GENERATED_FROM = re.compile(r" from (.+):(\d+) in (\w+)$")
"""fxdist's generated code is named ``<eval_with_key>.fxdist.N from FILE:LINE in forward``."""


def user_error_frame(exc: BaseException) -> str | None:
    """Where your code raised ``exc``, if it is a deterministic error of yours: ``"file:line in function"`` of
    the code that called into the libraries (torch, ...), when that is your file or a GraphModule traced from
    your ``forward``; None when fxdist, scheduling, quant, jobs or recsys (the Criteo readers) raised it, and for errors of the machinery
    (RPC, Ray, connections, timeouts), which Ray Train retries.
    """
    if isinstance(exc, (OSError, TimeoutError, ConnectionError)) or type(exc).__module__.startswith(("ray", "torch.distributed")) \
            or type(exc).__name__ == "PSUnavailableError":
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    if frames and frames[-1].filename.endswith(f"fxdist{os.sep}graph_module.py"):
        # an op of a GraphModule's generated code raised it: fxdist (as torch.fx) printed the generated line to
        # the trainer's log and dropped the frames below; the code is your traced forward
        return "your model's forward (traced by fxdist; the trainer's log shows the generated line)"
    for f in reversed(frames):                      # the code that called into the libraries
        if _is_library(f.filename):
            continue
        if _is_user_file(f.filename):
            return f"{f.filename}:{f.lineno} in {f.name}"
        if not f.filename.startswith("<eval_with_key>"):
            return None                             # raised by fxdist, scheduling, quant, jobs or recsys
        m = _GENERATED_FROM.search(f.filename)     # generated code names the forward it was traced from
        return f"{m[1]}:{m[2]} in {m[3]}" if m and _is_user_file(m[1]) else None
    return None


def _is_library(filename: str) -> bool:
    path = Path(filename).resolve()
    return not filename.startswith("<") and (str(path).startswith(_LIBRARY_ROOTS) or "site-packages" in path.parts)


def describe(exc: BaseException) -> str:
    """``"TypeName: message (at file:line in function)"``."""
    where = user_frame(exc)
    return f"{type(exc).__name__}: {exc}" + (f" (at {where})" if where else "")


def first_step(config: Any, model: torch.nn.Module, batch: Any,
               parts: tuple[tuple, dict[str, Any], torch.Tensor] | None = None) -> Any:
    """Run ``model`` (or ``[train] train_step``) and the loss once on the first batch, without gradients.

    Args:
        batch: The first train batch as ``[data] batches`` yielded it (what ``train_step`` gets).
        parts: Its ``(args, kwargs, labels)`` (:func:`jobs.entry.split_batch`); needed without ``train_step``.

    Returns:
        The model's output (None with ``train_step``).

    Raises:
        ConfigError: your code raised (type, message, your file and line), or a built-in loss got an output
            that is not a tensor with one value per label.
    """
    from jobs.config import ConfigError
    from jobs.entry import BUILTIN_LOSSES, loss_fn, train_step_fn, user_metric

    step = train_step_fn(config)
    what = f"[train] train_step = {config.train.train_step!r}" if step else f"[model] factory = {config.model.factory!r}"
    args, kwargs, labels = parts if parts is not None else ((), {}, None)
    with torch.no_grad():
        try:
            out = step(model, batch) if step else model(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any error of user code is reported, with its frame
            raise ConfigError(f"{config.source}: {what}: the first batch fails: {describe(e)}") from e
        if step:
            return None
        name = config.train.loss
        if name in BUILTIN_LOSSES and not (isinstance(out, torch.Tensor) and out.numel() == labels.numel()):
            got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise ConfigError(f"{config.source}: [train] loss = {name!r} needs forward to return one value per "
                              f"label ({labels.numel()}), got {got}; name a loss entry point "
                              "'package.module:function' that takes the output as it is")
        for key, run in (("loss", lambda: loss_fn(config)(out, labels)),
                         ("metric", lambda: config.train.metric and user_metric(config, [out], [labels]))):
            try:
                run()
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001
                value = getattr(config.train, key)
                raise ConfigError(f"{config.source}: [train] {key} = {value!r}: the first batch fails: "
                                  f"{describe(e)}") from e
    return out


def check(config: Any) -> str:
    """Import every entry point and run the cheap checks (see the module docstring); returns a note for the log.

    Raises:
        ConfigError: naming the key and what is wrong.
    """
    from jobs import entry
    from jobs.config import ConfigError
    from jobs.optimizers import dense_optimizer

    model = entry.make_model(config)
    entry.loss_fn(config)
    step = entry.train_step_fn(config)
    ctx = entry.data_context(config, "train", 0, config.cluster.trainers)
    first = next(iter(entry._batches(config, ctx)), None)
    if first is None:
        raise ConfigError(f"{config.source}: [data] batches = {config.data.batches!r} gave no train batch for "
                          f"rank 0 of {config.cluster.trainers}")
    parts = None
    if step is None:  # with train_step the batch goes to it as yielded: not split, not bound to forward
        parts = entry.split_batch(first, f"{config.source}: [data] batches = {config.data.batches!r}: first batch",
                                  model.forward)
        try:
            inspect.signature(model.forward).bind(*parts[0], **parts[1])
        except TypeError as e:
            raise ConfigError(f"{config.source}: [data] batches: the first batch's inputs do not fit "
                              f"{type(model).__name__}.forward{inspect.signature(model.forward)}: {e}") from None
    first_step(config, model, first, parts)
    dense_optimizer(config, (p for p in model.parameters() if p.requires_grad))
    params = sum(p.numel() for p in model.parameters())
    return (f"your model: {type(model).__name__} from {config.model.factory} ({params:_} parameters); "
            f"batches from {config.data.batches}; loss {config.train.loss}")
