"""Monkey patching for the tracer: leaf functions (``wrap``, autowrap) and reversible patches.

``_Patcher`` records every change (a global name, a class attribute such as ``nn.Module.__call__``)
and undoes all of them, in reverse order, when its ``with`` block exits, also when tracing raised.
``wrap("name")`` at module scope registers a global function whose calls on Proxies are recorded as one
``call_function`` node instead of being traced through.

Source: torch/fx/_symbolic_trace.py (``_Patcher``, ``wrap``, ``_autowrap_check``).
"""

from __future__ import annotations

import builtins
import functools
import inspect
from collections.abc import Callable
from typing import Any

from fxdist.proxy import Proxy

__all__ = ["wrap"]


class _Patcher:
    """Records monkey patches (dict items and class attributes) and reverts them on exit."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self._visited: set[int] = set()

    def patch(self, frame_dict: dict[str, Any], name: str, new_fn: Callable[..., Any],
              deduplicate: bool = True) -> None:
        """Set ``frame_dict[name] = new_fn`` (a global or builtin name) until exit."""
        new_fn.__fx_already_patched = deduplicate  # type: ignore[attr-defined]
        if name not in frame_dict and hasattr(builtins, name):
            frame_dict[name] = new_fn
            self._undo.append(lambda: frame_dict.pop(name, None))
        elif getattr(frame_dict[name], "__fx_already_patched", False):
            return
        else:
            orig = frame_dict[name]
            frame_dict[name] = new_fn
            self._undo.append(lambda: frame_dict.__setitem__(name, orig))

    def patch_method(self, cls: type, name: str, new_fn: Callable[..., Any],
                     deduplicate: bool = True) -> None:
        """Set ``cls.name = new_fn`` until exit."""
        new_fn.__fx_already_patched = deduplicate  # type: ignore[attr-defined]
        orig = getattr(cls, name)
        if getattr(orig, "__fx_already_patched", False):
            return
        setattr(cls, name, new_fn)
        self._undo.append(lambda: setattr(cls, name, orig))

    def visit_once(self, thing: object) -> bool:
        """True the first time ``thing`` is seen by this patcher."""
        if id(thing) in self._visited:
            return False
        self._visited.add(id(thing))
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


def _patch_wrapped_functions(patcher: _Patcher) -> None:
    for (_, name), frame_dict in list(_wrapped_fns_to_patch.items()):
        if name not in frame_dict and hasattr(builtins, name):
            orig = getattr(builtins, name)
        else:
            orig = frame_dict[name]
        patcher.patch(frame_dict, name, _create_wrapped_func(orig))


def _autowrap_check(patcher: _Patcher, frame_dict: dict[str, Any], function_ids: set[int]) -> None:
    """Patch the autowrapped functions (``math.sqrt``, ...) found in ``frame_dict``, once per dict."""
    if not patcher.visit_once(frame_dict):
        return
    for name, value in list(frame_dict.items()):
        if not name.startswith("_") and callable(value) and id(value) in function_ids:
            patcher.patch(frame_dict, name, _create_wrapped_func(value))


def wrap(fn_or_name: str | Callable[..., Any]) -> Any:
    """Register a global function as a *leaf function*: calls to it on Proxies are recorded as one
    ``call_function`` node instead of being traced through. Call it at module scope, with the
    function or its name (``fxdist.wrap("len")`` also works for builtins), or use it as a decorator.

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
    return fn_or_name
