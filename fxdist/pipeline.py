"""``fxdist.optimize``: trace a training module, apply named passes, keep its Parameter objects.

>>> import torch, fxdist
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
>>> gm = fxdist.optimize(model, passes=("dce",))
>>> gm.get_submodule("0").weight is model[0].weight   # optimizers and DDP see the same parameters
True
>>> [record["name"] for record in gm.meta["fxdist"]["passes"]]
['dce']

Passes are named or given as callables. A name is fxdist's own (``dce``, ``reinplace``), one given to
:func:`register_pass`, or one an installed package declares as an entry point of the group
``fxdist.passes`` (the standard Python plugin mechanism; this project's ``pyproject.toml`` declares
``parameter_servers``, ``async_rpc``, ``async_rpc_prefetch`` and ``fuse`` there), imported on first use, so
fxdist's core names no package above it. Each pass is ``fn(gm) -> GraphModule`` (or a ``PassBase`` returning
``PassResult``); :class:`fxdist.passes.pass_base.PassManager` runs them in order on a copy, lints and
recompiles after each, times them, and records ``{"name", "ms", "nodes_added", "nodes_erased",
"modified"}`` per pass in ``gm.meta["fxdist"]["passes"]``.

A pass that changes nothing gets a :class:`NoOpPassWarning` naming it and why (``"async_rpc: changed
nothing: no blocking RPC found ..."``): the reason a pass records in ``gm.meta["fxdist"]["unchanged_reason"]``
while it runs, else the pass's entry in :data:`NO_OP_REASONS`. The reasons are kept in
``gm.meta["fxdist"]["unchanged"]`` (pass name -> reason).

A pass (or the function inside a ``functools.partial``) may carry ``fxdist_leaf_module``, a predicate
``nn.Module -> bool``: ``optimize`` then traces with those modules as leaves (one ``call_module`` node each), on
top of ``tracer_class``. The ``parameter_servers`` pass uses it to keep embedding modules whole.

Afterwards every submodule of the result whose state is unchanged is swapped back for the original
module object, so the result shares the caller's ``Parameter`` objects (and buffers): an optimizer built
on ``model.parameters()`` or ``DistributedDataParallel(gm)`` trains the same tensors. Parameters a pass
really changed (e.g. conv-BN folding) stay new; ``gm.meta["fxdist"]["new_parameters"]`` names them.

On a ``DistributedDataParallel`` module ``optimize`` is a collective of the DDP's process group: every rank calls
it together. A rank that calls it alone gets :class:`DDPRanksMissingError` naming the missing ranks after
``ddp_timeout_s`` (60 s by default), never a hang; the old DDP wrapper raises if called again.

Source: torch.fx paper §5 (program capture, transformation, codegen pipeline);
torch/fx/passes/infra/pass_manager.py.
"""

from __future__ import annotations

import copy
import functools
import importlib
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from fxdist.tracer import Tracer

__all__ = ["optimize", "register_pass", "resolve_pass", "known_passes", "PASSES", "NO_OP_REASONS",
           "NoOpPassWarning", "DDPRanksMissingError", "DDP_TIMEOUT_ENV"]

ENTRY_POINT_GROUP = "fxdist.passes"
"""Entry-point group in which installed packages declare their passes (``name = "module:attribute"``)."""

PASSES: dict[str, str | Callable] = {
    "reinplace": "fxdist.passes.reinplace:reinplace",
}
"""Pass name -> ``"module:attribute"`` (imported on first use) or a callable ``gm -> GraphModule``; the
entry points of :data:`ENTRY_POINT_GROUP` join it when a name is not found."""

NO_OP_REASONS: dict[str, str] = {
    "dce": "no dead node found",
    "reinplace": "no out-of-place op could be made in-place",
}
"""Pass name -> why it changes nothing, when the pass itself records no reason. A pass function may carry its
own as ``fxdist_no_op_reason``; resolving it by name records it here."""

UNCHANGED_REASON = "unchanged_reason"
"""Key of ``gm.meta["fxdist"]`` where a pass may put why it changed nothing (read and removed by ``optimize``)."""


class NoOpPassWarning(UserWarning):
    """A pass run by :func:`optimize` changed nothing (the message names the pass and why)."""

