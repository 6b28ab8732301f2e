"""Re-inplacing: turn ``b = foo(a, ...)`` into ``foo_(a, ...)`` where no one can observe the difference.

The pass expects a functional ATen graph, e.g. ``make_fx(torch.func.functionalize(f))(*args)``.
Aliasing is read from FakeTensor storages: every node is re-run on FakeTensors of ``sample_args`` (so
aliasing between the inputs is known), and nodes are grouped by the storage of their result.

Given ``b = foo(a, args...)`` (a ``call_function`` node whose first argument is a Tensor):

(1a) Skip unless ``a`` has the result's shape and dtype (no resize, no dtype change) and no internally
     overlapping memory (``ones(1).expand(4, 4)``). ``aten.resize`` is exempt. Special case: a
     comparison ``a_1 = ge(a, b)`` whose only user is ``a_2 = _to_copy(a_1, dtype=a.dtype)`` (what
     functionalization emits for ``a.ge_(b)``) is re-inplaced as ``ge_(a, b)`` and the ``_to_copy``
     is removed.
(1b) Skip if ``a`` aliases a program input (a placeholder) or a module constant (``get_attr``):
     mutating it would be a side effect the caller can see. With ``reuse_overwritten_inputs=True``,
     an input ``x`` that the graph later overwrites with ``copy_(x, b)`` (and reads no more) is
     reused: ``foo_(x)``, and the ``copy_`` goes (the "future optimization" NOTE of torch/fx/passes/reinplace.py).
(1c) Skip if another tensor argument shares memory with ``a`` (``mul(a, a.t())``), unless the op is
     pointwise (or ``copy``) and every shared element sits at the same index in both tensors.
(2)  Skip unless ``a`` and its aliases have no later use, where (a) a later view of ``a`` is not a use
     by itself (its own uses are), (b) ``a`` passed twice (``mul(a, a)``) bans re-inplacing, and (c) a
     later ``{view}_scatter(base, x, args...)`` that inverts a view ``alias = {view}(base, args...)``
     of ``a`` is not a use: it becomes redundant once ``foo`` writes into ``a``'s memory (``base``
     must alias ``a``; ``x`` must not).
(3a) A ``{view}_scatter(a, src, args...)`` node itself becomes ``{view}(a, args...).copy_(src)``.
(3b) Otherwise ``foo`` becomes its in-place overload ``foo_`` (same schema but a mutable ``self``);
     ops without one, and view ops, are left alone.
(4)  Later uses of ``b`` (and of the redundant scatters of (2c)) are rewired to ``a``; the storage
     groups of ``a`` and ``b`` are fused.
(5)  The redundant scatters are erased (FX's dead-code elimination cannot run on a mutating graph).
     A scatter whose source did not end up written in place is first replaced by (3a)'s view + copy_,
     so the graph stays correct even then.

Example (the ``diagonal`` + ``fill_`` program of torch/fx/passes/reinplace.py's docstring; the
``diagonal_scatter`` disappears):

>>> import torch
>>> from fxdist.experimental.proxy_tensor import make_fx
>>> def f(x):
...     a = x + x
...     a.diagonal().fill_(0)
...     return a.relu()
>>> gm = make_fx(torch.func.functionalize(f))(torch.randn(3, 3))
>>> [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"]
['add.Tensor', 'diagonal.default', 'fill.Scalar', 'diagonal_scatter.default', 'diagonal.default', 'relu.default']
>>> print(reinplace(gm, torch.randn(3, 3)).code.strip())
def forward(self, x_1):
    add = torch.ops.aten.add.Tensor(x_1, x_1);  x_1 = None
    diagonal = torch.ops.aten.diagonal.default(add)
    fill = torch.ops.aten.fill_.Scalar(diagonal, 0);  diagonal = fill = None
    diagonal_1 = torch.ops.aten.diagonal.default(add);  diagonal_1 = None
    relu = torch.ops.aten.relu_.default(add);  relu = None
    return add

Differences from torch.fx's pass, each making the result correct where torch's is not (tests show
each case): (1a) compares shapes, not just element counts; (1b) also protects ``get_attr`` parameters
and buffers; (1c) checks memory overlap of all arguments, not only repeated nodes; (2c) requires the
scatter's base, and not its source, to alias ``a``, and a scatter of ``b`` itself to undo the view
``a``; (5) keeps a scatter whose source was not re-inplaced instead of dropping its write. On graphs
from ``make_fx(functionalize(f))`` without those hazards both passes give the same op sequence.
Also: the ``ge``/``_to_copy`` special case (torch's docstring only describes it) and the optional
``reuse_overwritten_inputs``.

Source: torch/fx/passes/reinplace.py (the pass and its docstring).
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from fxdist.graph_module import GraphModule, _is_torch_fx
from fxdist.node import Node, map_arg
from fxdist.passes.pass_base import PassBase, PassResult

__all__ = ["Reinplace", "reinplace"]

_aten = torch.ops.aten
_OpOverload = torch._ops.OpOverload

# {view}_scatter -> the view it inverts (step 2c / 3a)
_VIEW_INVERSE: dict[Any, Any] = {
    _aten.diagonal_scatter.default: _aten.diagonal.default,
    _aten.select_scatter.default: _aten.select.int,
    _aten.slice_scatter.default: _aten.slice.Tensor,
    _aten.as_strided_scatter.default: _aten.as_strided.default,
}
# comparisons whose in-place form casts the boolean result back to self's dtype (step 1a special case)
_COMPARISONS = frozenset(getattr(_aten, name) for name in ("ge", "gt", "le", "lt", "eq", "ne"))
# views with at most this many elements (together) get an exact memory-overlap test in step 1c
_EXACT_OVERLAP_ELEMENTS = 1 << 20


@dataclass
class _AliasState:
    """Aliasing facts shared by the steps.

    Attributes:
        fake_mode: the FakeTensorMode the metadata was computed in.
        protected: storages of program inputs and module constants (step 1b).
        groups: storage -> set of nodes whose result lives in that storage; fused in step 4, so two
            storages in one group share the same set object.
        reuse_overwritten_inputs: the option of ``reinplace`` (step 1b's input-overwrite case).
    """

    fake_mode: FakeTensorMode
    reuse_overwritten_inputs: bool = False
    protected: set[StorageWeakRef] = field(default_factory=set)
    groups: dict[StorageWeakRef, set[Node]] = field(default_factory=dict)

    def aliases(self, node: Node) -> set[Node]:
        key = _storage(node)
        return self.groups.setdefault(key, {node}) if key is not None else {node}

    def fuse(self, a: Node, b: Node) -> None:
        key_a, key_b = _storage(a), _storage(b)
        if key_a is None or key_b is None:
            return
        set_a, set_b = self.aliases(a), self.aliases(b)
        if set_a is set_b:
            return
        merged = set_a | set_b
        for key, group in self.groups.items():
            if group is set_a or group is set_b:
                self.groups[key] = merged


def reinplace(gm: GraphModule, *sample_args: Any, reuse_overwritten_inputs: bool = False) -> GraphModule:
    """Rewrite a functional ATen graph to use in-place ops where that is unobservable (steps above).

    Args:
        gm: GraphModule holding a functional ATen graph (``make_fx(functionalize(f))``); modified in place.
        *sample_args: example inputs, one per placeholder; only their metadata and aliasing are used.
        reuse_overwritten_inputs: also do the optimization the (1b) NOTE of torch/fx/passes/reinplace.py leaves
            for the future:
            ``b = foo(x)`` on a program input ``x`` that is later overwritten with ``copy_(x, b)`` (what
            functionalization emits for ``x.foo_()``) becomes ``foo_(x)``, and the ``copy_`` is dropped.
            Off by default, as in torch.fx.

    Returns:
        ``gm``, recompiled (for a torch.fx ``gm``: an fxdist copy, see below). Outputs are unchanged and the inputs are never mutated (beyond what the
        graph itself does with ``copy_``).

    Raises:
        ValueError: ``sample_args`` has not one value per placeholder.
        RuntimeError: the graph cannot run on FakeTensors of ``sample_args`` (names the node).

    A torch.fx GraphModule (``torch.fx.experimental.proxy_tensor.make_fx``) is converted first; the
    result is the converted fxdist GraphModule, and ``gm`` gets its graph too (torch.fx's contract).

    Source: torch/fx/passes/reinplace.py.
    """
    if _is_torch_fx(gm):  # the door for torch-built graphs
        from fxdist.interop import as_fxdist, write_back

        result = reinplace(as_fxdist(gm), *sample_args, reuse_overwritten_inputs=reuse_overwritten_inputs)
        write_back(cast(Any, gm), result)  # a torch.fx GraphModule: only interop names torch.fx
        return result
    state = _propagate_fake_metadata(gm, sample_args)
    state.reuse_overwritten_inputs = reuse_overwritten_inputs
    redundant: dict[Node, bool] = {}  # node -> whether its write may still be needed (step 5)
    # A second sweep lets an input overwrite reach back through a chain: once ``c = bar(b)`` became
    # ``bar_(b)``, the final ``copy_(x, c)`` reads ``copy_(x, b)`` and ``b = foo(x)`` can reuse ``x``.
    for _sweep in range(2 if reuse_overwritten_inputs else 1):
        for node in list(gm.graph.nodes):
            if node not in redundant:
                _reinplace_node(gm, node, state, redundant)
    _erase_redundant(gm, redundant, state)
    gm.recompile()
    return gm


@dataclass(frozen=True, eq=False)
class Reinplace(PassBase):
    """``reinplace`` as a pipeline pass for ``PassManager`` (which lints, recompiles and can verify outputs).

    Returns:
        PassResult(gm, modified); modified is False when no node's target or arguments changed.

    Source: torch/fx/passes/reinplace.py.
    """

    name: ClassVar[str] = "reinplace"
    sample_args: tuple[Any, ...]
    """Example inputs, one per placeholder (their metadata and aliasing are used)."""
    reuse_overwritten_inputs: bool = False
    """See ``reinplace``."""

    def call(self, gm: GraphModule) -> PassResult:
        before = [(n.target, n.args, n.kwargs) for n in gm.graph.nodes]
        reinplace(gm, *self.sample_args, reuse_overwritten_inputs=self.reuse_overwritten_inputs)
        return PassResult(gm, before != [(n.target, n.args, n.kwargs) for n in gm.graph.nodes])


# ---- metadata ----------------------------------------------------------------------------------
def _storage(node: Node) -> StorageWeakRef | None:
    val = node.meta.get("fake_result") if isinstance(node, Node) else None
    if isinstance(val, torch.Tensor):
        return StorageWeakRef(val.untyped_storage())
    return None


def _view_kind(target: Any) -> str | None:
    """``"single"``/``"multi"`` for ATen view ops (first argument aliased, not written), else None."""
    if not isinstance(target, _OpOverload) or not target._schema.arguments:
        return None
    alias = target._schema.arguments[0].alias_info
    if alias is None or alias.is_write:
        return None
    return "multi" if "*" in alias.after_set else "single"


def _run_node(gm: GraphModule, node: Node, env: dict[Node, Any], inputs: Iterator[Any], mode: FakeTensorMode) -> Any:
    args = map_arg(node.args, env.__getitem__)
    kwargs = map_arg(node.kwargs, env.__getitem__)
    if node.op == "placeholder":
        return next(inputs)
    if node.op == "get_attr":
        value = gm
        for part in cast(str, node.target).split("."):
            value = getattr(value, part)
        return mode.from_tensor(value, static_shapes=True) if isinstance(value, torch.Tensor) else value
    if node.op == "call_function":
        return cast(Callable[..., Any], node.target)(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], cast(str, node.target))(*args[1:], **kwargs)
    if node.op == "call_module":
        return gm.get_submodule(cast(str, node.target))(*args, **kwargs)
    return None


def _propagate_fake_metadata(gm: GraphModule, sample_args: tuple[Any, ...]) -> _AliasState:
    """Step 0: set ``meta["fake_result"]``, ``meta["node_idx"]`` and ``meta["view_of"]`` on every node."""
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(sample_args):
        raise ValueError(f"reinplace: the graph has {len(placeholders)} placeholders {placeholders} but "
                         f"{len(sample_args)} sample inputs were given; pass one example value per placeholder")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    state = _AliasState(mode)
    env: dict[Node, Any] = {}
    multi_views: dict[Node, Node] = {}
    inputs = iter([mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in sample_args])
    with mode:
        for idx, node in enumerate(gm.graph.nodes):
            try:
                env[node] = _run_node(gm, node, env, inputs, mode)
            except Exception as e:
                raise RuntimeError(f"reinplace: cannot run %{node.name} ({node.op}[target={node.target}]) "
                                   f"on FakeTensors of the sample inputs: {e}") from e
            node.meta["fake_result"] = env[node]
            node.meta["node_idx"] = idx
            kind = _view_kind(node.target) if node.op == "call_function" else None
            if kind == "single":
                node.meta["view_of"] = node.args[0]
            elif kind == "multi":
                multi_views[node] = cast(Node, node.args[0])
            elif node.target is operator.getitem and node.args[0] in multi_views:
                node.meta["view_of"] = multi_views[cast(Node, node.args[0])]
    for node in gm.graph.nodes:
        for leaf in pytree.tree_leaves(node.meta.get("fake_result")):
            if isinstance(leaf, torch.Tensor):
                key = StorageWeakRef(leaf.untyped_storage())
                state.groups.setdefault(key, set()).add(node)
                if node.op in ("placeholder", "get_attr"):
                    state.protected.add(key)
    return state


# ---- one candidate node: steps 1-4 -------------------------------------------------------------
def _reinplace_node(gm: GraphModule, node: Node, state: _AliasState, redundant: dict[Node, bool]) -> bool:
    """Try steps 1-4 on ``node``; record scatters made redundant in ``redundant``. True if rewritten."""
    if not _is_candidate(node):
        return False
    self_arg = cast(Node, node.args[0])  # _is_candidate checked it
    ok, to_copy = _check_self_metadata(node, self_arg)  # (1a)
    if not ok or _aliases_other_argument(node, self_arg, state):  # (1c)
        return False
    if _aliases_protected(self_arg, state):  # (1b), and its optional input-overwrite case
        if not state.reuse_overwritten_inputs or to_copy is not None:
            return False
        return _reuse_overwritten_input(node, self_arg, state, redundant)
    scatters = _later_uses_allow_reinplace(node, self_arg, state)  # (2)
    if scatters is None:
        return False
    if node.target in _VIEW_INVERSE:
        _scatter_to_view_copy(gm, node, state)  # (3a)
        redundant[node] = False
    else:
        inplace = _inplace_variant(node.target)  # (3b)
        if inplace is None:
            return False
        node.target = inplace
    olds = [node, *scatters] + ([to_copy] if to_copy is not None else [])
    _rewire_later_uses(node, olds, self_arg, state)  # (4)
    redundant.update(dict.fromkeys(scatters, True))
    if to_copy is not None:
        redundant[to_copy] = False
    return True


def _is_candidate(node: Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, _OpOverload):
        return False
    schema_args = node.target._schema.arguments
    if not schema_args or not isinstance(schema_args[0].type, torch.TensorType):
        return False
    return bool(node.args) and isinstance(node.args[0], Node) and _storage(node.args[0]) is not None


def _check_self_metadata(node: Node, self_arg: Node) -> tuple[bool, Node | None]:
    """Step 1a. Returns (ok, the ``_to_copy`` node of the comparison special case or None)."""
    self_val, out = self_arg.meta["fake_result"], node.meta.get("fake_result")
    if node.target is _aten.resize.default:
        return True, None
    if not isinstance(out, torch.Tensor) or torch._debug_has_internal_overlap(self_val) == 1:
        return False, None
    if self_val.shape != out.shape:
        return False, None
    if self_val.dtype == out.dtype:
        return True, None
    to_copy = _comparison_cast_back(node, self_val)
    return to_copy is not None, to_copy


def _comparison_cast_back(node: Node, self_val: torch.Tensor) -> Node | None:
    """Match ``a_1 = ge(a, b); a_2 = _to_copy(a_1, dtype=a.dtype)`` (a_1 used only there)."""
    if cast(_OpOverload, node.target).overloadpacket not in _COMPARISONS or len(node.users) != 1:
        return None
    (user,) = node.users
    if user.target is not _aten._to_copy.default or user.args != (node,):
        return None
    val = user.meta.get("fake_result")
    if not isinstance(val, torch.Tensor):
        return None
    ok = val.dtype == self_val.dtype and val.shape == self_val.shape
    ok = ok and val.device == self_val.device and set(user.kwargs) <= {"dtype", "layout", "device"}
    return user if ok and user.kwargs.get("layout", torch.strided) == torch.strided else None


def _aliases_protected(self_arg: Node, state: _AliasState) -> bool:
    """Step 1b: ``a`` lives in the storage of a program input or a module constant (also through a
    group fused by an earlier rewrite, e.g. a view of a buffer that now is an overwritten input)."""
    return any(_storage(n) in state.protected for n in (self_arg, *state.aliases(self_arg)))


def _reuse_overwritten_input(node: Node, x: Node, state: _AliasState, redundant: dict[Node, bool]) -> bool:
    """Step 1b's future optimization: ``b = foo(x); ...; copy_(x, b)`` -> ``foo_(x); ...`` (x an input)."""
    copy = _later_overwrite_with(node, x, state)
    inplace = _inplace_variant(node.target) if copy is not None else None
    if copy is None or inplace is None:
        return False
    node.target = inplace
    _rewire_later_uses(node, [node], x, state)  # copy_(x, b) is now copy_(x, x): a no-op
    copy.replace_all_uses_with(x)
    redundant[copy] = False
    return True


def _later_overwrite_with(node: Node, x: Node, state: _AliasState) -> Node | None:
    """The ``copy_(x, node)`` that overwrites placeholder ``x`` later, if it is the only later use or write."""
    aliases = state.aliases(x)
    if x.op != "placeholder" or any(n is not x and n.op in ("placeholder", "get_attr") for n in aliases):
        return None  # a module constant, or an input aliasing another input
    idx = node.meta["node_idx"]
    writes = [
        user for alias in aliases for user in alias.users
        if user.target is _aten.copy_.default and user.args[0] is alias and user.meta.get("node_idx", -1) > idx
    ]
    if len(writes) != 1 or writes[0].args != (x, node):
        return None
    return writes[0] if not (_later_uses(aliases, idx) - set(writes)) else None


def _extent(t: torch.Tensor) -> tuple[int | torch.SymInt, int | torch.SymInt]:
    """Half-open element range ``[lo, hi)`` of the storage that ``t`` may touch."""
    lo = t.storage_offset()
    if t.numel() == 0:
        return lo, lo
    span = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return lo, lo + span + 1


def _element_offsets(t: torch.Tensor) -> torch.Tensor:
    """Storage offset of every element of ``t`` (int64, shape ``(numel,)``), from its sizes and strides."""
    offsets = torch.zeros((), dtype=torch.long)
    for size, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size) * stride
    return cast(torch.Tensor, offsets.reshape(-1) + t.storage_offset())


def _memory_overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two views of one storage share an element; exact up to _EXACT_OVERLAP_ELEMENTS, else by range."""
    (lo_a, hi_a), (lo_b, hi_b) = _extent(a), _extent(b)
    if not (lo_a < hi_b and lo_b < hi_a):
        return False
    if a.numel() + b.numel() > _EXACT_OVERLAP_ELEMENTS:
        return True
    return bool(torch.isin(_element_offsets(a), _element_offsets(b)).any())


def _aliases_other_argument(node: Node, self_arg: Node, state: _AliasState) -> bool:
    """Step 1c: another tensor argument may share memory with ``a``."""
    group = state.aliases(self_arg)
    self_val = self_arg.meta["fake_result"]
    others = [a for a in pytree.tree_leaves((node.args[1:], node.kwargs)) if isinstance(a, Node)]
    for other in others:
        if other is self_arg:
            return True
        if other not in group:
            continue
        other_val = other.meta.get("fake_result")
        if not isinstance(other_val, torch.Tensor) or _storage(other) != _storage(self_arg):
            return True  # aliased through an earlier rewrite: layouts not comparable, be safe
        if _memory_overlaps(self_val, other_val) and not _overlap_is_elementwise_safe(node, self_val, other_val):
            return True
    return False


def _overlap_is_elementwise_safe(node: Node, self_val: torch.Tensor, other_val: torch.Tensor) -> bool:
    """A pointwise op (or copy) may write ``a`` in place while reading ``other`` if every shared element
    sits at the same index in both: each output element then reads only itself. ``y[:, 0] += 1``
    functionalizes to ``copy(select(s, 1, 0), select(s, 1, 0))``, the simplest such case."""
    pointwise = node.target is _aten.copy.default or torch.Tag.pointwise in cast(_OpOverload, node.target).tags
    if not pointwise or self_val.shape != other_val.shape:
        return False
    if _same_layout(self_val, other_val):
        return True
    if self_val.numel() + other_val.numel() > _EXACT_OVERLAP_ELEMENTS:
        return False
    mine, theirs = _element_offsets(self_val), _element_offsets(other_val)
    if theirs.unique().numel() != theirs.numel():
        return False  # ``other`` reads one element at several indices
    shared = torch.isin(mine, theirs)
    return bool((mine[shared] == theirs[shared]).all())


# ---- step 2 ------------------------------------------------------------------------------------
def _later_uses_allow_reinplace(node: Node, self_arg: Node, state: _AliasState) -> set[Node] | None:
    """Step 2: None if ``a`` or an alias is used later; else the redundant scatters of case (c)."""
    if sum(1 for a in node.args if a is self_arg) > 1:  # (b) repeat argument
        return None
    aliases = state.aliases(self_arg)
    later = _later_uses(aliases, node.meta["node_idx"])
    scatters = _view_inverse_uses(later, aliases, node, self_arg)
    return scatters if later <= scatters else None


def _later_uses(aliases: set[Node], idx: int) -> set[Node]:
    """Nodes after position ``idx`` that use an alias; views of ``a`` (case (a)) are not uses."""
    found = set()
    for alias in aliases:
        for user in alias.users:
            user_idx = user.meta.get("node_idx")
            if user_idx is None or user_idx <= idx:
                continue
            if user in aliases and (isinstance(user.target, _OpOverload) or user.target is operator.getitem):
                continue
            found.add(user)
    return found


@contextlib.contextmanager
def _quiet_fake_tensor_errors() -> Iterator[None]:
    """FakeTensorMode logs every failing meta kernel at ERROR level; a failed replay is expected here."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    previous = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = previous


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()


def _view_inverse_uses(later: set[Node], aliases: set[Node], node: Node, self_arg: Node) -> set[Node]:
    """Case (c): later scatters ``{view}_scatter(base, x, args...)`` undoing a view of ``a``.

    ``base`` must be an alias of ``a`` (the buffer being written) and no other argument may be one: a
    scatter whose source is itself a view of ``a`` reads the values from before the in-place write.
    A scatter of ``node``'s own result must undo exactly the view ``node`` writes (``self_arg``).
    """
    found = set()
    for user in sorted(later, key=lambda n: n.meta["node_idx"]):
        view_op = _VIEW_INVERSE.get(user.target)
        if view_op is None or user.args[0] not in aliases:
            continue
        if any(isinstance(a, Node) and a in aliases for a in pytree.tree_leaves((user.args[1:], user.kwargs))):
            continue
        base_val = cast(Node, user.args[0]).meta.get("fake_result")
        for alias in [self_arg] if user.args[1] is node else aliases:
            origin = alias.meta.get("view_of")
            if origin is None or not isinstance(base_val, torch.Tensor):
                continue
            try:  # the scatter's args must recreate exactly this view of an identically laid-out base
                with _quiet_fake_tensor_errors():
                    replay = view_op(origin.meta["fake_result"], *user.args[2:], **user.kwargs)
            except Exception:  # these args do not even fit this alias's base: not its inverse
                continue
            if _same_layout(origin.meta["fake_result"], base_val) and _same_layout(replay, alias.meta["fake_result"]):
                found.add(user)
                break
    return found


# ---- steps 3 and 4 -----------------------------------------------------------------------------
def _scatter_to_view_copy(gm: GraphModule, node: Node, state: _AliasState) -> Node:
    """Step 3a: insert ``v = {view}(a, args...); copy_(v, src)`` before the scatter node."""
    base, src, *rest = node.args
    base = cast(Node, base)
    view_op = _VIEW_INVERSE[node.target]
    with gm.graph.inserting_before(node):
        view = gm.graph.create_node("call_function", view_op, (base, *rest), dict(node.kwargs))
        copy = gm.graph.create_node("call_function", _aten.copy_.default, (view, src), {})
    with state.fake_mode:
        view.meta["fake_result"] = view_op(base.meta["fake_result"], *rest, **node.kwargs)
    copy.meta["fake_result"] = view.meta["fake_result"]
    for new in (view, copy):
        new.meta["node_idx"] = node.meta.get("node_idx")
        state.aliases(base).add(new)
    view.meta["view_of"] = base
    return copy


def _schemas_match(functional: torch._C.FunctionSchema, inplace: torch._C.FunctionSchema) -> bool:
    if inplace.name != functional.name + "_" or len(inplace.arguments) != len(functional.arguments):
        return False
    if not all(a.type == b.type for a, b in zip(functional.arguments, inplace.arguments)):
        return False
    first = inplace.arguments[0].alias_info
    return first is not None and first.is_write and all(a.alias_info is None for a in inplace.arguments[1:])


def _inplace_variant(op: Any) -> Any | None:
    """Step 3b: the ``foo_`` overload with ``foo``'s argument types, or None (also for view ops)."""
    if not isinstance(op, _OpOverload) or _view_kind(op) is not None:
        return None
    namespace = getattr(torch.ops, op.namespace, None)
    packet = getattr(namespace, op.overloadpacket.__name__ + "_", None) if namespace is not None else None
    if packet is None:
        return None
    matches = [getattr(packet, name) for name in packet.overloads()]
    matches = [m for m in matches if _schemas_match(op._schema, m._schema)]
    if len(matches) > 1:
        matches = [m for m in matches if m._overloadname == op._overloadname]
    return matches[0] if len(matches) == 1 else None


def _rewire_later_uses(node: Node, olds: list[Node], self_arg: Node, state: _AliasState) -> None:
    """Step 4: users after ``node`` of each old value now take its replacement; fuse storage groups."""
    idx = node.meta["node_idx"]
    state.fuse(self_arg, node)
    for old in olds:
        new = self_arg if old.target is _aten._to_copy.default else cast(Node, old.args[0])
        state.fuse(new, old)
        swap = _swap(old, new)
        for user in list(old.users):
            user_idx = user.meta.get("node_idx")
            if user_idx is None or user_idx <= idx:
                continue
            user.args = map_arg(user.args, swap)
            user.kwargs = map_arg(user.kwargs, swap)
            if _storage(user) is not None and _storage(user) == _storage(old):
                state.fuse(new, user)


def _swap(old: Node, new: Node) -> Callable[[Node], Node]:
    return lambda a: new if a is old else a


# ---- step 5 ------------------------------------------------------------------------------------
def _erase_redundant(gm: GraphModule, redundant: dict[Node, bool], state: _AliasState) -> None:
    """Step 5: erase the redundant scatters (and cast-backs), keeping any write not done in place."""
    for node, check_write in sorted(redundant.items(), key=lambda item: item[0].meta["node_idx"]):
        src = node.args[1] if check_write else None
        if isinstance(src, Node) and src not in state.aliases(cast(Node, node.args[0])):
            _scatter_to_view_copy(gm, node, state)  # the source was not written in place: keep the write
        gm.graph.erase_node(node)
