"""Monkey patching for the tracer: leaf functions (``wrap``, autowrap) and reversible patches.

``_Patcher`` records every change (a global name, a class attribute such as ``nn.Module.__call__``)
and undoes all of them, in reverse order, when its ``with`` block exits, also when tracing raised.
``wrap("name")`` at module scope registers a global function whose calls on Proxies are recorded as one
``call_function`` node instead of being traced through. ``ProxyableClassMeta`` makes constructing a
class from Proxies one ``call_function`` node. The ``__fx_already_patched`` flag is set with ``setattr``
(torch.fx writes it inside its class body, where Python mangles the name, so it never deduplicates).

Source: torch/fx/_symbolic_trace.py (``_Patcher``, ``wrap``, ``_autowrap_check``, ``ProxyableClassMeta``).
"""

from __future__ import annotations

import builtins
import functools
import inspect
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

from fxdist.proxy import Proxy

__all__ = ["wrap", "ProxyableClassMeta"]


class _TraceState:
    """Whether an fxdist ``Tracer.trace`` is running (``fxdist.tracer.is_fx_tracing``)."""

    active: bool = False


# Classes made with ProxyableClassMeta (any subclass of it as well), in definition order.
_proxyable_classes: dict[type, None] = {}


# Set on every stand-in; a stand-in patched with deduplicate=True is not patched over again.
_PATCHED_FLAG = "__fx_already_patched"


