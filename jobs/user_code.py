"""Running your entry points once on the launcher, and naming your frame in their errors.

Preflight (:func:`check`) imports your entry points and calls :func:`first_step` on the first train batch before Ray
starts: forward, the loss and ``loss.backward()``, as a trainer's step (no optimizer step: no weight changes). So a
shape or dtype error in your model or loss, or a loss without gradient (computed from detached outputs: it would
fail at ``loss.backward()`` in every trainer), shows at once, as ``ConfigError`` (exit 2) with the exception's
type and message and the line of your code it came from (:func:`user_frame`), or the loss's entry point and the
file and line of its ``def`` (:func:`loss_entry`).

In the trainers, :func:`user_error_frame` tells your deterministic errors (recorded once, not retried) from the
machinery's (retried by Ray Train); an autograd error at the trainer's ``loss.backward()`` because the loss has
no gradient is yours, of the loss's entry point.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any, cast

import torch

__all__ = ["check", "user_frame", "user_error_frame", "describe", "first_step", "loss_entry", "source_place"]

_LIBRARY_ROOTS = tuple(str(Path(p).resolve()) for p in {Path(torch.__file__).parents[1], Path(sys.base_prefix),
                                                       Path(sys.prefix)})
"""Files under these are not the user's: site-packages (torch, torchrec, ray, ...), the Python library, and this
repository's packages (fxdist, scheduling, quant, jobs, recsys: the Criteo readers; the user's own files elsewhere
count as theirs)."""
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


_NO_GRAD = re.compile(r"does not require grad and does not have a grad_fn")
"""autograd's message for ``backward()`` of a tensor that no parameter's gradient flows into."""


def user_error_frame(exc: BaseException, config: Any = None) -> str | None:
    """Where your code raised ``exc``, if it is a deterministic error of yours: ``"file:line in function"`` of
    the code that called into the libraries (torch, ...), when that is your file or a GraphModule traced from
    your ``forward``; for autograd's ``RuntimeError`` (``element 0 of tensors does not require grad ...``) raised
    at the trainer's ``loss.backward()``, the loss's entry point (:func:`loss_entry` of ``config``, the job's
    :class:`jobs.config.JobConfig`; unnamed when None). None when fxdist, scheduling, quant, jobs or recsys (the
    Criteo readers) raised it, and for errors of the machinery (RPC, Ray, connections, timeouts), which Ray
    Train retries.
    """
    if isinstance(exc, (OSError, TimeoutError, ConnectionError)) or type(exc).__module__.startswith(("ray", "torch.distributed")) \
            or type(exc).__name__ == "PSUnavailableError":
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    caller = next((f for f in reversed(frames) if not _is_library(f.filename)), None)
    if isinstance(exc, RuntimeError) and _NO_GRAD.search(str(exc)) and caller is not None \
            and not _is_user_file(caller.filename) and ".backward(" in (caller.line or ""):
        return _no_grad_loss(config)                # our loss.backward() of your loss
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


def _no_grad_loss(config: Any) -> str:
    """Where a loss without gradient came from: ``"file:line in f ([train] loss = 'm:f', whose loss has no
    gradient)"``."""
    what = "your [train] loss, train_step or model's forward"
    if config is not None:
        try:
            what, place = loss_entry(config)
        except Exception:  # noqa: BLE001 - it resolved at preflight; name the keys if it does not here
            place = None
        if place:
            return f"{place} ({what}, whose loss has no gradient)"
    return f"{what} (the loss has no gradient)"


def _is_library(filename: str) -> bool:
    path = Path(filename).resolve()
    return not filename.startswith("<") and (str(path).startswith(_LIBRARY_ROOTS) or "site-packages" in path.parts)


def describe(exc: BaseException) -> str:
    """``"TypeName: message (at file:line in function)"``."""
    where = user_frame(exc)
    return f"{type(exc).__name__}: {exc}" + (f" (at {where})" if where else "")


def source_place(fn: Any) -> str | None:
    """``"file:line in name"`` of the ``def`` of a function, method or callable object (its ``__call__``), or
    None when it has no Python source."""
    target = inspect.unwrap(fn)
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        target = getattr(type(target), "__call__", target)  # noqa: B004 - its class's __call__, for the source
    try:
        file, line = inspect.getsourcefile(target), inspect.getsourcelines(target)[1]
    except (TypeError, OSError):
        return None
    return f"{file}:{line} in {target.__name__}" if file else None


def loss_entry(config: Any, model: torch.nn.Module | None = None) -> tuple[str, str | None]:
    """The entry point that makes the loss the trainers backpropagate, and its place (:func:`source_place`):
    ``("[train] train_step = 'm:f'", "file:line in f")``, else ``[train] loss``, else (a built-in loss of the
    model's output) ``[model] factory`` with ``model``'s ``forward`` (the factory without ``model``).

    Raises:
        ConfigError: the entry point does not resolve.
    """
    from jobs.entry import BUILTIN_LOSSES, resolve

    train = config.train
    key, spec = (("[train] train_step", train.train_step) if train.train_step else
                 ("[train] loss", train.loss) if train.loss not in BUILTIN_LOSSES else
                 ("[model] factory", config.model.factory))
    fn = type(model).forward if model is not None and key == "[model] factory" else resolve(spec, key, config.source)
    return f"{key} = {spec!r}", source_place(fn)