_TRACE_HINT = (
    "fxdist.optimize could not trace {cls}. Ways out: make the untraceable submodule a leaf (subclass "
    "fxdist.Tracer, override is_leaf_module, pass tracer_class=); fix the arguments that drive control flow "
    "with concrete_args={{...}}; or wrap the offending free function with fxdist.wrap('name'). "
    "A job can also run this phase eagerly with [job] allow_eager_fallback = true."
)


def _dce(gm: Any) -> Any:
    gm.graph.eliminate_dead_code()
    return gm


PASSES["dce"] = _dce


def register_pass(name: str, target: str | Callable) -> None:
    """Make ``name`` usable in ``optimize(passes=...)``: ``target`` is ``"module:attr"`` or a callable.

    Raises:
        TypeError: ``target`` is neither.
    """
    if not (callable(target) or (isinstance(target, str) and ":" in target)):
        raise TypeError(f"register_pass({name!r}): target must be 'module:attribute' or a callable, got {target!r}")
    PASSES[name] = target


def resolve_pass(spec: str | Callable) -> tuple[str, Callable]:
    """``(name, callable)`` of a pass given by name or directly.

    Raises:
        ValueError: an unknown pass name (the message lists the known ones).
        ImportError: the module implementing a named pass cannot be imported.
    """
    if callable(spec):
        inner = spec.func if isinstance(spec, functools.partial) else spec
        name = getattr(spec, "name", None) or getattr(inner, "name", None) or getattr(inner, "__name__", None) \
            or type(inner).__name__
        return str(name), spec
    if spec not in PASSES:
        _discover()
    if spec not in PASSES:
        raise ValueError(f"fxdist.optimize: unknown pass {spec!r}; known passes: {', '.join(sorted(PASSES))} "
                         f"(or pass a callable gm -> GraphModule; a package declares named passes as entry points "
                         f"of the group {ENTRY_POINT_GROUP!r}, or calls fxdist.register_pass)")
    target = PASSES[spec]
    if callable(target):
        return spec, _note_reason(spec, target)
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        e.add_note(f"fxdist.optimize: pass {spec!r} is implemented in {module_name!r}, which is not importable")
        raise
    try:
        return spec, _note_reason(spec, getattr(module, attr))
    except AttributeError:
        raise ImportError(f"fxdist.optimize: pass {spec!r}: module {module_name!r} has no attribute {attr!r}") from None


def known_passes() -> list[str]:
    """Every pass name :func:`optimize` accepts now: fxdist's, registered ones, and the entry points of
    :data:`ENTRY_POINT_GROUP` (found by name only: nothing is imported)."""
    _discover()
    return sorted(PASSES)