class _Patcher:
    """Records monkey patches (dict items and class attributes) and reverts them on exit."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self._visited: set[tuple[str, int]] = set()

    def patch(self, frame_dict: dict[str, Any], name: str, new_fn: Callable[..., Any],
              deduplicate: bool = True) -> None:
        """Set ``frame_dict[name] = new_fn`` (a global or builtin name) until exit."""
        setattr(new_fn, _PATCHED_FLAG, deduplicate)  # a string: a dunder here would be name-mangled
        if name not in frame_dict and hasattr(builtins, name):
            frame_dict[name] = new_fn
            self._undo.append(lambda: frame_dict.pop(name, None))
        elif getattr(frame_dict[name], _PATCHED_FLAG, False):
            return
        else:
            orig = frame_dict[name]
            frame_dict[name] = new_fn
            self._undo.append(lambda: frame_dict.__setitem__(name, orig))

    def patch_method(self, cls: type, name: str, new_fn: Callable[..., Any],
                     deduplicate: bool = True) -> None:
        """Set ``cls.name = new_fn`` until exit."""
        setattr(new_fn, _PATCHED_FLAG, deduplicate)
        orig = getattr(cls, name)
        if getattr(orig, _PATCHED_FLAG, False):
            return
        setattr(cls, name, new_fn)
        self._undo.append(lambda: setattr(cls, name, orig))

    def patch_value(self, owner: object, name: str, value: Any) -> None:
        """Set attribute ``owner.name = value`` (e.g. a module-level flag) until exit."""
        orig = getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, orig))

    def visit_once(self, thing: object, purpose: str = "") -> bool:
        """True the first time ``thing`` is seen by this patcher for ``purpose``."""
        key = (purpose, id(thing))
        if key in self._visited:
            return False
        self._visited.add(key)
        return True

    def __enter__(self) -> _Patcher:
        return self

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            self._undo.pop()()
        self._visited.clear()


# (id(globals), name) -> globals dict of every ``wrap``-registered function.
_wrapped_fns_to_patch: dict[tuple[int, str], dict[str, Any]] = {}


def _find_proxy(*objects: Any) -> Proxy | None:
    stack = list(objects)
    while stack:
        a = stack.pop()
        if isinstance(a, Proxy):
            return a
        if isinstance(a, (tuple, list)):
            stack.extend(a)
        elif isinstance(a, dict):
            stack.extend(a.values())
        elif isinstance(a, slice):
            stack.extend((a.start, a.stop, a.step))
    return None


# id(orig_fn) -> (orig_fn, wrapper): wrappers hold no tracer state, so one per function is enough.
_WRAPPERS: dict[int, tuple[Callable[..., Any], Callable[..., Any]]] = {}


def _create_wrapped_func(orig_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for ``orig_fn`` that records a ``call_function`` when given a Proxy (cached)."""
    cached = _WRAPPERS.get(id(orig_fn))
    if cached is not None and cached[0] is orig_fn:
        return cached[1]

    @functools.wraps(orig_fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        # Called with a Proxy: record the call as a leaf. Otherwise: just run it.
        proxy = _find_proxy(args, kwargs)
        if proxy is None:
            return orig_fn(*args, **kwargs)
        out = proxy.tracer.create_proxy("call_function", orig_fn, args, kwargs)
        out.node.meta["is_wrapped"] = True
        return out

    _WRAPPERS[id(orig_fn)] = (orig_fn, wrapped)
    return wrapped


def _create_wrapped_method(cls: type, name: str) -> Callable[..., Any]:
    """A stand-in for method ``cls.name`` that records a ``call_method`` when given a Proxy."""
    orig_fn = getattr(cls, name)

    @functools.wraps(orig_fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        proxy = _find_proxy(args, kwargs)
        if proxy is None:
            return orig_fn(*args, **kwargs)
        return proxy.tracer.create_proxy("call_method", name, args, kwargs)

    return wrapped


def _patch_wrapped_functions(
    patcher: _Patcher,
    extra_fns: Iterable[tuple[tuple[int, str], dict[str, Any]]] = (),
    extra_methods: Iterable[tuple[type, str]] = (),
) -> None:
    """Patch every ``wrap``-registered global (ours, plus ``extra_fns`` from torch.fx's registry)
    with a recording stand-in, and every ``(cls, name)`` of ``extra_methods`` likewise.

    Args:
        patcher: records the patches so they are undone when tracing ends.
        extra_fns: more ``((id(globals), name), globals)`` entries, as in torch.fx's
            ``_wrapped_fns_to_patch``; a name registered twice is patched once.
        extra_methods: ``(class, method name)`` pairs, as in torch.fx's ``_wrapped_methods_to_patch``.
    """
    registry = dict(chain(_wrapped_fns_to_patch.items(), extra_fns))  # one entry per (globals, name)
    for (_, name), frame_dict in registry.items():
        if name not in frame_dict and hasattr(builtins, name):
            orig = getattr(builtins, name)
        else:
            orig = frame_dict[name]
        patcher.patch(frame_dict, name, _create_wrapped_func(orig))
    for cls, name in extra_methods:
        patcher.patch_method(cls, name, _create_wrapped_method(cls, name))


def _autowrap_check(patcher: _Patcher, frame_dict: dict[str, Any], function_ids: set[int]) -> None:
    """Patch the autowrapped functions (``math.sqrt``, ...) found in ``frame_dict``, once per dict."""
    if not patcher.visit_once(frame_dict):
        return
    for name, value in list(frame_dict.items()):
        if not name.startswith("_") and callable(value) and id(value) in function_ids:
            patcher.patch(frame_dict, name, _create_wrapped_func(value))


def _patch_recorded_leaves(patcher: _Patcher, frame_dict: dict[str, Any], nodes: Iterable[Any]) -> None:
    """Patch, in the globals of a generated ``forward``, the functions its graph recorded as leaves
    (``call_function`` nodes with ``meta["is_wrapped"]``), builtins such as ``len`` included, so a
    retrace keeps each as one node. torch.fx gets the same by emitting ``wrap("name")`` lines into
    the generated code; fxdist reads the graph instead. Once per globals dict and patcher.

    Source: torch/fx/graph.py (``wrapped_fns`` / ``wrap_stmts`` in ``_gen_python_code``).
    """
    if not patcher.visit_once(frame_dict, "recorded-leaves"):
        return
    targets = {id(n.target): n.target for n in nodes if n.op == "call_function" and n.meta.get("is_wrapped")}
    if not targets:
        return
    names = [name for name, value in frame_dict.items() if id(value) in targets]
    names += [name for name in {getattr(t, "__name__", None) for t in targets.values()} - set(frame_dict)
              if isinstance(name, str) and id(getattr(builtins, name, None)) in targets]
    for name in names:
        orig = frame_dict[name] if name in frame_dict else getattr(builtins, name)
        patcher.patch(frame_dict, name, _create_wrapped_func(orig))


def wrap(fn_or_name: str | Callable[..., Any]) -> Any:
    """Register a global function as a *leaf function*: calls to it on Proxies are recorded as one
    ``call_function`` node instead of being traced through. Call it at module scope, with the
    function or its name (``fxdist.wrap("len")`` also works for builtins), or use it as a decorator.
    The function is registered with torch.fx as well (``fxdist.interop.register_torch_fx_leaf``), so it is a
    leaf for torch.fx's tracers too (``torch.fx.Tracer``, ``RewritingTracer``), as ``torch.fx.wrap`` leaves
    are for fxdist's.

    Raises:
        RuntimeError: ``fn_or_name`` is neither a callable nor a string.
        NotImplementedError: called anywhere but at the top level of a module.

    Source: torch/fx/_symbolic_trace.py ``wrap``.
    """
    if callable(fn_or_name):
        fn_name = fn_or_name.__name__
    elif isinstance(fn_or_name, str):
        fn_name = fn_or_name
    else:
        raise RuntimeError("Unsupported type for global function! Must be either a callable or "
                           f"string name, got {type(fn_or_name).__name__}")
    caller = inspect.currentframe().f_back  # type: ignore[union-attr]
    if caller is None or caller.f_code.co_name != "<module>":
        raise NotImplementedError("wrap must be called at the top level of a module")
    _wrapped_fns_to_patch[(id(caller.f_globals), fn_name)] = caller.f_globals
    from fxdist.interop import register_torch_fx_leaf  # lazy: the one module that imports torch.fx

    register_torch_fx_leaf(caller.f_globals, fn_name)
    return fn_or_name


class ProxyableClassMeta(type):
    """A metaclass that makes constructing its classes traceable: while fxdist traces, a call
    ``Cls(*args, **kwargs)`` with a Proxy among the (nested) arguments is recorded as one
    ``call_function`` node whose target is ``Cls``; otherwise the instance is built as usual.
    An instance met as a constant argument is stored on the root as ``_<Cls>_constant_<i>``.

    Example::

        class TensorPair(metaclass=fxdist.ProxyableClassMeta):
            def __init__(self, left, right):
                self.left, self.right = left, right

        def f(x, y):
            return TensorPair(y, y)   # -> %tensor_pair = call_function[target=TensorPair](args=(%y, %y))

    Classes made with ``torch.fx.ProxyableClassMeta`` (e.g. torchrec's ``KeyedTensor`` and
    ``KeyedJaggedTensor``) behave the same under fxdist's tracer (see ``fxdist.interop``).

    Source: torch/fx/_symbolic_trace.py ``ProxyableClassMeta``.
    """

    def __init__(cls, name: str, bases: tuple[type, ...], attrs: dict[str, Any]) -> None:
        _proxyable_classes.setdefault(cls)
        super().__init__(name, bases, attrs)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        instance = cls.__new__(cls)  # type: ignore[call-overload]
        proxy = _find_proxy(args, kwargs) if _TraceState.active else None
        if proxy is not None:
            return proxy.tracer.create_proxy("call_function", cls, args, kwargs)
        cls.__init__(instance, *args, **kwargs)  # type: ignore[misc]
        return instance


def _recording_constructor(orig_call: Callable[..., Any]) -> Callable[..., Any]:
    """A ``__call__`` for another library's proxyable metaclass: records the construction when an
    fxdist Proxy is among the arguments, and defers to ``orig_call`` otherwise."""

    @functools.wraps(orig_call)
    def __call__(cls: type, *args: Any, **kwargs: Any) -> Any:
        proxy = _find_proxy(args, kwargs)
        if proxy is None:
            return orig_call(cls, *args, **kwargs)
        return proxy.tracer.create_proxy("call_function", cls, args, kwargs)

    return __call__
