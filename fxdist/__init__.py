"""fxdist: an independent implementation of the torch.fx design, plus distributed-training passes.

Public names follow torch.fx, so code written for torch.fx runs with ``import fxdist as fx``.
Names are resolved lazily (PEP 562) so that ``import fxdist`` stays cheap and the IR modules never
import the tracer or the passes.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"
"""The release: the one place it is written (pyproject.toml reads it; ``fxdist --version`` prints it)."""

# public name -> submodule that defines it
_EXPORTS: dict[str, str] = {
    "Node": "node",
    "map_arg": "node",
    "map_aggregate": "node",
    "has_side_effect": "node",
    "is_random_op": "node",  # fxdist-only public helper (torch.fx keeps its random-op table private)
    "Graph": "graph",
    "PythonCode": "codegen",
    "CodeGen": "codegen",
    "GraphModule": "graph_module",
    "Proxy": "proxy",
    "Attribute": "proxy",
    "TracerBase": "proxy",
    "GraphAppendingTracer": "proxy",
    "Tracer": "tracer",
    "symbolic_trace": "tracer",
    "wrap": "tracer",
    "PH": "tracer",
    "PHBase": "tracer",
    "PHWithMeta": "tracer",
    "ProxyableClassMeta": "tracer",
    "TraceError": "errors",
    "Interpreter": "interpreter",
    "Transformer": "interpreter",
    "replace_pattern": "subgraph_rewriter",
    "from_torch_fx": "interop",
    "to_torch_fx": "interop",
    "make_fx": "experimental.proxy_tensor",
    "optimize": "pipeline",
    "register_pass": "pipeline",
}

# Submodules reachable as attributes (``fx.node``, ``fx.passes.shape_prop``...), as they are on
# ``torch.fx`` right after ``import torch.fx``; each is imported on first access. Subpackages list the
# submodules torch.fx has loaded by then, imported with the package.
_SUBMODULES: dict[str, tuple[str, ...]] = {
    "node": (), "graph": (), "codegen": (), "graph_module": (), "proxy": (), "tracer": (), "errors": (),
    "interpreter": (), "subgraph_rewriter": (), "immutable_collections": (), "interop": (), "annotate": (),
    "pipeline": (), "_symbolic_trace": (),
    "passes": ("shape_prop", "reinplace", "graph_drawer", "utils", "utils.matcher_utils"),
    "experimental": ("proxy_tensor",),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f"fxdist.{module}"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"fxdist.{name}")
        for child in _SUBMODULES[name]:
            importlib.import_module(f"fxdist.{name}.{child}")
    else:
        raise AttributeError(f"module 'fxdist' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
