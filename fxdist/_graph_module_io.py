"""GraphModule I/O: the picklable form of its graph, and ``GraphModule.to_folder``.

Pickle and ``deepcopy`` keep the graph as a flat node list (``graph_to_spec``/``graph_from_spec``),
not the generated text, so graphs that cannot be re-traced round-trip too. ``torch.ops`` operators
(ATen, custom ops, higher-order ops) do not pickle; the spec names them by their ``torch.ops`` path.

``to_folder`` writes a GraphModule as an importable Python package.
Source: torch/fx/graph_module.py ``GraphModule.to_folder``. Differences: every child module is saved
as its own ``.pt`` file (torch.fx prints ``repr`` for a few module types, which loses dtypes and
breaks for string options such as ``padding_mode``); file paths are computed relative to
``module.py`` (the folder can be moved); every name written into the source is ``repr``-escaped or a
verified identifier; objects the code uses that cannot be imported by name go to ``globals.pt``;
non-persistent buffers keep their values (``buffers.pt``); the generated ``_load`` reads each ``.pt`` file with
``torch.load(weights_only=True)``, allowing only the types ``to_folder`` found in the files it wrote (listed in
``_SAFE_GLOBALS``, read back with ``torch.serialization.get_unsafe_globals_in_checkpoint``), so a swapped file cannot
run code on import (PyTorch SECURITY.md; ``torch.serialization.safe_globals``).
"""

from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from fxdist._namespace import sanitize
from fxdist._pysource import (
    FIXED_GLOBALS,
    importable_path,
    is_plain_ident,
    resolve_torch_path,
    torch_path,
    torch_path_of_singleton,
)
from fxdist.node import Node

if TYPE_CHECKING:
    from fxdist.codegen import PythonCode
    from fxdist.graph import Graph
    from fxdist.graph_module import GraphModule

__all__ = ["graph_from_spec", "graph_to_spec", "pickled_meta", "write_folder"]


# -- graph <-> picklable node list -------------------------------------------------------------------
@dataclass(frozen=True)
class _NodeRef:
    """Stands for the node at ``index`` in a serialized node list."""

    index: int


