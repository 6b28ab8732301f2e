"""Render an fxdist graph with Graphviz.

Source: torch/fx/passes/graph_drawer.py (same class name, constructor and ``get_*_dot_graph`` methods, so
code written for torch.fx keeps working). Each node becomes a record showing its name, opcode and target,
and, when :class:`fxdist.passes.shape_prop.ShapeProp` has run, the shape and dtype of its value
(``node.meta["tensor_meta"]``). Edges follow the use-def chain (input -> user).

Example::

    >>> import torch, fxdist as fx
    >>> from fxdist.passes.graph_drawer import FxGraphDrawer
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.ReLU()))
    >>> dot = FxGraphDrawer(gm, "mlp").get_dot_graph()   # parameters of call_module nodes get records too
    >>> sorted(n.get_name().strip('"') for n in dot.get_nodes() if n.get_name() not in ("node", "edge"))
    ['_0', '_0_bias', '_0_weight', '_1', 'input_1', 'output']

Rendering (``render``, or pydot's ``create_svg``/``write_png``) needs Graphviz's ``dot`` binary
(Debian: ``apt-get install graphviz``); building the dot source does not.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, cast

import pydot
import torch

from fxdist.graph_module import GraphModule
from fxdist.node import Node

__all__ = ["FxGraphDrawer", "GraphvizNotFoundError"]

_OP_COLORS = {
    "placeholder": "AliceBlue",
    "get_attr": "LemonChiffon1",
    "call_function": "LightSkyBlue",
    "call_method": "PaleGreen",
    "call_module": "Khaki1",
    "output": "LightGrey",
}
_RECORD_ESCAPES = str.maketrans({c: f"\\{c}" for c in '{}<>|"'})


class GraphvizNotFoundError(RuntimeError):
    """Raised when rendering is asked for and Graphviz's ``dot`` binary is not on PATH.

    See docs/troubleshooting.md#graphviznotfounderror.
    """


def _escape(text: str) -> str:
    """Escape the characters that are structural in a Graphviz record label."""
    return text.translate(_RECORD_ESCAPES).replace("\n", "\\n")


def _typename(target: Any) -> str:
    if isinstance(target, torch.nn.Module):
        return torch.typename(target)
    if isinstance(target, str):
        return target
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)


def _tensor_meta_text(meta: Any) -> str:
    """``float32[8, 4]`` for one TensorMetadata; nested tuples/lists/dicts are joined."""
    if meta is None:
        return ""
    if isinstance(meta, dict):
        return ", ".join(f"{k}: {_tensor_meta_text(v)}" for k, v in meta.items())
    if isinstance(meta, (list, tuple)) and not hasattr(meta, "shape"):
        return ", ".join(_tensor_meta_text(m) for m in meta)
    dtype = str(getattr(meta, "dtype", "")).replace("torch.", "")
    shape = list(getattr(meta, "shape", ()))
    return f"{dtype}{shape}"


class FxGraphDrawer:
    """Turns a :class:`fxdist.GraphModule` into ``pydot.Dot`` graphs, one per (sub)graph module.

    Args:
        graph_module: the module whose ``graph`` is drawn.
        name: the name of the main dot graph.
        ignore_getattr: leave ``get_attr`` nodes out.
        ignore_parameters_and_buffers: leave out the parameter/buffer records of ``call_module`` nodes.
        skip_node_names_in_args: print ``%x`` for node arguments instead of the full node.
        dot_graph_shape: Graphviz node shape (default ``"record"``).

    Raises:
        TypeError: if ``graph_module`` is not a GraphModule.
    """

    def __init__(
        self,
        graph_module: GraphModule,
        name: str,
        ignore_getattr: bool = False,
        ignore_parameters_and_buffers: bool = False,
        skip_node_names_in_args: bool = True,
        parse_stack_trace: bool = False,
        dot_graph_shape: str | None = None,
        normalize_args: bool = False,
    ) -> None:
        if not isinstance(graph_module, GraphModule):
            raise TypeError(f"FxGraphDrawer needs an fxdist GraphModule, got {type(graph_module).__name__}")
        self._name = name
        self._shape = dot_graph_shape or "record"
        self._ignore_getattr = ignore_getattr
        self._ignore_params = ignore_parameters_and_buffers
        self._skip_node_names = skip_node_names_in_args
        self._parse_stack_trace = parse_stack_trace
        self._dot_graphs = {name: self._to_dot(graph_module, name)}
        for node in graph_module.graph.nodes:
            if node.op != "call_module":
                continue
            submodule = graph_module.get_submodule(cast(str, node.target))
            if isinstance(submodule, GraphModule):
                self._dot_graphs[f"{name}_{node.target}"] = self._to_dot(submodule, f"{name}_{node.target}")

    def get_dot_graph(self, submod_name: str | None = None) -> pydot.Dot:
        """The main graph, or the graph of the GraphModule submodule ``submod_name``.

        Raises:
            KeyError: if no GraphModule submodule of that name was drawn.
        """
        if submod_name is None:
            return self.get_main_dot_graph()
        return self.get_submod_dot_graph(submod_name)

    def get_main_dot_graph(self) -> pydot.Dot:
        return self._dot_graphs[self._name]

    def get_submod_dot_graph(self, submod_name: str) -> pydot.Dot:
        """The drawing of the GraphModule submodule ``submod_name`` (drawn in its own cluster).

        Raises:
            KeyError: no GraphModule submodule of that name was drawn; the message lists those drawn.
        """
        key = f"{self._name}_{submod_name}"
        if key not in self._dot_graphs:
            raise KeyError(f"no GraphModule submodule {submod_name!r}; drawn: {sorted(self._dot_graphs)}")
        return self._dot_graphs[key]

    def get_all_dot_graphs(self) -> dict[str, pydot.Dot]:
        return dict(self._dot_graphs)

    def render(self, path: str | Path, format: str | None = None) -> Path:
        """Write the main graph to ``path`` as ``format`` (``svg``, ``png``, ``pdf``, ``dot``...).

        The format defaults to the file's suffix. Returns the path written.

        Raises:
            GraphvizNotFoundError: if the format needs Graphviz's ``dot`` binary and it is not installed.
        """
        path = Path(path)
        fmt = (format or path.suffix.lstrip(".") or "svg").lower()
        dot = self.get_main_dot_graph()
        if fmt in ("dot", "gv", "raw"):
            path.write_text(dot.to_string())
            return path
        if shutil.which("dot") is None:
            raise GraphvizNotFoundError(
                f"cannot render {path.name} as {fmt}: Graphviz's `dot` binary is not on PATH. "
                "Install it (Debian: `apt-get install graphviz`), or write the dot source with format='dot'."
            )
        path.write_bytes(dot.create(format=fmt))  # type: ignore[arg-type]  # pydot says str; it returns bytes
        return path

    # -- building -----------------------------------------------------------------------------------
    def _to_dot(self, graph_module: GraphModule, name: str) -> pydot.Dot:
        dot = pydot.Dot(name, rankdir="TB")
        for node in graph_module.graph.nodes:
            if self._ignore_getattr and node.op == "get_attr":
                continue
            dot.add_node(self._dot_node(graph_module, node))
            if node.op == "call_module" and not self._ignore_params:
                self._add_module_state(dot, graph_module, node)
        drawn = {n.get_name().strip('"') for n in dot.get_nodes()}
        for node in graph_module.graph.nodes:
            for user in node.users:
                if node.name in drawn and user.name in drawn:
                    dot.add_edge(pydot.Edge(node.name, user.name))
        return dot

    def _dot_node(self, graph_module: GraphModule, node: Node) -> pydot.Node:
        return pydot.Node(
            node.name,
            label=self._label(graph_module, node),
            shape=self._shape,
            style='"filled,rounded"',
            fillcolor=_OP_COLORS.get(node.op, "white"),
            fontcolor="black",
        )

    def _label(self, graph_module: GraphModule, node: Node) -> str:
        rows = [f"name=%{node.name}", f"op_code={node.op}"]
        if node.op == "call_module":
            rows.append(f"target={_typename(graph_module.get_submodule(cast(str, node.target)))}")
        else:
            rows.append(f"target={_typename(node.target)}")
        if node.args:
            rows.append(f"args={self._format_args(node.args)}")
        if node.kwargs:
            rows.append(f"kwargs={self._format_args(node.kwargs)}")
        meta_text = _tensor_meta_text(node.meta.get("tensor_meta"))
        if meta_text:
            rows.append(f"tensor_meta={meta_text}")
        if self._parse_stack_trace and node.stack_trace:
            last = node.stack_trace.strip().splitlines()
            rows.append(f"stack={last[-2].strip() if len(last) > 1 else last[-1].strip()}")
        body = "|".join(_escape(row) for row in rows)
        return f'"{{{body}}}"' if self._shape == "record" else f'"{body}"'

    def _format_args(self, value: Any) -> str:
        if isinstance(value, Node):
            # format_node() returns None only when given placeholder_names
            return f"%{value.name}" if self._skip_node_names else cast(str, value.format_node())
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k}: {self._format_args(v)}" for k, v in value.items()) + "}"
        if isinstance(value, (list, tuple)):
            inner = ", ".join(self._format_args(v) for v in value)
            return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
        return repr(value)

    def _add_module_state(self, dot: pydot.Dot, graph_module: GraphModule, node: Node) -> None:
        module = graph_module.get_submodule(cast(str, node.target))
        tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        for pname, tensor in tensors:
            kind = "parameter" if isinstance(tensor, torch.nn.Parameter) else "buffer"
            dtype = str(tensor.dtype).replace("torch.", "")
            record = f"{node.name}_{pname}"
            label = "|".join(_escape(r) for r in (f"name={node.target}.{pname}", kind, f"{dtype}{list(tensor.shape)}"))
            dot.add_node(pydot.Node(record, label=f'"{{{label}}}"', shape="record", style='"filled,rounded"',
                                    fillcolor="Salmon"))
            dot.add_edge(pydot.Edge(record, node.name))
