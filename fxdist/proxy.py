"""Proxies: Node wrappers that record every operation they touch into a Graph.

A ``Proxy`` stands in for a value during symbolic tracing. Python operators on it (``x + y``,
``x[0]``, ``-x``), ``torch`` functions (through ``__torch_function__``), Tensor methods (``x.view(...)``)
and attribute reads (``x.shape``) each append one node to ``tracer.graph`` and return a new Proxy.
Anything that would need the concrete value (``bool(x)``, ``len(x)``, ``for v in x``) raises a
``TraceError`` naming the user's source line.

``TracerBase`` holds the node-creation logic shared by the full ``Tracer`` (fxdist/tracer.py) and by
``GraphAppendingTracer``, which appends to an existing graph when a transform wraps raw nodes in Proxies
(``Proxy(node)``, as in the decomposition example of the torch.fx documentation, "Proxy/Retracing").

Source: torch/fx/proxy.py (TracerBase, GraphAppendingTracer, Proxy, Attribute, ParameterProxy);
torch.fx paper §4.1 (symbolic tracing with Proxy objects and ``__torch_function__``).
"""

from __future__ import annotations

import builtins
import collections
import dis
import enum
import operator
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import fields, is_dataclass
from types import CodeType, FrameType
from typing import Any, cast

import torch
from torch.overrides import is_tensor_method_or_property

from fxdist._mutable_ops import check_not_mutating
from fxdist._stack_trace import format_stack, user_frames
from fxdist.errors import ProxyIterationError, ProxyUsageError, TraceError, add_user_note
from fxdist.graph import Graph
from fxdist.node import Node

__all__ = [
    "TracerBase",
    "GraphAppendingTracer",
    "TraceError",
    "Proxy",
    "Attribute",
    "ParameterProxy",
    "Scope",
    "ScopeContextManager",
]

# Values stored in a graph as they are (torch.fx node.py ``base_types``).
BASE_TYPES: tuple[type, ...] = (
    str, int, float, bool, complex, torch.dtype, torch.Tensor, torch.device, torch.memory_format,
    torch.layout, torch._ops.OpOverload, torch.SymInt, torch.SymBool, torch.SymFloat,
)
_PASS_THROUGH: frozenset[type] = frozenset(BASE_TYPES) | {type(None), type(...)}

# Hints appended to trace errors after the user's location.
_CONTROL_FLOW_HINT = "use concrete_args= or fxdist.wrap(...) on the function holding it"
_ITER_HINT = "index it explicitly (x[i] for i in range(n)) or fxdist.wrap(...) the loop's function"


class Scope:
    """The module path and type that contain the node being created (torch.fx ``Scope``)."""

    def __init__(self, module_path: str, module_type: Any) -> None:
        self.module_path = module_path
        self.module_type = module_type


class ScopeContextManager:
    """Set ``scope`` to ``current_scope`` for the duration of a ``with`` block, then restore it."""

    def __init__(self, scope: Scope, current_scope: Scope) -> None:
        self._prev = (scope.module_path, scope.module_type)
        scope.module_path = current_scope.module_path
        scope.module_type = current_scope.module_type
        self._scope = scope

    def __enter__(self) -> Scope:
        return self._scope

    def __exit__(self, *exc: object) -> None:
        self._scope.module_path, self._scope.module_type = self._prev


_SNAKE = re.compile(r"(?<=[a-z])([A-Z])")


def _snake_case(name: str) -> str:
    """``pascalCase`` -> ``pascal_case`` (how torch.fx names nodes after their target)."""
    return _SNAKE.sub(r"_\1", name).lower()


# --------------------------------------------------------------------------------------------------