def _discover() -> None:
    """Add the passes installed packages declare in :data:`ENTRY_POINT_GROUP` (names only; nothing imported)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        PASSES.setdefault(ep.name, ep.value)


def _note_reason(name: str, fn: Callable) -> Callable:
    inner = fn.func if isinstance(fn, functools.partial) else fn
    reason = getattr(inner, "fxdist_no_op_reason", None)
    if reason:
        NO_OP_REASONS.setdefault(name, reason)
    return fn


class _Adapter:
    """Presents ``fn(gm) -> GraphModule | PassResult`` to PassManager as a named pass."""

    def __init__(self, name: str, fn: Callable) -> None:
        self.name = name
        self.fn = fn

    def __call__(self, gm: Any) -> Any:
        from fxdist.passes.pass_base import PassResult

        before = (str(gm.graph), _state_ids(gm))
        out = self.fn(gm)
        if not isinstance(out, PassResult):
            if out is None:  # an in-place pass that returns nothing
                out = gm
            if not hasattr(out, "graph"):
                raise TypeError(f"pass {self.name!r} returned {type(out).__name__}, expected a GraphModule")
            out = PassResult(out, out is not gm or (str(out.graph), _state_ids(out)) != before)
        meta = out.graph_module.meta.setdefault("fxdist", {})
        reason = meta.pop(UNCHANGED_REASON, None)
        if not out.modified:
            meta.setdefault("unchanged", {})[self.name] = reason or _default_reason(self.name, self.fn)
        return out


def _state_ids(gm: nn.Module) -> list[tuple[str, int]]:
    """Names and identities of the submodules, parameters and buffers (a pass may swap them, graph unchanged)."""
    named = [*gm.named_modules(), *gm.named_parameters(), *gm.named_buffers()]
    return [(name, id(obj)) for name, obj in named]


def _default_reason(name: str, fn: Callable) -> str:
    inner = fn.func if isinstance(fn, functools.partial) else fn
    return (NO_OP_REASONS.get(name) or getattr(inner, "fxdist_no_op_reason", None)
            or NO_OP_REASONS.get(getattr(inner, "__name__", "")) or "the graph is unchanged")


def _leaf_predicates(named: list[tuple[str, Callable]]) -> list[Callable[[nn.Module], bool]]:
    """The ``fxdist_leaf_module`` predicates of the passes (looking inside ``functools.partial``)."""
    preds = []
    for _, fn in named:
        inner = fn.func if isinstance(fn, functools.partial) else fn
        pred = getattr(fn, "fxdist_leaf_module", None) or getattr(inner, "fxdist_leaf_module", None)
        if pred is not None and pred not in preds:
            preds.append(pred)
    return preds


def _tracer_with_leaves(tracer_class: type[Tracer] | None, preds: list[Callable[[nn.Module], bool]]) -> type:
    """``tracer_class`` (default ``fxdist.Tracer``) that also keeps modules matching ``preds`` as leaves."""
    import fxdist

    base = tracer_class or fxdist.Tracer

    def is_leaf_module(self: Any, m: nn.Module, module_qualified_name: str) -> bool:
        return any(p(m) for p in preds) or base.is_leaf_module(self, m, module_qualified_name)

    return type(f"{base.__name__}WithPassLeaves", (base,), {"is_leaf_module": is_leaf_module})


def _warn_unchanged(gm: Any, records: list[dict[str, Any]]) -> None:
    unchanged = gm.meta.get("fxdist", {}).get("unchanged", {})
    for record in records:
        if not record["modified"] and record["name"] in unchanged:
            warnings.warn(f"{record['name']}: changed nothing: {unchanged[record['name']]}", NoOpPassWarning,
                          stacklevel=3)


def _trace(module: nn.Module, tracer_class: type[Tracer] | None, concrete_args: dict | None) -> Any:
    import fxdist

    try:
        if tracer_class is None:
            return fxdist.symbolic_trace(module, concrete_args=concrete_args)
        tracer = tracer_class()
        graph = tracer.trace(module, concrete_args=concrete_args)
        return fxdist.GraphModule(tracer.root, graph, type(module).__name__)
    except Exception as e:
        e.add_note(_TRACE_HINT.format(cls=type(module).__name__))
        raise


def _same_state(a: nn.Module, b: nn.Module) -> bool:
    if type(a) is not type(b):
        return False
    sa, sb = a.state_dict(keep_vars=True), b.state_dict(keep_vars=True)
    if sa.keys() != sb.keys():
        return False
    for key, x in sa.items():
        y = sb[key]
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            continue
        if x is not y and not _same_tensor(x, y):
            return False
    return True


def _same_tensor(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Same shape, dtype, device and values (``meta`` tensors have no values: shape, dtype and device)."""
    if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
        return False
    return x.is_meta or torch.equal(x.detach(), y.detach())


def _restore_originals(result: nn.Module, original: nn.Module, prefix: str = "") -> None:
    """Swap each unchanged child of ``result`` for ``original``'s module of the same name, top-down."""
    originals = dict(original.named_modules())
    for name, child in list(result.named_children()):
        qualname = f"{prefix}{name}"
        orig = originals.get(qualname)
        if orig is child:
            continue
        if orig is not None and _same_state(child, orig):
            setattr(result, name, orig)
        else:
            _restore_originals(child, original, prefix=f"{qualname}.")
    for name, value in list(result.named_parameters(recurse=False)):
        orig = dict(original.named_parameters()).get(f"{prefix}{name}")
        if orig is not None and orig is not value and _same_tensor(orig, value):
            setattr(result, name, orig)


