"""Run the same call with torch.fx and fxdist and compare the outcome: graph, or exception class and message.

"Same exception class" allows for the library namespace: torch.fx's own classes (``torch.fx.proxy.TraceError``)
match fxdist's class of the same name with the same base (``fxdist.TraceError``, a ``ValueError``);
any other class must be a base of fxdist's (fxdist may raise a subclass, e.g. ``ProxyUsageError`` for
torch.fx's ``RuntimeError``), so ``except`` clauses written for torch.fx still catch it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", call()
    except Exception as e:  # noqa: BLE001 - the exception is the result being compared
        return "raised", e


def same_exception_class(ours: BaseException, theirs: BaseException) -> bool:
    kind = type(theirs)
    if kind.__module__.startswith("torch.fx"):
        return type(ours).__name__ == kind.__name__ and isinstance(ours, kind.__mro__[1])
    return isinstance(ours, kind)


def message_head(e: BaseException, library: str) -> str:
    """The first line of the message, with the library's own name (``torch.fx.wrap``) made neutral."""
    lines = str(e).splitlines()
    return (lines[0] if lines else "").replace(library, "<fx>")


def assert_same_error(ours: BaseException, theirs: BaseException, head_chars: int = 40) -> None:
    assert same_exception_class(ours, theirs), f"fxdist raised {type(ours)!r}, torch.fx {type(theirs)!r}"
    a, b = message_head(ours, "fxdist"), message_head(theirs, "torch.fx")
    assert a[:head_chars] == b[:head_chars], f"fxdist: {a!r}\ntorch.fx: {b!r}"
