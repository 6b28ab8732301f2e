"""Which call targets have side effects, for ``Node.is_impure`` and dead-code elimination.

Source: torch/fx/node.py ``_side_effectful_functions``/``has_side_effect`` and
torch/_library/utils.py ``is_impure``, extended (fxdist rule) with in-place methods and functions,
``torch.distributed`` RPC and collective calls (recognized by name, so ``torch.distributed`` is never
imported here) and dropout-style random ops in training mode.

torch registers some of its own ops with torch.fx's registry when their modules are imported (the
waits of functional collectives, dynamo's stream ops...); ``_TORCH_REGISTERED_OPS`` lists them by name
so fxdist keeps them too, and torch.fx's registry itself is honoured (libraries such as torchrec
register with ``@torch.fx.has_side_effect``). Higher-order ops follow torch.fx (registered effect,
or the op wrapped by ``auto_functionalized``).
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

__all__ = ["has_side_effect", "target_is_impure", "is_random_op"]

_F = TypeVar("_F", bound=Callable[..., Any])


def _resolve(path: str) -> Any:
    """``"aten._assert_async.msg"`` -> the op under ``torch.ops``, or None when this build lacks it."""
    obj: Any = torch.ops
    try:
        for atom in path.split("."):
            obj = getattr(obj, atom)
    except (AttributeError, RuntimeError):
        return None
    return obj


_side_effectful_functions: set[Callable[..., Any]] = {
    torch._assert, torch._assert_async, torch._C._set_grad_enabled,
    torch.amp._enter_autocast, torch.amp._exit_autocast,
    operator.setitem, operator.delitem,
    # in-place operators: `a += b` mutates a tensor `a`
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
    operator.imatmul, operator.iconcat,
}
_side_effectful_functions.update(filter(None, map(_resolve, [
    "aten._assert_async.msg", "aten._assert_scalar.default", "aten._assert_tensor_metadata.default",
    "aten.sym_constrain_range.default", "aten.sym_constrain_range_for_size.default",
    "profiler._record_function_enter", "profiler._record_function_enter.default",
    "profiler._record_function_enter_new", "profiler._record_function_enter_new.default",
    "profiler._record_function_exit", "profiler._record_function_exit._RecordFunction",
])))


# Operators torch 2.13 itself registers with torch.fx's ``has_side_effect`` when the Python module
# defining or using them is imported (found by listing torch.fx.node._side_effectful_functions after
# importing those modules). Matched by schema name, so no torch.distributed/dynamo import is needed
# and an op registered later (a namespace created on import) is still recognized.
_TORCH_REGISTERED_OPS = frozenset({
    # torch/distributed/_functional_collectives.py: the waits and point-to-point ops of functional
    # collectives (all_reduce & co. return new tensors and stay pure, as in torch.fx)
    "_c10d_functional::wait_tensor", "_c10d_functional::isend", "_c10d_functional::irecv",
    "_c10d_functional::batch_p2p_ops",
    "ao::wait_tensor",  # torch/_functorch/_activation_offloading/offload_ops.py
    "inductor::accumulate_grad_", "inductor::resize_storage_bytes_",  # torch/fx/node.py
    "pippy::_pipe_split",  # torch/distributed/pipelining/_IR.py
    "prims::_sink_tokens", "prims::_unsafe_set_version_counter",  # torch/_prims, torch/_dynamo/tensor_version_op.py
    *(f"streams::{name}" for name in (  # torch/_dynamo/variables/streams.py
        "fork", "join", "record_event", "record_stream", "sync_dealloc", "synchronize_device",
        "synchronize_event", "synchronize_stream", "wait_event", "wait_stream")),
})
# Python functions torch registers the same way: module -> names.
_TORCH_REGISTERED_FUNCTIONS = {
    "torch._functorch.predispatch": frozenset({"_enter_dual_level", "_exit_dual_level", "_jvp_increment_nesting",
                                               "_jvp_decrement_nesting"}),
}


def _torch_fx_registered(target: Any) -> bool:
    """Whether ``target`` is in torch.fx's own registry, which torch modules and libraries fill with
    ``@torch.fx.has_side_effect`` (e.g. torchrec's ``annotate_embedding_names``). Code written for
    torch.fx registers there, so fxdist honours it. The module is looked up, never imported: ``import
    torch`` has loaded it already, and fxdist does not depend on it otherwise."""
    node_module = sys.modules.get("torch.fx.node")
    registry = getattr(node_module, "_side_effectful_functions", None)
    return registry is not None and target in registry


def has_side_effect(fn: _F) -> _F:
    """Register ``fn`` as side-effectful so ``Graph.eliminate_dead_code`` keeps calls to it.

    Usable as a decorator; returns ``fn`` unchanged. Source: torch/fx/node.py ``has_side_effect``.
    """
    _side_effectful_functions.add(fn)
    return fn


# Random functions: impure whatever impure_random says (torch/_library/utils.py _RANDOM_FUNCTIONS).
_RANDOM_FUNCTIONS = {
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.normal, torch.poisson, torch.bernoulli, torch.multinomial,
}
# f -> (position of its `training` argument, keyword name, default)
_DROPOUT_LIKE: dict[Callable[..., Any], tuple[int, str, bool]] = {
    F.dropout: (2, "training", True), F.dropout1d: (2, "training", True), F.dropout2d: (2, "training", True),
    F.dropout3d: (2, "training", True), F.alpha_dropout: (2, "training", False),
    F.feature_alpha_dropout: (2, "training", False), F.rrelu: (3, "training", False),
    torch.dropout: (2, "train", True), torch.alpha_dropout: (2, "train", True),
    torch.feature_alpha_dropout: (2, "train", True), torch.feature_dropout: (2, "train", True),
}
# torch.distributed calls by (module prefix, function names); matched by name, never imported.
_DISTRIBUTED_CALLS: tuple[tuple[str, frozenset[str]], ...] = (
    ("torch.distributed.rpc", frozenset({"rpc_sync", "rpc_async", "remote"})),
    ("torch.distributed", frozenset({
        "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
        "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "irecv", "isend",
        "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "send", "batch_isend_irecv",
        "monitored_barrier"})),
)
_IMPURE_METHODS = frozenset({"__setitem__", "__delitem__"})
_RANDOM_METHODS = frozenset({"bernoulli", "multinomial"})


def is_random_op(op: str, target: Any) -> bool:
    """Whether a node's target draws random numbers (``torch.rand``, ``torch.randn``, ``Tensor.bernoulli``...):
    impure whatever ``impure_random`` says, so a pass must not replay or reorder it.

    Args:
        op: the node's ``op`` (``"call_function"`` or ``"call_method"``; any other op gives False).
        target: the node's ``target`` (a callable, or a method name for ``"call_method"``); an unhashable
            target gives False.

    fxdist-only public helper (torch.fx keeps this table private: torch/_library/utils.py
    ``_RANDOM_FUNCTIONS``), exported as ``fxdist.node.is_random_op``.
    """
    try:
        if op == "call_method":
            return target in _RANDOM_METHODS
        return op == "call_function" and target in _RANDOM_FUNCTIONS
    except TypeError:  # unhashable target
        return False


def _is_distributed_call(fn: Any) -> bool:
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__name__", None)
    return any(module.startswith(prefix) and name in names for prefix, names in _DISTRIBUTED_CALLS)


def _in_place_name(name: object) -> bool:
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


def _training_flag(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    pos, key, default = _DROPOUT_LIKE[fn]
    flag = args[pos] if len(args) > pos else kwargs.get(key, default)
    inplace = kwargs.get("inplace", args[pos + 1] if len(args) > pos + 1 else False)
    # a Node (unknown at graph-build time) counts as "maybe training"
    return flag is not False or inplace is not False


def _get_effect(op: Any) -> Any:
    try:
        from torch._higher_order_ops.effects import _get_effect as get
    except ImportError:  # pragma: no cover - older torch
        return None
    return get(op)


def _higher_order_impure(op: Any, args: tuple[Any, ...]) -> bool:
    """torch/_library/utils.py ``is_impure`` for higher-order ops: auto_functionalized is as impure as
    the op it wraps (registered ones only, as torch.fx); others by registered effect or registry."""
    if getattr(op, "__name__", None) in ("auto_functionalized", "auto_functionalized_v2") and args:
        schema = getattr(args[0], "_schema", None)
        return args[0] in _side_effectful_functions or (schema is not None and schema.name in _TORCH_REGISTERED_OPS)
    return _get_effect(op) is not None or op in _side_effectful_functions


def _op_overload_impure(op: Any, impure_random: bool, args: tuple[Any, ...] = ()) -> bool | None:
    """Verdict for ATen ops (mutable schema, random tag, registered effect); None when not an op."""
    if isinstance(op, torch._ops.OpOverloadPacket):
        if op in _side_effectful_functions:
            return True
        op = getattr(op, "default", None)
        if op is None:
            return False
    if isinstance(op, torch._ops.HigherOrderOperator):
        return _higher_order_impure(op, args)
    if not isinstance(op, torch._ops.OpOverload):
        return None
    if op._schema.is_mutable or op in _side_effectful_functions or op._schema.name in _TORCH_REGISTERED_OPS:
        return True
    if impure_random and torch.Tag.nondeterministic_seeded in op.tags:
        return True
    return _get_effect(op) is not None


def target_is_impure(op: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                     impure_random: bool = True) -> bool:
    """Whether a ``call_function``/``call_method`` node with this target and arguments has side effects.

    Args:
        op: ``"call_function"`` or ``"call_method"``.
        target: the callable (call_function) or method name (call_method).
        args, kwargs: the node's arguments (needed for dropout's ``training`` flag).
        impure_random: whether random ops count as impure.
    """
    if op == "call_method":
        if target in _RANDOM_METHODS:
            return impure_random
        return _in_place_name(target) or target in _IMPURE_METHODS
    try:
        if target in _side_effectful_functions or target in _RANDOM_FUNCTIONS or _torch_fx_registered(target):
            return True
        dropout_like = target in _DROPOUT_LIKE
    except TypeError:  # unhashable callable
        dropout_like = False
    verdict = _op_overload_impure(target, impure_random, args)
    if verdict is not None:
        return verdict
    if dropout_like:
        return impure_random and _training_flag(target, args, kwargs)
    if impure_random and getattr(target, "_nondeterministic_seeded", False):
        return True
    if _in_place_name(getattr(target, "__name__", None)) or _is_distributed_call(target):
        return True
    module = getattr(target, "__module__", None) or ""
    if getattr(target, "__name__", None) in _TORCH_REGISTERED_FUNCTIONS.get(module, ()):
        return True
    schema = getattr(target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)
