"""The names code written for ``torch.fx._symbolic_trace`` imports, under the same module name:
``from fxdist._symbolic_trace import PH, PHBase, PHWithMeta, Tracer, symbolic_trace, wrap``.

``_wrapped_methods_to_patch`` lists ``(class, method name)`` pairs that every trace patches so that a call
with a Proxy among its arguments is recorded as one ``call_method`` node (e.g. ``(torch.Tensor,
"__getitem__")``: a real tensor indexed by a Proxy). fxdist's tracer reads this list and torch.fx's own
(``torch.fx._symbolic_trace._wrapped_methods_to_patch``) on every trace, so appending to either, or
replacing either module attribute, takes effect on the next trace. With the environment variable
``FX_PATCH_GETITEM=1`` it starts with ``(torch.Tensor, "__getitem__")``, as torch.fx's does.

Source: torch/fx/_symbolic_trace.py (``_wrapped_methods_to_patch``, ``FX_PATCH_GETITEM``, ``PHBase``,
``PHWithMeta``).
"""

from __future__ import annotations

import os

import torch

from fxdist._patching import wrap
from fxdist.tracer import PH, PHBase, PHWithMeta, Tracer, is_fx_tracing, symbolic_trace

__all__ = ["PH", "PHBase", "PHWithMeta", "Tracer", "symbolic_trace", "wrap", "is_fx_tracing"]

_wrapped_methods_to_patch: list[tuple[type, str]] = []
if os.environ.get("FX_PATCH_GETITEM") == "1":
    _wrapped_methods_to_patch.append((torch.Tensor, "__getitem__"))
