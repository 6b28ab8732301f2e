"""Exception types of the tracer and helpers that point an error at the user's own source line.

``TraceError`` keeps torch.fx's type (a ``ValueError``) so ``except`` clauses written for torch.fx still
work. ``ProxyUsageError`` is a ``TraceError`` that is also a ``RuntimeError``: torch.fx raises a plain
``RuntimeError`` for ``len(proxy)`` and for a Proxy inside a dict key, so code catching either type keeps
working. ``ProxyIterationError`` (iterating a Proxy) is also a ``TypeError``, what ``iter()`` raises for
objects that cannot be iterated.

The user-frame helpers find the first stack frame outside fxdist (and outside torch's own Python files)
and describe it as ``path/to/model.py:87 in forward: `if dense.sum() > 0:```. Passes use
:func:`location_of_stack_trace` to say the same about a node from its ``meta["stack_trace"]``.

Source: torch/fx/proxy.py (``TraceError``, ``TracerBase._find_user_frame``). Errors name
the user's frame, never fxdist internals; context goes into ``add_note``.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
from types import FrameType

import torch

__all__ = [
    "TraceError",
    "ProxyUsageError",
    "ProxyIterationError",
    "is_internal_file",
    "user_frame",
    "describe_location",
    "describe_frame",
    "location_of_stack_trace",
    "add_user_note",
]


class TraceError(ValueError):
    """Raised when symbolic tracing meets something it cannot record (dynamic control flow, iteration
    over a Proxy, ...). Same type as ``torch.fx.proxy.TraceError``'s base so handlers keep working.

    See docs/troubleshooting.md#traceerror.
    """


class ProxyUsageError(TraceError, RuntimeError):
    """A ``TraceError`` that is also a ``RuntimeError``, for the misuses torch.fx reports as
    ``RuntimeError`` (``len(proxy)``, a Proxy inside a dict key, Proxies from two tracers).

    See docs/troubleshooting.md#proxyusageerror.
    """


class ProxyIterationError(TraceError, TypeError):
    """Iterating a Proxy: a ``TraceError`` that is also a ``TypeError``, so library code probing
    ``try: iter(x) except TypeError:`` treats a Proxy as not iterable instead of failing the trace.

    See docs/troubleshooting.md#proxyiterationerror.
    """


_FXDIST_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_SITE_PACKAGES = re.compile(r".*[/\\](?:site|dist)-packages[/\\]")


def is_internal_file(filename: str, *, include_torch: bool = True) -> bool:
    """True for files of fxdist itself (and, unless ``include_torch=False``, of torch)."""
    if filename.startswith(_FXDIST_DIR):
        return True
    return include_torch and filename.startswith(_TORCH_DIR)


def user_frame(frame: FrameType | None = None) -> FrameType | None:
    """Return the innermost frame at or above ``frame`` whose code lives outside fxdist and torch.

    Falls back to the innermost frame outside fxdist when every caller is torch code, and to None
    when there is no such frame at all.

    Args:
        frame: where to start looking; defaults to the caller of this function.
    """
    start = frame if frame is not None else sys._getframe(1)
    fallback = None
    f: FrameType | None = start
    while f is not None:
        filename = f.f_code.co_filename
        if not filename.startswith(_FXDIST_DIR):
            if not filename.startswith(_TORCH_DIR):
                return f
            if fallback is None:
                fallback = f
        f = f.f_back
    return fallback


def _display_path(filename: str) -> str:
    """Shorten a path for messages: relative to the working directory when below it, and
    starting at the package for installed libraries (``torchrec/models/dlrm.py``)."""
    match = _SITE_PACKAGES.match(filename)
    if match is not None:
        return filename[match.end():]
    try:
        rel = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        return filename
    return filename if rel.startswith("..") else rel


def describe_location(filename: str, lineno: int, function: str, source: str | None = None) -> str:
    """Format a source position as ``path.py:87 in forward: `if x.sum() > 0:```.

    Args:
        filename: the file (absolute or relative).
        lineno: 1-based line number.
        function: name of the function executing there.
        source: the source line; looked up with ``linecache`` when None.
    """
    if source is None:
        source = linecache.getline(filename, lineno)
    source = source.strip()
    where = f"{_display_path(filename)}:{lineno} in {function}"
    return f"{where}: `{source}`" if source else where


def describe_frame(frame: FrameType) -> str:
    """:func:`describe_location` for a live frame."""
    code = frame.f_code
    return describe_location(code.co_filename, frame.f_lineno, code.co_name)


_STACK_LINE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>[^\n]+)\n(?P<src>[^\n]*)')


def location_of_stack_trace(stack_trace: str | None) -> str | None:
    """Describe the innermost frame of a node's ``meta["stack_trace"]`` (torch.fx format:
    ``File "m.py", line 5, in forward\\n    return x + 1`` per frame, outermost first).

    Returns:
        ``"m.py:5 in forward: `return x + 1`"``, or None when the text holds no frame.
    """
    if not stack_trace:
        return None
    frames = list(_STACK_LINE.finditer(stack_trace))
    if not frames:
        return None
    last = frames[-1]
    return describe_location(last["file"], int(last["line"]), last["fn"].strip(), last["src"])


def add_user_note(exc: BaseException, frame: FrameType | None, hint: str = "") -> BaseException:
    """Attach ``at <user location>[; hint]`` to ``exc`` as a PEP 678 note, once.

    Args:
        exc: the exception being raised; its ``args`` are left untouched.
        frame: where to start looking for the user's frame (see :func:`user_frame`).
        hint: what the user can do about it, appended after ``; ``.

    Returns:
        ``exc``, so callers can write ``raise add_user_note(e, frame)``.
    """
    if getattr(exc, "_fxdist_located", False):
        return exc
    found = user_frame(frame) if frame is not None else None
    if found is not None:
        note = f"at {describe_frame(found)}"
        exc.add_note(f"{note}; {hint}" if hint else note)
        exc._fxdist_located = True  # type: ignore[attr-defined]
    return exc
