"""``annotate(value, type)``: give the node behind a Proxy a type while tracing.

A traced function can't annotate intermediate values with Python syntax (``y: int = x.size(0)`` leaves no
trace), so ``annotate`` stamps ``Node.type``, which the printed graph shows and the generated code emits
(``size : int = x.size(0)``)::

    from fxdist.annotate import annotate

    def f(x):
        n = annotate(x.size(0), int)
        return x.view(n, -1)

Source: torch/fx/annotate.py ``annotate``.
"""

from __future__ import annotations

from typing import Any

from fxdist.graph_module import _is_torch_fx
from fxdist.proxy import Proxy

__all__ = ["annotate"]


def annotate(val: Any, type: Any) -> Any:  # noqa: A002 - torch.fx's parameter name
    """Set ``val.node.type = type`` if ``val`` is a Proxy (fxdist's, or torch.fx's while a torch.fx tracer
    runs); any other value is returned untouched.

    Args:
        val: the value to annotate, normally a Proxy during tracing.
        type: the type to record (any object usable as an annotation).

    Returns:
        ``val`` itself.

    Raises:
        RuntimeError: the node already has a type (a placeholder typed by the signature, or ``annotate``
            called twice on the same value), as in torch.fx.
    """
    if not (isinstance(val, Proxy) or (_is_torch_fx(val) and val.__class__.__name__.endswith("Proxy"))):
        return val
    existing = val.node.type
    if existing:
        raise RuntimeError(
            f"Tried to annotate a value that already had a type on it! Existing type is {existing} and new "
            f"type is {type}. This could happen if you tried to annotate a function parameter value (in which "
            "case you should use the type slot on the function signature) or you called annotate on the same "
            f"value twice (node {val.node.name!r})")
    val.node.type = type
    return val