def _run_passes(gm: Any, named: list[tuple[str, Callable]], example_inputs: Sequence[Any] | None) -> Any:
    from fxdist.passes.pass_base import PassManager

    manager = PassManager([_Adapter(n, fn) for n, fn in named])
    # PassManager works on a copy; check that the module can be copied at all (its tensors shared in this
    # check, so that large tables are not copied twice)
    shared = {id(t): t for t in (*gm.parameters(), *gm.buffers())}
    try:
        copy.deepcopy(gm, shared)
    except Exception as e:  # e.g. modules holding RPC handles
        gm.meta.setdefault("fxdist", {})["copy_failed"] = f"{type(e).__name__}: {e}"
        return _run_in_place(manager, gm, example_inputs)
    return manager.run(gm, example_inputs).graph_module


def _run_in_place(manager: Any, gm: Any, example_inputs: Sequence[Any] | None) -> Any:
    """PassManager.run without the initial copy (used only when the module cannot be deep-copied)."""
    records = list(gm.meta.get("fxdist", {}).get("passes", []))
    for p in manager.passes:
        gm, record = manager._run_one(p, p.name, gm, None, None)
        records.append(record)
    gm.meta.setdefault("fxdist", {})["passes"] = records
    return gm


DDP_TIMEOUT_ENV = "FXDIST_DDP_TIMEOUT_S"
"""Environment variable giving the default ``ddp_timeout_s`` of :func:`optimize` (seconds; 60 when unset)."""


class DDPRanksMissingError(RuntimeError):
    """``optimize`` on a ``DistributedDataParallel`` module ran on some ranks of its process group only: the others
    did not reach it within the timeout (the message names them).

    See docs/troubleshooting.md#ddpranksmissingerror.
    """


def _ddp_timeout_s(timeout_s: float | None) -> float:
    if timeout_s is None:
        import os

        timeout_s = float(os.environ.get(DDP_TIMEOUT_ENV, "60"))
    if timeout_s <= 0:
        raise ValueError(f"fxdist.optimize: ddp_timeout_s must be > 0, got {timeout_s}")
    return timeout_s


def _all_ranks_here(group: Any, timeout_s: float) -> None:
    """Wait until every rank of ``group`` has reached this point, at most ``timeout_s`` seconds.

    A gloo group gets ``monitored_barrier(wait_all_ranks=True)`` (it names the ranks that did not come); another
    backend (nccl) a barrier waited with a timeout.

    Raises:
        DDPRanksMissingError: some rank did not arrive in time (the message names it where the backend says).
    """
    import datetime
    import re

    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world == 1:
        return
    rank, timeout = dist.get_rank(group), datetime.timedelta(seconds=timeout_s)
    gloo = dist.get_backend(group) == "gloo"
    try:
        if gloo:
            dist.monitored_barrier(group, timeout=timeout, wait_all_ranks=True)
        else:
            dist.barrier(group, async_op=True).wait(timeout=timeout)
    except RuntimeError as e:
        found = re.search(r"Ranks? ([\d, ]+) failed to pass", str(e))
        if found:  # rank 0 collects gloo's monitored barrier and names the late ranks
            missing = found.group(1).strip(" ,")
        else:  # elsewhere: rank 0 did not answer (gloo), or the backend does not say
            missing = "0" if gloo and rank != 0 else "unknown (the backend does not say)"
        raise DDPRanksMissingError(
            f"fxdist.optimize on a DistributedDataParallel module is a collective: all {world} ranks of its process "
            f"group must call it together. Rank {rank} waited {timeout_s:g} s; missing rank(s): {missing} "
            f"(set ddp_timeout_s= or ${DDP_TIMEOUT_ENV} to wait longer; torch: {str(e).splitlines()[0]})") from e


def _retire(ddp: nn.parallel.DistributedDataParallel) -> None:
    """Make the replaced DDP wrapper refuse ``forward`` (its module and Reducer are not the trained ones)."""

    def stale_forward(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this DistributedDataParallel wrapper was replaced by the one fxdist.optimize returned "
                           "(around the optimized module); train and call the returned module instead")

    ddp.forward = stale_forward  # type: ignore[method-assign]