class TracerBase:
    """Creates nodes and proxies; subclass and override to customize what gets recorded.

    Attributes:
        graph: the Graph nodes are appended to.
        record_stack_traces: store the user frames in ``node.meta["stack_trace"]``.
        check_mutable_operations: reject in-place ATen calls whose schema says they mutate an input.
        trace_asserts: record ``assert proxy`` as a ``call_function`` to an assertion instead of failing.
        proxy_buffer_attributes: turn module buffers read during tracing into ``get_attr`` proxies.
        module_stack: path -> (qualified name, module type) of the module calls being traced.

    Source: torch/fx/proxy.py ``TracerBase``.
    """

    graph: Graph
    record_stack_traces: bool = False
    check_mutable_operations: bool = False
    trace_asserts: bool = False
    proxy_buffer_attributes: bool = False
    traced_func_name: str = "forward"
    scope: Scope
    module_stack: collections.OrderedDict[str, tuple[str, Any]]
    node_name_to_scope: dict[str, tuple[str, type]]

    def create_node(
        self,
        kind: str,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None = None,
        type_expr: Any | None = None,
    ) -> Node:
        """Insert a node into ``self.graph`` and stamp scope, ``nn_module_stack`` and ``stack_trace``.

        Override to check or rewrite nodes as they are created (e.g. forbid in-place ops).
        """
        if kind == "call_function" and self.check_mutable_operations:
            check_not_mutating(target, args, kwargs)
        node = self.graph.create_node(kind, target, args, kwargs, name, type_expr)
        scope = self.scope
        self.node_name_to_scope[node.name] = (scope.module_path, scope.module_type)
        if self.module_stack:
            node.meta["nn_module_stack"] = self.module_stack.copy()
        if self.record_stack_traces and not node.meta.get("stack_trace"):
            frames = user_frames(sys._getframe(1), self.__dict__.get("_stack_cache"))
            if frames:
                node.meta["stack_trace"] = format_stack(frames)
        return node

    def proxy(self, node: Node) -> Proxy:
        """Wrap ``node`` in the Proxy type this tracer hands out."""
        return Proxy(node, self)

    def create_proxy(
        self,
        kind: str,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None = None,
        type_expr: Any | None = None,
        proxy_factory_fn: Callable[[Node], Proxy] | None = None,
    ) -> Proxy:
        """Lower ``args``/``kwargs`` with :meth:`create_arg`, create the node, and wrap it.

        For ``placeholder`` nodes ``args`` holds the default value, if any.

        Raises:
            TypeError: an overridden :meth:`create_arg` did not map ``args`` to a tuple and ``kwargs`` to a dict.
        """
        args_ = self.create_arg(args)
        kwargs_ = self.create_arg(kwargs)
        if not isinstance(args_, tuple) or not isinstance(kwargs_, dict):
            raise TypeError(f"create_arg must map args to a tuple and kwargs to a dict, got "
                            f"{type(args_).__name__} and {type(kwargs_).__name__}")
        node = self.create_node(kind, target, args_, kwargs_, name, type_expr)
        return proxy_factory_fn(node) if proxy_factory_fn is not None else self.proxy(node)

    def create_arg(self, a: Any) -> Any:
        """Lower a value seen during tracing to something a node can hold (an ``Argument``).

        Proxies become their nodes; tuples, lists, dicts, slices and ranges are lowered element-wise;
        dataclass instances become a ``call_function`` to their class; base types pass through.

        Raises:
            ProxyUsageError: a dict key contains a Proxy.
            NotImplementedError: the value has no graph representation.
        """
        kind = type(a)
        if kind in _PASS_THROUGH:
            return a
        if isinstance(a, Proxy):
            return a.node
        if hasattr(a, "__fx_create_arg__"):
            return a.__fx_create_arg__(self)
        if isinstance(a, tuple):
            items = [self.create_arg(e) for e in a]
            return kind(*items) if hasattr(a, "_fields") else kind(items)
        if isinstance(a, list):
            return [self.create_arg(e) for e in a]
        if isinstance(a, dict):
            return self._create_arg_dict(a)
        if isinstance(a, slice):
            return slice(self.create_arg(a.start), self.create_arg(a.stop), self.create_arg(a.step))
        if isinstance(a, range):
            return range(self.create_arg(a.start), self.create_arg(a.stop), self.create_arg(a.step))
        if isinstance(a, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
            return a
        if is_dataclass(a) and not isinstance(a, type):
            kwargs = {f.name: self.create_arg(getattr(a, f.name)) for f in fields(a)}
            return self.create_node("call_function", kind, (), kwargs)
        if isinstance(a, (*BASE_TYPES, enum.Enum)) or a is None or a is ...:
            return a
        raise NotImplementedError(f"argument of type: {kind}")

    def _create_arg_dict(self, a: dict[Any, Any]) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for k, v in a.items():
            if not isinstance(k, str):
                k = self.create_arg(k)
                if _contains_node(k):
                    err = ProxyUsageError("Keys for dictionaries used as an argument cannot contain "
                                          f"a Node. Got key: {k}")
                    raise add_user_note(err, sys._getframe(), "use a constant key, e.g. the name")
            out[k] = self.create_arg(v)
        return out

    def to_bool(self, obj: Proxy) -> bool:
        """Called for ``bool(proxy)`` (``if``, ``while``, ``and``...). Override to decide the branch.

        Raises:
            TraceError: always, in this base implementation.
        """
        raise TraceError("symbolically traced variables cannot be used as inputs to control flow")

    def iter(self, obj: Proxy) -> Iterator[Any]:
        """Called when a Proxy is iterated (``for``, ``*args``). Override to return an iterator.

        Raises:
            TraceError: always, in this base implementation. Deliberately not a ``TypeError``: CPython
                replaces a TypeError from ``__iter__`` by its own message when C code iterates
                (``x in proxy``, ``dict(proxy)``, unpacking in C), which would hide this one.
        """
        raise TraceError(
            "Proxy object cannot be iterated. This can be attempted when the Proxy is used in a loop "
            "or as a *args or **kwargs function argument. See the torch.fx docs on pytorch.org for a "
            "more detailed explanation of what types of control flow can be traced, and check out the "
            "Proxy docstring for help troubleshooting Proxy iteration errors")

    def keys(self, obj: Proxy) -> Any:
        """Called for ``obj.keys()`` (what ``**obj`` does); records a ``keys`` method call."""
        return Attribute(obj, "keys")()


def _contains_node(arg: Any) -> bool:
    if isinstance(arg, Node):
        return True
    if isinstance(arg, (tuple, list)):
        return any(_contains_node(a) for a in arg)
    if isinstance(arg, dict):
        return any(_contains_node(a) for a in arg.values())
    if isinstance(arg, slice):
        return any(_contains_node(a) for a in (arg.start, arg.stop, arg.step))
    return False


class GraphAppendingTracer(TracerBase):
    """A tracer that just appends to ``graph``: what ``Proxy(node)`` uses when rewriting a graph.

    Source: torch/fx/proxy.py ``GraphAppendingTracer``.
    """

    def __init__(self, graph: Graph) -> None:
        super().__init__()
        self.graph = graph
        self.scope = Scope("", None)
        self.module_stack = collections.OrderedDict()
        self.node_name_to_scope = {}


def _assert_fn(x: Any) -> None:
    """What ``assert proxy`` records when ``trace_asserts`` is on."""
    if not x:
        raise AssertionError("Assertion failed")


# id(code) -> (code, instruction offsets, instructions); the code is kept to pin its id.
_BYTECODE: dict[int, tuple[CodeType, list[int], list[dis.Instruction]]] = {}


def _instruction_at(frame: FrameType) -> tuple[list[dis.Instruction], int]:
    """The bytecode of ``frame`` and the index of the instruction it is executing (cached per code)."""
    from bisect import bisect_left

    code = frame.f_code
    entry = _BYTECODE.get(id(code))
    if entry is None:
        insts = list(dis.get_instructions(code))
        entry = _BYTECODE[id(code)] = (code, [i.offset for i in insts], insts)
    return entry[2], bisect_left(entry[1], frame.f_lasti)


class Proxy:
    """Stands in for a value during symbolic tracing and records what is done with it.

    ``Proxy(node)`` without a tracer wraps a raw node of an existing graph, so a rewrite rule can be
    written as plain Python over Proxies (operations append to ``node.graph``).

    A Proxy cannot be iterated, tested for truth or measured with ``len`` while tracing: those need
    the concrete value. Unpacking (``a, b = proxy``) works and records ``proxy[0]``, ``proxy[1]``.

    Source: torch/fx/proxy.py ``Proxy``.
    """

    def __init__(self, node: Node, tracer: TracerBase | None = None) -> None:
        if tracer is None:
            tracer = GraphAppendingTracer(node.graph)
        self.tracer = tracer
        self.node = node

    def __repr__(self) -> str:
        return f"Proxy({self.node.name})"

    def __getattr__(self, k: str) -> Attribute:
        # Not recorded yet: a method call turns it into call_method instead of getattr + call.
        return Attribute(self, k)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__ = d

    def __deepcopy__(self, memo: dict[int, Any]) -> Proxy:
        import copy

        new = Proxy.__new__(type(self))
        for k, v in self.__dict__.items():
            try:
                new.__dict__[k] = copy.deepcopy(v, memo)
            except Exception:
                new.__dict__[k] = copy.copy(v)
        return new

    def __call__(self, *args: Any, **kwargs: Any) -> Proxy:
        return self.tracer.create_proxy("call_method", "__call__", (self, *args), kwargs)

    def __iter__(self) -> Iterator[Any]:
        caller = sys._getframe(1)
        insts, idx = _instruction_at(caller)
        if idx < len(insts) and insts[idx].opname == "UNPACK_SEQUENCE":
            return (cast(Any, self)[i] for i in range(insts[idx].argval))  # __getitem__: a magic method set below
        try:
            return self.tracer.iter(self)
        except TraceError as e:
            if type(e) is TraceError and _is_iter_probe(caller, insts, idx):
                e = ProxyIterationError(*e.args)
            raise add_user_note(e, caller, _ITER_HINT) from None

    def __abs__(self) -> Proxy:
        return self.tracer.create_proxy("call_function", operator.abs, (self,), {})

    def __bool__(self) -> bool:
        caller = sys._getframe(1)
        if self.tracer.trace_asserts and _is_assert(caller):
            self.tracer.create_proxy("call_function", _assert_fn, (self,), {})
            return True
        try:
            return self.tracer.to_bool(self)
        except TraceError as e:
            raise add_user_note(e, caller, _CONTROL_FLOW_HINT) from None

    def keys(self) -> Any:
        return self.tracer.keys(self)

    def __len__(self) -> int:
        err = ProxyUsageError(
            "'len' is not supported in symbolic tracing by default. If you want this call to be "
            "recorded, please call fxdist.wrap('len') at module scope")
        raise add_user_note(err, sys._getframe(1), "or pass the length as a concrete value")

    @classmethod
    def __torch_function__(
        cls,
        orig_method: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> Proxy:
        args = args if args else ()
        kwargs = kwargs if kwargs else {}
        tracer = _find_tracer(args, kwargs)
        if isinstance(orig_method, torch._C.ScriptMethod):
            return tracer.create_proxy("call_method", orig_method.name, (orig_method.owner, *args), kwargs)
        if is_tensor_method_or_property(orig_method):
            return tracer.create_proxy("call_method", orig_method.__name__, args, kwargs)
        return tracer.create_proxy("call_function", orig_method, args, kwargs,
                                   name=_snake_case(orig_method.__name__))


_CALL_PREFIX = frozenset({"PRECALL", "KW_NAMES"})


def _is_iter_probe(frame: FrameType, insts: list[dis.Instruction], idx: int) -> bool:
    """Whether ``frame`` is executing ``iter(<expression>)`` with the builtin ``iter``.

    That is the idiom ``try: iter(x) except TypeError:`` with which libraries ask "is this
    iterable?" (transformers' ``ModelOutput.__post_init__``); for it, iterating a Proxy raises a
    TraceError that is also a TypeError, so the probe answers "no". Everywhere else (``for``, ``in``,
    ``dict(proxy)``, ``**proxy``, C code) it is a plain TraceError as in torch.fx: CPython would replace
    a TypeError's message there. Walks the argument's bytecode backwards by stack effect; anything
    unusual (jumps inside the argument) answers False.
    """
    # Python 3.11's specialized PRECALL calls a builtin itself, so a warm frame may stop there
    if idx >= len(insts) or insts[idx].opname not in ("CALL", "PRECALL") or insts[idx].arg != 1:
        return False
    i = idx - 1
    while i >= 0 and insts[i].opname in _CALL_PREFIX:
        i -= 1
    pushed = 0
    while i >= 0 and pushed < 1:
        inst = insts[i]
        if inst.is_jump_target or inst.opcode in dis.hasjrel or inst.opcode in dis.hasjabs:
            return False
        pushed += dis.stack_effect(inst.opcode, inst.arg if inst.opcode >= dis.HAVE_ARGUMENT else None, jump=False)
        i -= 1
    if pushed != 1 or i < 0:
        return False
    callee = insts[i]
    if callee.opname not in ("LOAD_GLOBAL", "LOAD_NAME") or callee.argval != "iter":
        return False
    return frame.f_globals.get("iter", builtins.iter) is builtins.iter


def _is_assert(frame: FrameType) -> bool:
    """Whether ``frame`` is evaluating the condition of an ``assert`` statement."""
    insts, cur = _instruction_at(frame)
    if cur + 1 >= len(insts) or insts[cur].opname not in ("POP_JUMP_IF_TRUE", "POP_JUMP_FORWARD_IF_TRUE"):
        return False
    nxt = insts[cur + 1]
    return nxt.opname == "LOAD_ASSERTION_ERROR" or (nxt.opname == "LOAD_GLOBAL" and nxt.argval == "AssertionError")


def _find_tracer(args: tuple[Any, ...], kwargs: dict[str, Any]) -> TracerBase:
    """The one tracer owning the Proxies in ``args``/``kwargs`` (nested containers included)."""
    found: dict[TracerBase, None] = {}
    stack: list[Any] = [args, kwargs]
    while stack:
        a = stack.pop()
        if isinstance(a, Proxy):
            found[a.tracer] = None
        elif isinstance(a, (tuple, list)):
            stack.extend(a)
        elif isinstance(a, dict):
            stack.extend(a.values())
        elif isinstance(a, slice):
            stack.extend((a.start, a.stop, a.step))
    if len(found) != 1:
        if not found:
            raise RuntimeError("__torch_function__ called on Proxy without any Proxy argument")
        raise ProxyUsageError(f"Found multiple different tracers {list(found)} while trying to trace")
    return next(iter(found))


class Attribute(Proxy):
    """``proxy.attr``: a ``getattr`` node created lazily, or a ``call_method`` node when called.

    Source: torch/fx/proxy.py ``Attribute``.
    """

    def __init__(self, root: Proxy, attr: str) -> None:
        self.root = root
        self.attr = attr
        self.tracer = root.tracer
        self._node: Node | None = None

    @property
    def node(self) -> Node:  # type: ignore[override]
        if self._node is None:
            self._node = self.tracer.create_proxy("call_function", getattr, (self.root, self.attr), {}).node
        return self._node

    def __call__(self, *args: Any, **kwargs: Any) -> Proxy:
        return self.tracer.create_proxy("call_method", self.attr, (self.root, *args), kwargs)


class ParameterProxy(Proxy):
    """A parameter's Proxy whose shape queries (``shape``, ``size()``, ``dim()``, ``ndim``,
    ``numel()``, ``nelement()``) answer from the real parameter, so shape checks on parameters
    don't count as dynamic control flow (``Tracer(param_shapes_constant=True)``).

    Raises:
        TypeError: ``param`` is not a ``torch.nn.Parameter``.

    Source: torch/fx/proxy.py ``ParameterProxy``.
    """

    def __init__(self, tracer: TracerBase, node: Node, name: str, param: torch.nn.Parameter) -> None:
        super().__init__(node, tracer)
        if not isinstance(param, torch.nn.Parameter):
            raise TypeError(f"ParameterProxy needs a torch.nn.Parameter, got {type(param).__name__}")
        self.param = param
        self.name = name

    def __repr__(self) -> str:
        return f"ParameterProxy({self.name})"

    @property
    def shape(self) -> torch.Size:
        return self.param.shape

    def size(self) -> torch.Size:
        return self.param.size()

    def dim(self) -> int:
        return self.param.dim()

    @property
    def ndim(self) -> int:
        return self.param.ndim

    def numel(self) -> int:
        return self.param.numel()

    def nelement(self) -> int:
        return self.param.nelement()


# Python operators recorded as call_function on the operator module; reflected forms swap operands.
_REFLECTABLE = ("add", "sub", "mul", "floordiv", "truediv", "mod", "pow", "lshift", "rshift",
                "and_", "or_", "xor", "getitem", "matmul")
_MAGIC = ("eq", "ne", "lt", "gt", "le", "ge", "pos", "neg", "invert", *_REFLECTABLE)


def _install_operator(name: str) -> None:
    target = getattr(operator, name)

    def impl(*args: Any, **kwargs: Any) -> Proxy:
        return args[0].tracer.create_proxy("call_function", target, args, kwargs)

    impl.__name__ = impl.__qualname__ = f"__{name.strip('_')}__"
    setattr(Proxy, impl.__name__, impl)


def _install_reflected(name: str) -> None:
    target = getattr(operator, name)

    def impl(self: Proxy, lhs: Any) -> Proxy:
        return self.tracer.create_proxy("call_function", target, (lhs, self), {})

    impl.__name__ = impl.__qualname__ = f"__r{name.strip('_')}__"
    setattr(Proxy, impl.__name__, impl)


# Installed after the class body so that defining __eq__ keeps the default identity __hash__.
for _name in _MAGIC:
    _install_operator(_name)
for _name in _REFLECTABLE:
    _install_reflected(_name)
del _name