_NO_GRAD_HINT = ("compute it from the model's output without detach(), .item(), .numpy() or torch.no_grad() "
                 "(torchrec's DLRMTrain returns (loss, (loss.detach(), logits.detach(), labels)): its loss is "
                 "output[0])")


def first_step(config: Any, model: torch.nn.Module, batch: Any,
               parts: tuple[tuple, dict[str, Any], torch.Tensor] | None = None) -> Any:
    """Run one training step's forward, loss and ``loss.backward()`` on the first batch, as a trainer does
    (``model(*args, **kwargs)`` and ``[train] loss``, or ``[train] train_step(model, batch)``), then ``[train]
    metric`` on the output without gradients. No optimizer steps and every parameter's ``.grad`` is put back as
    it was: the weights do not change (``model`` is preflight's own, built for the check).

    Args:
        batch: The first train batch as ``[data] batches`` yielded it (what ``train_step`` gets).
        parts: Its ``(args, kwargs, labels)`` (:func:`jobs.entry.split_batch`); needed without ``train_step``.

    Returns:
        The model's output (None with ``train_step``).

    Raises:
        ConfigError: your code raised (type, message, your file and line); a built-in loss got an output that is
            not a tensor with one value per label; the loss is not a scalar tensor or has no gradient (naming the
            loss's entry point and its file and line: ``loss.backward()`` would fail in every trainer); or
            ``loss.backward()`` raised.
    """
    from jobs.config import ConfigError
    from jobs.entry import user_metric

    grads = [(p, p.grad) for p in model.parameters()]
    try:
        with torch.enable_grad():
            out, loss = _forward_and_loss(config, model, batch, parts)
            entry, place = loss_entry(config, model)
            where = f"{config.source}: {entry}" + (f" (at {place})" if place else "")
            scalar = isinstance(loss, torch.Tensor) and (loss.dim() == 0 if config.train.train_step else
                                                         loss.numel() == 1)
            if not scalar:
                got = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                       else type(loss).__name__)
                raise ConfigError(f"{where}: the first batch's loss is {got}, expected a scalar tensor")
            if not loss.requires_grad:
                raise ConfigError(f"{where}: the first batch's loss has no gradient (requires_grad is False), so "
                                  f"loss.backward() would fail in every trainer; {_NO_GRAD_HINT}")
            try:
                loss.backward()
            except Exception as e:  # noqa: BLE001
                raise ConfigError(f"{where}: loss.backward() of the first batch fails: {describe(e)}") from e
    finally:
        for p, grad in grads:
            p.grad = grad
    if out is not None and config.train.metric:
        from torch.utils._pytree import tree_map_only

        _, _, labels = cast("tuple[tuple, dict[str, Any], torch.Tensor]", parts)  # given when there is an output
        with torch.no_grad():
            _run_user(config, "metric", lambda: user_metric(
                config, [tree_map_only(torch.Tensor, torch.Tensor.detach, out)], [labels]))
    return out


def _forward_and_loss(config: Any, model: torch.nn.Module, batch: Any,
                      parts: tuple[tuple, dict[str, Any], torch.Tensor] | None) -> tuple[Any, Any]:
    """``(output, loss)`` of the first batch (output None with ``train_step``), with gradients."""
    from jobs.config import ConfigError
    from jobs.entry import BUILTIN_LOSSES, loss_fn, train_step_fn

    step = train_step_fn(config)
    what = f"[train] train_step = {config.train.train_step!r}" if step else f"[model] factory = {config.model.factory!r}"
    args, kwargs, labels = parts if parts is not None else ((), {}, None)
    try:
        out = step(model, batch) if step else model(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - any error of user code is reported, with its frame
        raise ConfigError(f"{config.source}: {what}: the first batch fails: {describe(e)}") from e
    if step:
        return None, out
    labels = cast(torch.Tensor, labels)  # parts is given without train_step
    name = config.train.loss
    if name in BUILTIN_LOSSES and not (isinstance(out, torch.Tensor) and out.numel() == labels.numel()):
        got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(f"{config.source}: [train] loss = {name!r} needs forward to return one value per "
                          f"label ({labels.numel()}), got {got}; name a loss entry point "
                          "'package.module:function' that takes the output as it is")
    return out, _run_user(config, "loss", lambda: loss_fn(config)(out, labels))


def _run_user(config: Any, key: str, run: Any) -> Any:
    """``run()``; an exception of your ``[train] <key>`` as a ConfigError naming it (and your file and line)."""
    from jobs.config import ConfigError

    try:
        return run()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{config.source}: [train] {key} = {getattr(config.train, key)!r}: the first batch "
                          f"fails: {describe(e)}") from e


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