def _rewrap_ddp(ddp: nn.parallel.DistributedDataParallel, inner: nn.Module, timeout_s: float) -> nn.Module:
    # DDP's constructor checks the parameter shapes across processes (a collective that waits forever): first make
    # sure that every rank is here, with a timeout
    _all_ranks_here(ddp.process_group, timeout_s)
    new = nn.parallel.DistributedDataParallel(
        inner,
        device_ids=ddp.device_ids,
        output_device=ddp.output_device,
        dim=ddp.dim,
        forward_sync_buffers=getattr(ddp, "forward_sync_buffers", True),
        process_group=ddp.process_group,
        find_unused_parameters=ddp.find_unused_parameters,
        gradient_as_bucket_view=ddp.gradient_as_bucket_view,
        static_graph=ddp.static_graph,
    )
    _retire(ddp)
    return new


def optimize(
    module: nn.Module,
    passes: Iterable[str | Callable] = ("async_rpc",),
    example_inputs: Sequence[Any] | None = None,
    *,
    concrete_args: dict[str, Any] | None = None,
    tracer_class: type[Tracer] | None = None,
    ddp_timeout_s: float | None = None,
) -> Any:
    """Trace ``module`` with fxdist, apply ``passes`` in order, and keep its Parameter objects.

    Args:
        module: An ``nn.Module``, or a ``DistributedDataParallel`` around one: then the inner module is
            optimized and a new DDP with the same process group (and options) wraps it. That is a
            **collective**: every rank of the DDP's process group must call ``optimize`` together (building a
            DDP checks the parameter shapes across processes). The old wrapper is retired: calling it raises
            ``RuntimeError``; train the returned module.
        passes: Pass names (see :data:`PASSES`, :func:`register_pass`) or callables ``gm -> GraphModule``.
        example_inputs: If given, each pass that changes the graph is checked to keep the outputs
            (``PassVerificationError`` otherwise).
        concrete_args: Passed to the tracer (arguments to specialise, as in ``symbolic_trace``).
        tracer_class: A ``fxdist.Tracer`` subclass (e.g. one with more leaf modules); passes may add leaves
            (``fxdist_leaf_module``, see the module docstring).
        ddp_timeout_s: With a DDP module: how long, in seconds, this rank waits for the other ranks before
            re-wrapping (None: ``$FXDIST_DDP_TIMEOUT_S``, else 60).

    Returns:
        A ``GraphModule`` (or a DDP around one) with ``meta["fxdist"]``: ``passes`` (one record per pass),
        ``traced_nodes`` (node count after tracing), ``new_parameters`` (names of parameters that are
        not the caller's objects), ``unchanged`` (pass name -> why it changed nothing).

    Warns:
        NoOpPassWarning: once per pass that changed nothing, naming it and why.

    Raises:
        TraceError (or what the tracer raised): ``module`` cannot be traced; a note lists the remedies.
        ValueError: an unknown pass name.
        PassVerificationError: a pass changed the outputs on ``example_inputs``.
        DDPRanksMissingError: with a DDP module, some rank of its process group did not call ``optimize``
            within ``ddp_timeout_s`` (the message names the missing ranks; on gloo, ``monitored_barrier``).
    """
    if isinstance(module, nn.parallel.DistributedDataParallel):
        timeout_s = _ddp_timeout_s(ddp_timeout_s)
        inner = optimize(module.module, passes, example_inputs, concrete_args=concrete_args,
                         tracer_class=tracer_class)
        return _rewrap_ddp(module, inner, timeout_s)
    if not isinstance(module, nn.Module):
        raise TypeError(f"fxdist.optimize expects an nn.Module, got {type(module).__name__}")
    named = [resolve_pass(p) for p in passes]
    preds = _leaf_predicates(named)
    gm = _trace(module, _tracer_with_leaves(tracer_class, preds) if preds else tracer_class, concrete_args)
    traced_nodes = len(gm.graph.nodes)
    out = _run_passes(gm, named, example_inputs) if named else gm
    _warn_unchanged(out, out.meta.get("fxdist", {}).get("passes", [])[-len(named):] if named else [])
    _restore_originals(out, module)
    originals = {id(p) for p in module.parameters()}
    meta = out.meta.setdefault("fxdist", {})
    meta.setdefault("passes", [])
    meta["traced_nodes"] = traced_nodes
    meta["new_parameters"] = [n for n, p in out.named_parameters() if id(p) not in originals]
    return out
