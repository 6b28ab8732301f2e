"""Stack traces of traced nodes: the user's frames only, in torch.fx's ``node.stack_trace`` format.

``user_frames(frame, cache)`` walks from the frame creating a node up to the tracer's call of the traced
root, keeping frames outside fxdist and torch; ``format_stack`` turns them into
``File "m.py", line 5, in forward\n    return x + 1`` lines (outermost first), cached per stack.

Source: torch/fx/proxy.py ``TracerBase.create_node`` / ``_filter_traceback_frames``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from fxdist.errors import is_internal_file

__all__ = ["register_stack_trace_root", "user_frames", "format_stack"]


# ids of the code objects through which a tracer calls the traced root (module-level functions in
# fxdist, alive for good); the walk stops there.
_STACK_TRACE_ROOTS: set[int] = set()
# id(code) -> code of every user frame seen: keyed by id because hashing a code object hashes its
# bytecode; keeping the code alive here means an id is never reused while it is cached.
_CODES: dict[int, CodeType] = {}
_FORMATTED: dict[tuple[tuple[int, int], ...], str] = {}
_INTERNAL_FILES: dict[str, bool] = {}


def register_stack_trace_root(fn: Callable[..., Any]) -> None:
    """Mark ``fn`` (a function in fxdist that calls the traced root) as the outermost frame of
    stack traces."""
    _STACK_TRACE_ROOTS.add(id(fn.__code__))
    _CODES[id(fn.__code__)] = fn.__code__


_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def _is_internal(filename: str) -> bool:
    is_internal = _INTERNAL_FILES[filename] = is_internal_file(filename)
    return is_internal


def user_frames(frame: FrameType | None, cache: dict[int, Any] | None = None,
                 ) -> tuple[tuple[int, int], ...]:
    """(id(code), line) of the frames outside fxdist and torch between ``frame`` and the trace root,
    outermost first. Without a registered root, keep frames from the outermost ``forward`` on.

    ``cache`` (valid during one trace) maps id(user frame) -> (frame, frames above it, root seen):
    while a user frame runs, the frames above it are suspended at fixed lines, so that part of the
    stack is walked once per user-frame activation instead of once per node.
    """
    internal, roots = _INTERNAL_FILES, _STACK_TRACE_ROOTS
    while frame is not None:
        code = frame.f_code
        is_internal = internal.get(code.co_filename)
        if not (is_internal or (is_internal is None and _is_internal(code.co_filename))):
            break
        if id(code) in roots:
            return ()
        frame = frame.f_back
    if frame is None:
        return ()
    if cache is not None and frame.f_code.co_flags & _RESUMABLE:
        cache = None  # a generator's callers may change between resumptions
    entry = cache.get(id(frame)) if cache is not None else None
    if entry is None:
        entry = (frame, *_outer_frames(frame.f_back))
        if cache is not None:
            cache[id(frame)] = entry
    _, outer, reached_root = entry
    code = frame.f_code
    _CODES.setdefault(id(code), code)
    found = (*outer, (id(code), frame.f_lineno))
    if reached_root:
        return found
    forwards = [i for i, (key, _) in enumerate(found) if _CODES[key].co_name == "forward"]
    return found[forwards[0]:] if forwards else ()


def _outer_frames(frame: FrameType | None) -> tuple[tuple[tuple[int, int], ...], bool]:
    """The user frames from ``frame`` up to the trace root (outermost first), and whether the root
    was reached."""
    found: list[tuple[int, int]] = []
    reached_root = False
    internal, roots = _INTERNAL_FILES, _STACK_TRACE_ROOTS
    while frame is not None:
        code = frame.f_code
        is_internal = internal.get(code.co_filename)
        if is_internal or (is_internal is None and _is_internal(code.co_filename)):
            if id(code) in roots:
                reached_root = True
                break
        else:
            _CODES.setdefault(id(code), code)
            found.append((id(code), frame.f_lineno))
        frame = frame.f_back
    found.reverse()
    return tuple(found), reached_root


def format_stack(frames: tuple[tuple[int, int], ...]) -> str:
    text = _FORMATTED.get(frames)
    if text is None:
        import linecache

        parts = []
        for key, lineno in frames:
            code = _CODES[key]
            parts.append(f'  File "{code.co_filename}", line {lineno}, in {code.co_name}\n')
            line = linecache.getline(code.co_filename, lineno).strip()
            if line:
                parts.append(f"    {line}\n")
        text = _FORMATTED[frames] = "".join(parts).strip()
    return text