def _map_nodes(a: Any, fn: Callable[[Any], Any], kind: type | tuple[type, ...]) -> Any:
    """Rebuild the plain containers of an argument with ``fn`` applied to every ``kind`` leaf."""
    if isinstance(a, kind):
        return fn(a)
    if isinstance(a, tuple):
        items = [_map_nodes(x, fn, kind) for x in a]
        return type(a)(*items) if hasattr(type(a), "_fields") else tuple(items)
    if isinstance(a, list):
        return [_map_nodes(x, fn, kind) for x in a]
    if isinstance(a, dict):
        return {k: _map_nodes(v, fn, kind) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(_map_nodes(a.start, fn, kind), _map_nodes(a.stop, fn, kind), _map_nodes(a.step, fn, kind))
    return a


@dataclass(frozen=True)
class _TorchOpRef:
    """Stands for a ``torch.ops`` operator (``torch.ops.aten.add.Tensor``, a custom op, a higher-order
    op): these objects do not pickle, so the spec keeps their verified dotted path and the loading
    process looks it up again (a custom op's library must be loaded there, as for torch.fx)."""

    path: str

    def resolve(self) -> Any:
        try:
            return resolve_torch_path(self.path)
        except (AttributeError, LookupError, RuntimeError) as e:
            raise RuntimeError(f"unpickling a GraphModule: operator {self.path} does not exist in this process; "
                               "load the library that defines it (torch.library / torch.ops.load_library) "
                               "before unpickling") from e


_OPERATORS = (torch._ops.OperatorBase, torch._ops.OpOverloadPacket)


def _encode_leaf(index: dict[Node, int]) -> Callable[[Any], Any]:
    def encode(a: Any) -> Any:
        if isinstance(a, Node):
            return _NodeRef(index[a])
        path = torch_path(a)
        return a if path is None else _TorchOpRef(path)

    return encode


def graph_to_spec(graph: Graph, meta: Callable[[Node], dict[str, Any]]) -> dict[str, Any]:
    """The graph as a list of ``(op, target, args, kwargs, name, type, meta)`` with node references
    replaced by ``_NodeRef`` (flat, so pickling a 10k-node graph does not recurse 10k deep) and
    ``torch.ops`` operators by ``_TorchOpRef``."""
    index: dict[Node, int] = {}
    encode = _encode_leaf(index)
    kinds = (Node, *_OPERATORS)
    nodes = []
    for i, n in enumerate(graph.nodes):
        target = encode(n.target) if isinstance(n.target, _OPERATORS) else n.target
        nodes.append((n.op, target, _map_nodes(n.args, encode, kinds), _map_nodes(n.kwargs, encode, kinds),
                      n.name, n.type, meta(n)))
        index[n] = i
    codegen = graph._codegen
    return {"graph_cls": type(graph), "nodes": nodes, "codegen": codegen,
            "tracer_cls": getattr(graph, "_tracer_cls", None)}


def graph_from_spec(spec: dict[str, Any]) -> Graph:
    graph = spec["graph_cls"]()
    graph._codegen = spec["codegen"]
    if spec.get("tracer_cls") is not None:
        graph._tracer_cls = spec["tracer_cls"]
    made: list[Node] = []

    def decode(r: Any) -> Any:
        return made[r.index] if isinstance(r, _NodeRef) else r.resolve()

    kinds = (_NodeRef, _TorchOpRef)
    for op, target, args, kwargs, name, type_expr, meta in spec["nodes"]:
        if isinstance(target, _TorchOpRef):
            target = target.resolve()
        node = graph.create_node(op, target, _map_nodes(args, decode, kinds), _map_nodes(kwargs, decode, kinds),
                                 name=name, type_expr=type_expr)
        node.meta.update(meta)
        made.append(node)
    return graph


def pickled_meta(node: Node) -> dict[str, Any]:
    """What of ``node.meta`` survives pickling: the stack trace, as in torch.fx."""
    trace = node.meta.get("stack_trace")
    return {} if trace is None else {"stack_trace": trace}


_HEADER = '''\
# Generated by fxdist GraphModule.to_folder; import this package and instantiate {module_name}().
import importlib
import operator
import os
import pickle
from math import inf, nan

import torch
import torch.utils._pytree as pytree
from torch import device

NoneType = type(None)
_HERE = os.path.dirname(os.path.abspath(__file__))
'''

_LOADER = '''
_SAFE_GLOBALS = [{safe}]
"""What this folder's .pt files hold besides tensors and plain containers: allowed for torch.load(weights_only=True)."""


def _load(name):
    # weights_only: a .pt file is a pickle, and a full unpickle runs whatever it names (PyTorch SECURITY.md)
    path = os.path.join(_HERE, name)
    try:
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        said = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line), str(e).strip())
        raise pickle.UnpicklingError(f"{{path}}: not loaded: it holds a type this folder's module.py does not list "
                                     f"in _SAFE_GLOBALS (torch: {{said}})") from None

'''


def _import_lines(globals_: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """Import statements for importable globals, and the rest (to be pickled)."""
    lines: list[str] = []
    pickled: dict[str, Any] = {}
    for name, obj in sorted(globals_.items()):
        if name in FIXED_GLOBALS and FIXED_GLOBALS[name] is obj:
            continue
        path = importable_path(obj)
        if path is None or not is_plain_ident(name):
            pickled[name] = obj
        elif "." in path[1]:
            lines.append(f"{name} = importlib.import_module({path[0]!r}).{path[1]}")
        else:
            lines.append(f"from {path[0]} import {path[1]} as {name}")
    return lines, pickled


def _safe_globals_text(folder: Path) -> str:
    """The generated ``_SAFE_GLOBALS`` items: every global the folder's ``.pt`` files name beyond torch's weights-only
    defaults (``torch.serialization.get_unsafe_globals_in_checkpoint``, which reads the pickles and runs nothing),
    each spelled by its import path. They were just pickled from live objects, so their modules are loaded.

    Raises:
        ValueError: a global that has no import path (see :func:`write_folder`).
    """
    texts: dict[str, str] = {}
    for pt in sorted(folder.glob("*.pt")):
        for name in torch.serialization.get_unsafe_globals_in_checkpoint(str(pt)):
            path = _loaded_path(name)
            if path is None:
                raise ValueError(f"to_folder: {pt.name} holds {name}, which has no import path, so the generated "
                                 "module could not allow it for torch.load(weights_only=True)")
            texts[name] = f"importlib.import_module({path[0]!r}).{path[1]}"
    return "".join(f"\n    {texts[n]}," for n in sorted(texts)) + ("\n" if texts else "")


def _loaded_path(name: str) -> tuple[str, str] | None:
    """``(module, qualname)`` of the pickled global ``name`` (``"pkg.mod.Class"``, ``"pkg.mod.Outer.Inner"``): the
    longest prefix that is a loaded module (nothing is imported), then attributes; None if that finds nothing."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is None:
            continue
        obj: Any = module
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        return importable_path(obj) if obj is not None else None
    return None


def _dtype_text(t: torch.Tensor) -> str:
    text = torch_path_of_singleton(t.dtype)
    if text is None:
        raise ValueError(f"to_folder: cannot spell dtype {t.dtype!r}")
    return text


def _init_lines(gm: GraphModule, folder: Path) -> list[str]:
    """Body of the generated ``__init__``: children, then top-level parameters and buffers."""
    lines = ["super().__init__()"]
    for i, (name, child) in enumerate(gm.named_children()):
        filename = f"{i:03d}_{sanitize(name)}.pt"
        torch.save(child, folder / filename)
        shown = " ".join(repr(child).split())[:200]
        lines.append(f"self.add_module({name!r}, _load({filename!r}))  # {shown}")
    extra: dict[str, torch.Tensor] = {}
    for name, buf in gm._buffers.items():
        if buf is None:
            continue
        persistent = name not in gm._non_persistent_buffers_set
        if not persistent:
            extra[name] = buf
        lines.append(f"self.register_buffer({name!r}, torch.empty({list(buf.shape)!r}, dtype={_dtype_text(buf)}), "
                     f"persistent={persistent!r})")
    for name, param in gm._parameters.items():
        if param is None:
            continue
        lines.append(f"self.register_parameter({name!r}, torch.nn.Parameter(torch.empty({list(param.shape)!r}, "
                     f"dtype={_dtype_text(param)}), requires_grad={param.requires_grad!r}))")
    lines.append("self.load_state_dict(_load('state_dict.pt'))")
    if extra:
        torch.save(extra, folder / "buffers.pt")
        lines.append("for _name, _value in _load('buffers.pt').items():")
        lines.append("    getattr(self, _name).copy_(_value)")
    return lines


def write_folder(gm: GraphModule, folder: Path, module_name: str, code: PythonCode) -> None:
    """Write ``gm`` to ``folder`` as a package exporting class ``module_name`` (see the module doc).

    Raises:
        ValueError: ``module_name`` is not an identifier, or a ``.pt`` file holds an object whose type cannot be
            named by an import path (e.g. one defined in ``__main__``), which ``_load`` could not allow.
    """
    if not is_plain_ident(module_name):
        raise ValueError(f"to_folder: module_name must be a Python identifier, got {module_name!r}")
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(gm.state_dict(), folder / "state_dict.pt")
    imports, pickled = _import_lines(code.globals)
    if pickled:
        torch.save(pickled, folder / "globals.pt")
    init = textwrap.indent("\n".join(_init_lines(gm, folder)), " " * 8)
    parts = [_HEADER.format(module_name=module_name), *imports, _LOADER.format(safe=_safe_globals_text(folder))]
    if pickled:
        parts.append("globals().update(_load('globals.pt'))")
    parts.append(f"\n\nclass {module_name}(torch.nn.Module):\n    def __init__(self):\n{init}\n")
    parts.append(textwrap.indent(code.src.strip("\n"), " " * 4).rstrip() + "\n")
    (folder / "module.py").write_text("\n".join(parts))
    (folder / "__init__.py").write_text(f"from .module import {module_name}\n\n__all__ = [{module_name!r}]\n")
