"""``Node``: one operation of a ``Graph``, with automatic use-def tracking.

Source: torch/fx/node.py and torch/csrc/fx/node.cpp (torch 2.13): ops, use-def bookkeeping, replacement. A node's
``args``/``kwargs`` hold immediate values and other ``Node`` s. Assigning them (or calling
``update_arg``/``insert_arg``/``update_kwarg``/``replace_input_with``) keeps ``users`` and
``all_input_nodes`` exact. Nodes are linked into their graph's circular doubly linked list through
``_prev``/``_next``; ``_sort_key`` orders them by position (``sorted(nodes)`` is list order, as in torch.fx).
"""

from __future__ import annotations

import builtins
import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional, TypeVar, Union, cast

import torch
from torch.utils._dtype_abbrs import dtype_abbrs

from fxdist._impure import has_side_effect, is_random_op, target_is_impure
from fxdist.immutable_collections import immutable_dict, immutable_list

if TYPE_CHECKING:
    from fxdist.graph import Graph

__all__ = ["Node", "map_arg", "map_aggregate", "has_side_effect", "immutable_list", "immutable_dict", "is_random_op"]

BaseArgumentTypes = Union[  # noqa: UP007
    str, int, float, bool, complex, torch.dtype, torch.Tensor, torch.device, torch.memory_format,
    torch.layout, torch._ops.OpOverload, torch.SymInt, torch.SymBool, torch.SymFloat,
]
base_types = typing.get_args(BaseArgumentTypes)
Target = Union[Callable[..., Any], str]  # noqa: UP007
Argument = Optional[Union[  # noqa: UP007
    tuple["Argument", ...], Sequence["Argument"], Mapping[str, "Argument"], slice, range, "Node",
    BaseArgumentTypes,
]]
ArgumentT = TypeVar("ArgumentT", bound=Argument)  # map_arg's type variable, as in torch/fx/node.py

_legal_ops = dict.fromkeys(
    ["placeholder", "call_method", "call_module", "call_function", "get_attr", "output", "root"])

# ---------------------------------------------------------------------------------------------------
# Traversal of arguments

_LEAF_TYPES = frozenset({int, float, bool, str, type(None), complex, torch.dtype, torch.device,
                         torch.memory_format, torch.layout, type(...), range})


def _freeze(a: Any, inputs: dict[Node, None]) -> Any:
    """Copy ``a`` with lists/dicts made immutable, recording every Node met in ``inputs`` (in order)."""
    t = type(a)
    if t in _LEAF_TYPES:
        return a
    if isinstance(a, Node):
        inputs[a] = None
        return a
    if isinstance(a, tuple):
        items = [_freeze(x, inputs) for x in a]
        return t(*items) if hasattr(t, "_fields") else tuple(items)
    if isinstance(a, list):
        return immutable_list([_freeze(x, inputs) for x in a])
    if isinstance(a, dict):
        return immutable_dict([(k, _freeze(v, inputs)) for k, v in a.items()])
    if isinstance(a, slice):
        return slice(_freeze(a.start, inputs), _freeze(a.stop, inputs), _freeze(a.step, inputs))
    return a


def _node_at(graph: Graph, index: int) -> Node:
    """Unpickling helper: the node at ``index`` in ``graph``."""
    for i, n in enumerate(graph.nodes):
        if i == index:
            return n
    raise RuntimeError(f"unpickled graph has no node at position {index}")


def map_aggregate(a: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every leaf of ``a``, rebuilding tuples (namedtuples keep their type), lists
    (as ``immutable_list``), dicts (as ``immutable_dict``, keys untouched) and slices.

    Source: torch/fx/node.py ``map_aggregate``.

    >>> map_aggregate((1, [2, {"k": 3}]), lambda v: v * 10)
    (10, [20, {'k': 30}])
    """
    if isinstance(a, tuple):
        items = [map_aggregate(x, fn) for x in a]
        return type(a)(*items) if hasattr(type(a), "_fields") else tuple(items)
    if isinstance(a, list):
        return immutable_list([map_aggregate(x, fn) for x in a])
    if isinstance(a, dict):
        return immutable_dict([(k, map_aggregate(v, fn)) for k, v in a.items()])
    if isinstance(a, slice):
        return slice(map_aggregate(a.start, fn), map_aggregate(a.stop, fn), map_aggregate(a.step, fn))
    return fn(a)


def map_arg(a: Any, fn: Callable[[Node], Any]) -> Any:
    """Apply ``fn`` to every ``Node`` inside ``a`` (same structure rules as :func:`map_aggregate`).

    Raises:
        AssertionError: ``fn`` is not callable (torch.fx's type).
    """
    if not callable(fn):
        raise AssertionError("fxdist.map_arg(a, fn): fn must be a callable")
    return map_aggregate(a, lambda x: fn(x) if isinstance(x, Node) else x)


# ---------------------------------------------------------------------------------------------------
# Printing helpers (shared with codegen)


def _type_repr(obj: object) -> str:
    """Short repr of a type annotation: ``int``, ``torch.Tensor``; ``repr`` for everything else."""
    if isinstance(obj, type) and not isinstance(obj, types.GenericAlias):
        return obj.__qualname__ if obj.__module__ == "builtins" else f"{obj.__module__}.{obj.__qualname__}"
    if obj is ...:
        return "..."
    if isinstance(obj, types.FunctionType):
        return obj.__name__
    return repr(obj)


def _find_module_of_method(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None)
    if module is not None:
        return module
    for guess in (torch, torch.nn.functional):
        if getattr(guess, fn.__name__, None) is fn:
            return guess.__name__
    raise RuntimeError(f"cannot find the module of {fn!r}; give it a __module__ attribute")


def _get_qualified_name(fn: Callable[..., Any]) -> str:
    """``torch.relu`` -> ``"torch.relu"``, ``getattr`` -> ``"getattr"``, ``Tensor.add`` -> ``"torch.Tensor.add"``."""
    name = fn.__name__
    if getattr(builtins, name, None) is fn:
        return name
    if (isinstance(fn, (types.MethodDescriptorType, types.WrapperDescriptorType))
            and fn is getattr(torch.Tensor, name, None)) or (
            getattr(fn, "__module__", None) == "torch._tensor" and fn.__qualname__ == f"Tensor.{name}"):
        return f"torch.Tensor.{name}"
    if name == "<lambda>":
        try:
            name = inspect.getsource(fn).split("=")[0].strip()
        except Exception as e:
            raise RuntimeError("Unable to represent lambda") from e
    module = _find_module_of_method(fn).replace("torch._ops", "torch.ops")
    if module == "torch" and name == "segment_reduce":
        name = "_" + name
    return f"{module}.{name}"


def _format_arg(arg: object, max_list_len: float = float("inf")) -> str:
    """Format an argument for ``Node.format_node``: nodes as ``%name``, containers recursively."""
    if hasattr(arg, "_custom_fx_repr_fn"):
        return arg._custom_fx_repr_fn()
    if isinstance(arg, (list, tuple)):
        items = ", ".join(_format_arg(a) for i, a in enumerate(arg) if i < max_list_len)
        more = "" if len(arg) < max_list_len + 1 else f", ...[total_len={len(arg)}]"
        if isinstance(arg, list):
            return f"[{items}{more}]"
        return f"({items}{',' if len(arg) == 1 else ''}{more})"
    if isinstance(arg, dict):
        return "{" + ", ".join(f"{k}: {_format_arg(v)}" for k, v in arg.items()) + "}"
    return "%" + str(arg) if isinstance(arg, Node) else str(arg)


class _CompatValueError(ValueError, AssertionError):
    """Bad input where torch.fx raises AssertionError: a ValueError (fxdist's rule) that code written
    for torch.fx still catches as AssertionError."""


class _CompatTypeError(TypeError, AssertionError):
    """A wrongly typed input where torch.fx raises AssertionError (see :class:`_CompatValueError`)."""


class _CompatRuntimeError(RuntimeError, AssertionError):
    """A graph in the wrong state where torch.fx raises AssertionError (see :class:`_CompatValueError`)."""


# ---------------------------------------------------------------------------------------------------


class Node:
    """One operation in a :class:`~fxdist.graph.Graph`. Source: torch/fx/node.py ``Node``.

    Semantics by ``op`` (torch/fx/node.py ``Node`` docstring):

    - ``placeholder``: a function input; ``target`` is the parameter name (str); ``args`` is ``()`` or
      ``(default,)``.
    - ``get_attr``: fetches a parameter/buffer/submodule; ``target`` is its dotted path (str).
    - ``call_function``: ``target`` (a callable) applied to ``args``/``kwargs``.
    - ``call_method``: the method named ``target`` (str) called on ``args[0]``.
    - ``call_module``: the submodule at dotted path ``target`` (str) called on ``args``/``kwargs``
      (without ``self``).
    - ``output``: ``args[0]`` is the returned value; ``target`` is ``"output"``.

    Args:
        graph: the owning graph (create nodes with ``Graph.create_node`` and its helpers instead).
        name: the unique identifier the value is bound to in generated code.
        op: the opcode; target: what it calls or fetches (see above).
        args, kwargs: arguments, Nodes and immediate values; stored as tuple/immutable containers.
        return_type: the Python type of the value (``node.type``), used for annotations.

    Raises:
        ValueError: ``target`` is not callable for ``call_function`` or not a str for another op, or
            ``op`` is unknown (the latter is also an ``AssertionError``, torch.fx's type).
    """

    _args: tuple[Argument, ...]
    _kwargs: dict[str, Argument]
    graph: Graph
    _input_nodes: dict[Node, None]
    users: dict[Node, None]
    type: Any | None
    meta: dict[str, Any]

    # Slots keep a node to a few GC-tracked objects: with an instance __dict__ per node, building a
    # 10k-node graph crossed the collector's full-collection threshold (2.5x slower than torch.fx).
    # "__dict__" stays available (created on first use) for attributes users attach to nodes.
    __slots__ = ("graph", "_name", "_op", "_target", "type", "_input_nodes", "users", "_args", "_kwargs",
                 "_prev", "_next", "_erased", "_sort_key", "_repr_fn", "meta", "__dict__", "__weakref__")

    def __init__(self, graph: Graph, name: str, op: str, target: Target, args: tuple[Argument, ...],
                 kwargs: dict[str, Argument], return_type: Any | None = None) -> None:
        if op == "call_function":
            if not callable(target):
                raise ValueError(
                    f"Node [graph = {graph}, name = '{name}'] target {target} has type "
                    f"{torch.typename(target)} but a Callable is expected")
        else:
            if op not in _legal_ops:
                raise _CompatValueError(
                    f"Node '{name}': op '{op}' is not one of the six opcodes "
                    f"{[o for o in _legal_ops if o != 'root']}")
            if not isinstance(target, str):
                raise ValueError(
                    f"Node [graph = {graph}, name = '{name}'] target {target} has type "
                    f"{torch.typename(target)} but a str is expected")
        self.graph, self._name, self._op, self._target, self.type = graph, name, op, target, return_type
        self._input_nodes = {}
        self.users = {}
        self._args, self._kwargs = (), immutable_dict()
        self._prev = self._next = self
        self._erased = False
        self._sort_key: tuple[int, ...] = ()
        self._repr_fn: Callable[[Node], str] | None = None
        self.meta = {}
        self._update_args_kwargs(() if args is None else args, {} if kwargs is None else kwargs)

    # -- name/op/target: keep the graph's namespace and find_nodes table in sync -------------------
    @property
    def name(self) -> str:
        """The unique identifier of this value; assigning one also reserves it in the graph's namespace,
        so later nodes cannot be given the same name (torch.fx does not do this)."""
        return self._name

    @name.setter
    def name(self, value: str) -> None:
        self._name = value
        namespace = getattr(self.graph, "_graph_namespace", None)
        if namespace is not None:
            namespace._used_names.add(value)

    @property
    def op(self) -> str:
        return self._op

    @op.setter
    def op(self, value: str) -> None:
        self._set_keyed("_op", value)

    @property
    def target(self) -> Target:
        return self._target

    @target.setter
    def target(self, value: Target) -> None:
        self._set_keyed("_target", value)

    def _set_keyed(self, field: str, value: Any) -> None:
        table = getattr(self.graph, "_find_nodes_lookup_table", None)
        listed = table is not None and not self._erased and self in table
        if listed and table is not None:
            table.remove(self)
        setattr(self, field, value)
        if listed and table is not None:
            table.insert(self)

    # -- linked list --------------------------------------------------------------------------------
    @property
    def next(self) -> Node:
        """The next node in the graph's list (the graph's sentinel after the last node)."""
        return self._next

    @property
    def prev(self) -> Node:
        """The previous node in the graph's list (the graph's sentinel before the first node)."""
        return self._prev

    def prepend(self, x: Node) -> None:
        """Insert ``x`` just before this node, unlinking it first if it is already in the list.

        Raises:
            ValueError: ``x`` belongs to another graph.
        """
        if x is self:
            return
        if x.graph is not self.graph:
            raise _CompatValueError(f"Cannot move node {x.name} of another graph next to {self.name}; "
                             f"use graph.node_copy() to copy it instead")
        x._remove_from_list()
        p = self._prev
        p._next, x._prev = x, p
        x._next, self._prev = self, x
        x._assign_sort_key()

    def append(self, x: Node) -> None:
        """Insert ``x`` just after this node (equivalent to ``self.next.prepend(x)``)."""
        self._next.prepend(x)

    def _remove_from_list(self) -> None:
        # keep self._prev/_next so that an iterator standing on an erased node can move on
        p, n = self._prev, self._next
        p._next, n._prev = n, p

    def _assign_sort_key(self) -> None:
        """Give this (just linked) node a key strictly between its neighbours' keys, never renumbering.

        Keys are int tuples compared lexicographically (a prefix sorts before its extensions). Between
        neighbours ``a < b``: if ``b`` is longer, ``b`` cut to ``len(a) + 1`` items with the last one
        decremented; if ``a`` is longer, ``a`` cut to ``len(b) + 1`` items with the last one incremented;
        otherwise ``a + (0,)``. These are the keys torch.fx assigns.
        """
        p, n, root = self._prev, self._next, self.graph._root
        if p is root:
            self._sort_key = (n._sort_key[0] - 1,) if n is not root else (0,)
        elif n is root:
            self._sort_key = (p._sort_key[0] + 1,)
        else:
            a, b = p._sort_key, n._sort_key
            la, lb = len(a), len(b)
            if la < lb:    # e.g. (1, 1) < (1, 2, -1) < (1, 2, 0)
                self._sort_key = b[:la] + (b[la] - 1,)
            elif la > lb:  # e.g. (1, 0, 5) < (1, 0, 6) < (1, 2)
                self._sort_key = a[:lb] + (a[lb] + 1,)
            else:          # e.g. (1, 1) < (1, 1, 0) < (1, 2)
                self._sort_key = a + (0,)

    def __deepcopy__(self, memo: dict[Any, Any]) -> Node:
        """The counterpart of this node in a deep copy of its graph (copied once per ``memo``), instead of
        a recursive copy along ``_prev``/``_next`` that overflows the stack on long graphs."""
        import copy

        copy.deepcopy(self.graph, memo)
        if self not in memo:  # erased, or after the output node: not part of the copied program
            raise RuntimeError(f"cannot deepcopy node {self.name}: it is erased or placed after the output node")
        return memo[self]

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # pickle as (graph, position): the graph pickles flat, so long graphs do not hit the recursion limit
        for i, n in enumerate(self.graph.nodes):
            if n is self:
                return (_node_at, (self.graph, i))
        raise RuntimeError(f"cannot pickle node {self.name}: it is erased or not in its graph")

    def __copy__(self) -> Node:
        new = Node.__new__(Node)
        for field in Node.__slots__[:-2]:
            if hasattr(self, field):
                setattr(new, field, getattr(self, field))
        new.__dict__.update(self.__dict__)
        return new

    def __lt__(self, other: Node) -> bool:
        return self._sort_key < other._sort_key

    def __gt__(self, other: Node) -> bool:
        return self._sort_key > other._sort_key

    def __le__(self, other: Node) -> bool:
        return self._sort_key <= other._sort_key

    def __ge__(self, other: Node) -> bool:
        return self._sort_key >= other._sort_key

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    # -- arguments and use-def ----------------------------------------------------------------------
    @property
    def args(self) -> tuple[Argument, ...]:
        """Positional arguments. Assigning a new tuple updates ``users``/``all_input_nodes``."""
        return self._args

    @args.setter
    def args(self, a: tuple[Argument, ...]) -> None:
        self._update_args_kwargs(a, self._kwargs)

    @property
    def kwargs(self) -> dict[str, Argument]:
        """Keyword arguments. Assigning a new dict updates ``users``/``all_input_nodes``."""
        return self._kwargs

    @kwargs.setter
    def kwargs(self, k: dict[str, Argument]) -> None:
        self._update_args_kwargs(self._args, k)

    @property
    def all_input_nodes(self) -> list[Node]:
        """Nodes appearing in ``args`` then ``kwargs``, each once, in first-appearance order."""
        return list(self._input_nodes)

    def _update_args_kwargs(self, new_args: Any, new_kwargs: Any) -> None:
        """Replace args/kwargs and redo the use-def bookkeeping (torch/fx/node.py ``Node.__update_args_kwargs``)."""
        for old in self._input_nodes:
            old.users.pop(self, None)
        inputs = self._input_nodes
        inputs.clear()
        self._args = _freeze(new_args, inputs)
        self._kwargs = _freeze(new_kwargs, inputs)
        for n in inputs:
            n.users.setdefault(self)

    def update_arg(self, idx: int, arg: Argument) -> None:
        """Set ``self.args[idx] = arg`` (by assigning a new tuple)."""
        args = list(self._args)
        args[idx] = arg
        self.args = tuple(args)

    def insert_arg(self, idx: int, arg: Argument) -> None:
        """Insert ``arg`` at position ``idx`` of ``args`` (``0 <= idx <= len(args)``).

        Raises:
            AssertionError: ``idx`` is out of range (torch.fx's type).
        """
        if not 0 <= idx <= len(self._args):
            raise AssertionError(f"insert_arg index must be between 0 and len(self.args)={len(self._args)}, "
                                 f"got {idx} (node {self.name})")
        self.args = self._args[:idx] + (arg,) + self._args[idx:]

    def update_kwarg(self, key: str, arg: Argument) -> None:
        """Set ``self.kwargs[key] = arg`` (by assigning a new dict)."""
        self.kwargs = {**self._kwargs, key: arg}

    def _replace_input_with(self, old_input: Node, new_input: Any) -> None:
        def swap(n: Node) -> Any:
            return new_input if n is old_input else n
        self._update_args_kwargs(map_arg(self._args, swap), map_arg(self._kwargs, swap))

    def replace_input_with(self, old_input: Node, new_input: Node) -> None:
        """Replace every occurrence of ``old_input`` in this node's args/kwargs with ``new_input``."""
        for hook in getattr(self.graph.owning_module, "_replace_hooks", None) or ():
            hook(old=old_input, new=new_input.name, user=self)
        self._replace_input_with(old_input, new_input)

    def replace_all_uses_with(self, replace_with: Node, delete_user_cb: Callable[[Node], bool] | None = None,
                              *, propagate_meta: bool = False) -> list[Node]:
        """Make every user of this node use ``replace_with`` instead.

        Args:
            replace_with: the node to use instead.
            delete_user_cb: called per user; users for which it returns False are left alone.
            propagate_meta: copy this node's ``meta`` onto ``replace_with`` (which must have none).

        Returns:
            The users that were changed, in ``users`` order.

        Raises:
            AssertionError: ``propagate_meta`` and ``replace_with.meta`` is not empty (torch.fx's type).
        """
        if propagate_meta:
            if replace_with.meta:
                raise AssertionError(
                    f"Called {self.name}.replace_all_uses_with({replace_with.name}, propagate_meta=True), "
                    f"but {replace_with.name} already has .meta keys {sorted(replace_with.meta)}")
            replace_with.meta.update(self.meta)
        hooks = getattr(self.graph.owning_module, "_replace_hooks", None) or ()
        changed = []
        for user in list(self.users):
            if delete_user_cb is not None and not delete_user_cb(user):
                continue
            changed.append(user)
            for hook in hooks:
                hook(old=self, new=replace_with.name, user=user)
            user._replace_input_with(self, replace_with)
        return changed

    def _rename(self, candidate: str) -> None:
        if candidate == self.name:
            return
        name = self.graph._graph_namespace.create_name(candidate, None)
        self.name = name
        self.graph._graph_namespace._rename_object(self, name)

    # -- metadata and printing ----------------------------------------------------------------------
    @property
    def stack_trace(self) -> str | None:
        """The user's stack trace recorded while tracing (``meta["stack_trace"]``), innermost frame last."""
        return self.meta.get("stack_trace", None)

    @stack_trace.setter
    def stack_trace(self, trace: str | None) -> None:
        self.meta["stack_trace"] = trace

    def __repr__(self) -> str:
        return self._repr_fn(self) if self._repr_fn else self.name

    @staticmethod
    def _pretty_print_target(target: object) -> str:
        """``"layer1"`` -> ``layer1``, ``operator.add`` -> ``operator.add``, ``len`` -> ``builtins.len``,
        ``torch.relu`` -> ``torch.relu``."""
        if isinstance(target, str):
            return target
        if hasattr(target, "__module__"):
            name = getattr(target, "__name__", None)
            if name is None:
                return _get_qualified_name(target)  # type: ignore[arg-type]
            if target.__module__ == "builtins":
                return f"builtins.{name}"
            if target.__module__ == "_operator":
                return f"operator.{name}"
        return _get_qualified_name(target)  # type: ignore[arg-type]

    def format_node(self, placeholder_names: list[str] | None = None,
                    maybe_return_typename: list[str] | None = None, *,
                    include_tensor_metadata: bool = False) -> str | None:
        """One line describing this node, as in ``str(graph)``:
        ``%add : [num_users=1] = call_function[target=operator.add](args = (%x, %y), kwargs = {})``.

        ``placeholder_names``/``maybe_return_typename`` are used by ``Graph.__str__``: placeholders
        append their signature text there and return None.
        """
        users = f"[num_users={len(self.users)}]"
        typename = f"{_type_repr(self.type)} " if self.type is not None else ""
        if self.op == "placeholder":
            arg_str = cast(str, self.target)
            arg_str += arg_str + f": {_type_repr(self.type)}" if self.type else ""  # torch.fx prints this
            if placeholder_names:
                placeholder_names.append(arg_str)
                return None
            default = f"(default={self.args[0]})" if self.args else ""
            typename = f"{_type_repr(self.type)} " if self.type else ""
            return f"%{self.name} : {typename}{users} = placeholder[target={self.target}]{default}"
        if self.op == "get_attr":
            return f"%{self.name} : {typename}{users} = get_attr[target={self._pretty_print_target(self.target)}]"
        if self.op == "output":
            if self.type and maybe_return_typename:
                maybe_return_typename[0] = f" -> {_type_repr(self.type)}"
            return f"return {self.args[0]}"
        val = self.meta.get("val", self.meta.get("tensor_meta", self.meta.get("example_value", None)))
        if include_tensor_metadata and isinstance(val, torch.Tensor) and val.layout not in (
                torch.sparse_csc, torch.sparse_csr):
            shape = "[" + ", ".join(str(s) for s in val.shape) + "]"
            stride = "[" + ", ".join(str(s) for s in val.stride()) + "]"
            typename = f'Tensor "{dtype_abbrs[val.dtype]}{shape}{stride}{val.device}"'
        return (f"%{self.name} : {typename}{users} = {self.op}[target={self._pretty_print_target(self.target)}]"
                f"(args = {_format_arg(self.args)}, kwargs = {_format_arg(self.kwargs)})")

    # -- purity -------------------------------------------------------------------------------------
    def is_impure(self, impure_random: bool = True) -> bool:
        """Whether dead-code elimination must keep this node even when it has no users.

        Impure: placeholders and outputs; ``meta["impure"] is True``; ``call_function`` of a registered
        side-effectful function (:func:`has_side_effect`, ``torch._assert``, ``operator.setitem``, ...),
        of ``torch.distributed`` RPC/collective calls, of in-place functions (name ending in ``_``,
        ATen ops with a mutable schema) or of random ops (``torch.rand*``, dropout in training,
        ATen ops tagged ``nondeterministic_seeded``); ``call_method`` of an in-place method;
        ``call_module`` of a module with ``_is_impure`` set or a dropout module in training mode.

        Args:
            impure_random: whether random ops count as impure.

        Source: torch/fx/node.py ``Node.is_impure`` (extended with the in-place, RPC and random rules).
        """
        if self.op in ("placeholder", "output") or self.meta.get("impure") is True:
            return True
        if self.op in ("call_function", "call_method"):
            return target_is_impure(self.op, self.target, self.args, self.kwargs, impure_random)
        if self.op == "call_module":
            root = self.graph.owning_module
            if root is None:
                return False
            try:
                mod = root.get_submodule(self.target)
            except AttributeError:
                return False
            if getattr(mod, "_is_impure", False):
                return True
            random_mod = isinstance(mod, (torch.nn.modules.dropout._DropoutNd, torch.nn.RReLU))
            return impure_random and random_mod and mod.training
        return False

