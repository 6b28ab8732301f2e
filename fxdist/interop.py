"""Conversion between fxdist and torch.fx GraphModules (``from_torch_fx``, ``to_torch_fx``), and
``enter_torch_fx_trace``: what fxdist's tracer takes over from torch.fx's registries (``torch.fx.wrap``
leaves, ``ProxyableClassMeta`` classes, the ``is_fx_tracing()`` flag) so libraries written for torch.fx
trace the same with fxdist.

The only module under ``fxdist/`` that imports ``torch.fx`` (docs/CONTRACTS.md). Both directions copy
the node list one node at a time, keeping opcode, target, the structure of args/kwargs, node name,
type annotation and a shallow copy of ``meta``; the new GraphModule *shares* the submodules,
parameters and buffers of the old one (no tensor is copied), so a model can go to torch.compile or
torch.ao and come back.

The doors: fxdist's ``GraphModule(root, graph)``, ``Interpreter``/``Transformer``, ``ShapeProp``,
``reinplace`` and ``replace_pattern`` accept torch-built graphs (``make_fx``, ``torch.export``'s
``graph_module``, torch.fx tracers such as ``RewritingTracer``) directly: they recognise a torch.fx
object by its classes' module names (``graph_module._is_torch_fx``, no torch.fx import) and call
:func:`as_fxdist` lazily, whose nodes share the torch.fx nodes' ``meta`` dicts; the in-place passes
rewrite an fxdist copy and hand the torch.fx module the result with :func:`write_back`. ShapeProp's
bookkeeping of unbacked symbols (``rebind_unbacked``) lives here too (:func:`run_with_unbacked_bindings`).

Code generators: torch.fx's plain ``CodeGen`` and its ``_PyTreeCodeGen`` (``concrete_args``/pytree inputs,
``ExportedProgram.module()``) are converted, the latter into fxdist's ``PyTreeCodeGen`` with the same
argument names and specs, so the module keeps its calling convention; any other (``_BoxedCodeGen``) is
refused with a ValueError, because fxdist would generate a different ``forward`` signature. A node name that one side reserves and the other
does not is renamed by the receiving graph's namespace (e.g. torch.fx allows ``operator``).
"""

from __future__ import annotations

import copy
import sys
from typing import Any, Callable, NamedTuple

import torch.fx
from torch import nn

from fxdist._graph_module_io import _map_nodes
from fxdist._patching import _Patcher, _recording_constructor
from fxdist._pytree_codegen import PyTreeCodeGen
from fxdist.graph import Graph
from fxdist.graph_module import GraphModule, _is_torch_fx
from fxdist.node import Node

__all__ = ["from_torch_fx", "graph_from_torch_fx", "to_torch_fx", "as_fxdist", "write_back", "is_torch_fx",
           "run_with_unbacked_bindings", "enter_torch_fx_trace", "register_torch_fx_leaf"]


def _copy_nodes(src_nodes: Any, dst_graph: Any, src_kind: type, share_meta: bool = False) -> dict[Any, Any]:
    """Append a copy of every node of ``src_nodes`` to ``dst_graph`` (either library's Graph).

    Returns the map from each source node to its copy. With ``share_meta`` the copy uses the source
    node's very ``meta`` dict (what a pass records on one is seen on the other)."""
    env: dict[Any, Any] = {}

    def lookup(n: Any) -> Any:
        try:
            return env[n]
        except KeyError:
            raise RuntimeError(f"node {n.name!r} is used before it is defined (or belongs to another graph); "
                               "run graph.lint() on the source graph") from None

    for node in src_nodes:
        new = dst_graph.create_node(node.op, node.target, _map_nodes(node.args, lookup, src_kind),
                                    _map_nodes(node.kwargs, lookup, src_kind), name=node.name, type_expr=node.type)
        new.meta = node.meta if share_meta else copy.copy(node.meta)
        env[node] = new
    return env


def _converted_codegen(graph: torch.fx.Graph, owner: str) -> PyTreeCodeGen | None:
    """fxdist's code generator for ``graph``'s: None for the plain ``CodeGen``, a :class:`PyTreeCodeGen`
    with the same argument names and specs for ``_PyTreeCodeGen`` (``concrete_args``/pytree inputs,
    ``ExportedProgram.module()``, whose ``in_spec`` is ``(args, kwargs)``).

    Raises:
        ValueError: any other code generator (e.g. ``_BoxedCodeGen``), naming it.
    """
    codegen = graph._codegen
    if type(codegen) is torch.fx.graph.CodeGen:
        return None
    if type(codegen) is torch.fx.graph._PyTreeCodeGen:
        info = codegen.pytree_info
        spec = info.in_spec
        args_kwargs = (spec.type is tuple and spec.num_children == 2 and spec.child(0).type is tuple
                       and spec.child(1).type is dict)  # the test torch.fx's generated text depends on
        return PyTreeCodeGen(list(info.orig_args), spec, info.out_spec, args_kwargs=args_kwargs)
    raise ValueError(f"from_torch_fx: {owner}'s graph uses {type(codegen).__name__} (a calling convention "
                     "fxdist does not generate: only CodeGen and _PyTreeCodeGen are converted)")


def _graph_from_torch_fx(graph: torch.fx.Graph, share_meta: bool, owner: str) -> tuple[Graph, dict[Any, Node]]:
    codegen = _converted_codegen(graph, owner)
    result = Graph()
    if codegen is not None:
        result.set_codegen(codegen)
    env = _copy_nodes(graph.nodes, result, torch.fx.Node, share_meta)
    return result, env


def _module_from_torch_fx(gm: torch.fx.GraphModule, share_meta: bool) -> GraphModule:
    graph, _ = _graph_from_torch_fx(gm.graph, share_meta, gm.__class__.__name__)
    result = GraphModule(gm, graph, class_name=gm.__class__.__name__)
    result.meta = dict(getattr(gm, "meta", {}))
    return result


def from_torch_fx(gm: torch.fx.GraphModule) -> GraphModule:
    """Convert a torch.fx GraphModule into an fxdist one that shares its submodules and parameters.

    Args:
        gm: a ``torch.fx.GraphModule`` (e.g. from ``torch.fx.symbolic_trace``, ``make_fx`` or
            ``torch.export.export(...).graph_module``).

    Returns:
        An fxdist ``GraphModule`` with the same nodes (op, target, args, names, types, meta), the
        same class name and a copy of ``gm.meta``.

    Raises:
        TypeError: ``gm`` is not a torch.fx GraphModule.
        ValueError: ``gm.graph`` uses a code generator other than ``CodeGen``/``_PyTreeCodeGen`` (boxed).
    """
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(f"from_torch_fx expects a torch.fx.GraphModule, got {type(gm).__name__}")
    return _module_from_torch_fx(gm, share_meta=False)


def graph_from_torch_fx(graph: torch.fx.Graph) -> Graph:
    """Convert a torch.fx Graph (e.g. from ``RewritingTracer().trace(m)``) into an fxdist Graph.

    Args:
        graph: a ``torch.fx.Graph``.

    Returns:
        An fxdist ``Graph`` with the same nodes (op, target, args, names, types, a shallow copy of
        each ``meta``) and no owning module.

    Raises:
        TypeError: ``graph`` is not a torch.fx Graph.
        ValueError: it uses a code generator other than ``CodeGen``/``_PyTreeCodeGen`` (boxed).
    """
    if not isinstance(graph, torch.fx.Graph):
        raise TypeError(f"graph_from_torch_fx expects a torch.fx.Graph, got {type(graph).__name__}")
    return _graph_from_torch_fx(graph, share_meta=False, owner="Graph")[0]


def is_torch_fx(obj: Any) -> bool:
    """Whether ``obj`` is an instance of a torch.fx class (or of a subclass of one).

    Decided from the classes' module names, so it imports nothing; fxdist's constructors and passes
    use the same test (``fxdist.graph_module._is_torch_fx``) before importing this module lazily.
    """
    return _is_torch_fx(obj)


def as_fxdist(obj: Any) -> Any:
    """The door fxdist's constructors and passes open for torch-built graphs: a torch.fx
    ``GraphModule`` becomes an fxdist ``GraphModule`` (sharing submodules, parameters and buffers) and a
    torch.fx ``Graph`` an fxdist ``Graph``; anything else is returned unchanged.

    Unlike :func:`from_torch_fx`, each new node shares the ``meta`` dict of its torch.fx node, so
    what an analysis records (``ShapeProp``'s ``tensor_meta``) is visible on the caller's torch.fx
    graph too, as it would be had torch.fx run the analysis.

    Raises:
        ValueError: the graph uses a boxed calling convention (see the module docstring).
    """
    if isinstance(obj, torch.fx.GraphModule):
        return _module_from_torch_fx(obj, share_meta=True)
    if isinstance(obj, torch.fx.Graph):
        return _graph_from_torch_fx(obj, share_meta=True, owner="Graph")[0]
    return obj


def write_back(target: torch.fx.GraphModule, source: GraphModule) -> None:
    """Make the torch.fx GraphModule ``target`` compute what the fxdist ``source`` computes, in place:
    its graph is replaced by a copy of ``source.graph`` (nodes share ``meta`` dicts) and the submodules
    and attributes that new ``get_attr``/``call_module`` nodes name are taken from ``source``.

    Used by in-place passes (``replace_pattern``, ``reinplace``) given a torch.fx GraphModule, so
    code written for torch.fx that keeps using its module sees the change.
    """
    graph = torch.fx.Graph(tracer_cls=getattr(target.graph, "_tracer_cls", None),
                           tracer_extras=getattr(target.graph, "_tracer_extras", None))
    graph.set_codegen(target.graph._codegen)  # the caller's calling convention (pytree or plain) stays
    _copy_nodes(source.graph.nodes, graph, Node, share_meta=True)
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module") and not _has_path(target, node.target):
            *prefix, field = node.target.split(".")
            owner: nn.Module = target
            for item in prefix:
                if not hasattr(owner, item):
                    owner.add_module(item, nn.Module())
                owner = getattr(owner, item)
            value = source.get_submodule(node.target) if node.op == "call_module" else _get_path(source, node.target)
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                owner.register_buffer(field, value)
            else:
                setattr(owner, field, value)
    target.graph = graph


def _get_path(obj: Any, path: str) -> Any:
    for atom in path.split("."):
        obj = getattr(obj, atom)
    return obj


def _has_path(obj: Any, path: str) -> bool:
    try:
        _get_path(obj, path)
    except AttributeError:
        return False
    return True


def to_torch_fx(gm: GraphModule) -> torch.fx.GraphModule:
    """Convert an fxdist GraphModule into a torch.fx one that shares its submodules and parameters.

    The result can be given to ``torch.compile``, ``torch.ao`` or any torch.fx pass.

    Args:
        gm: an fxdist ``GraphModule``.

    Returns:
        A ``torch.fx.GraphModule`` with the same nodes, class name and a copy of ``gm.meta``.

    Raises:
        TypeError: ``gm`` is not an fxdist GraphModule.
    """
    if not isinstance(gm, GraphModule):
        raise TypeError(f"to_torch_fx expects an fxdist GraphModule, got {type(gm).__name__}")
    graph = torch.fx.Graph()
    graph.set_codegen(_torch_fx_codegen(gm.graph._codegen))
    _copy_nodes(gm.graph.nodes, graph, Node)
    root: nn.Module = gm
    result = torch.fx.GraphModule(root, graph, class_name=type(gm).__name__)
    result.meta = dict(gm.meta)
    return result




def _torch_fx_codegen(codegen: Any) -> torch.fx.graph.CodeGen:
    """torch.fx's code generator for fxdist's: ``_PyTreeCodeGen`` with the same names and specs for a
    :class:`PyTreeCodeGen`, the plain ``CodeGen`` otherwise."""
    if isinstance(codegen, PyTreeCodeGen):
        info = torch.fx.graph._PyTreeInfo(list(codegen.orig_args), codegen.in_spec, codegen.out_spec)
        return torch.fx.graph._PyTreeCodeGen(info)
    return torch.fx.graph.CodeGen()


def run_with_unbacked_bindings(shape_env: Any, node: Node, run: Callable[[], Any]) -> Any:
    """Run one node under a fake mode and keep its unbacked symbols consistent, as torch.fx's
    ``ShapeProp.run_node`` does: a node whose ``meta["unbacked_bindings"]`` names symbols from an
    earlier trace (``torch.export`` records them for ``nonzero``, ``item``...) has the fresh symbols of
    ``run()``'s result bound to those old ones in ``shape_env`` (so shapes print as ``u0`` again and the
    graph's ``_assert_scalar`` guards keep applying), and the fresh bindings are recorded in
    ``meta["unbacked_bindings"]``.

    Args:
        shape_env: the fake mode's ``ShapeEnv`` (None: ``run()`` is only called).
        node: the node being run (fxdist's; only ``op`` and ``meta`` are read).
        run: runs the node under the fake mode and returns its value.

    Returns:
        ``run()``'s value.

    Raises:
        AssertionError: from ``rebind_unbacked`` when the old bindings cannot be matched (e.g. a
            ``ShapeEnv`` other than the one the graph was exported with), as in torch.fx.

    Source: torch/fx/passes/shape_prop.py (``ShapeProp.run_node``);
    torch/fx/experimental/symbolic_shapes.py (``rebind_unbacked``, ``compute_unbacked_bindings``).
    """
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx.experimental.symbolic_shapes import compute_unbacked_bindings, rebind_unbacked

    with enable_python_dispatcher():
        result = run()
        if shape_env is not None:
            rebind_unbacked(shape_env, node, result)  # type: ignore[arg-type]  # reads fields fxdist's Node has too
    if shape_env is not None and (bindings := compute_unbacked_bindings(shape_env, result)):
        node.meta["unbacked_bindings"] = bindings
    return result


class TorchFxTraceHooks(NamedTuple):
    """What fxdist's tracer takes over from torch.fx for one trace (see :func:`enter_torch_fx_trace`)."""

    functions: list[tuple[tuple[int, str], dict[str, Any]]]
    """``((id(globals), name), globals)`` items of ``torch.fx._symbolic_trace._wrapped_fns_to_patch``."""
    methods: list[tuple[type, str]]
    """``(class, method name)`` pairs of ``_wrapped_methods_to_patch``."""
    proxyable_classes: dict[type, None]
    """torch.fx's ``_proxyable_classes`` (the live registry, not a copy)."""


def enter_torch_fx_trace(patcher: _Patcher) -> TorchFxTraceHooks:
    """Make an fxdist trace look like a torch.fx trace to library code, until ``patcher`` exits.

    1. ``torch.fx._symbolic_trace.is_fx_tracing()`` / ``is_fx_symbolic_tracing()`` return True
       meanwhile: torchrec's ``assert_fx_safe`` and ``fx_marker``, torch.compile'd functions
       (dynamo inlines them or raises its "Detected that you are using FX" RuntimeError) and
       ``torch.nested`` take their torch.fx branch.
    2. Constructing a class made with ``torch.fx.ProxyableClassMeta`` (torchrec's ``KeyedTensor``,
       ``KeyedJaggedTensor``, ``JaggedTensor``) from fxdist Proxies records a ``call_function``, as
       fxdist's own ``ProxyableClassMeta`` does.
    3. The leaf functions and methods registered with ``torch.fx.wrap`` are returned, so fxdist's
       tracer patches them as leaves too. Libraries written for torch.fx (torchrec wraps dozens of
       helpers, e.g. in ``torchrec/modules/embedding_modules.py``) call ``torch.fx.wrap("name")`` or
       ``@torch.fx.wrap`` at module scope; the registry is read on every trace, so functions
       registered after fxdist was imported count as well.

    Args:
        patcher: the tracer's patcher; everything is restored when it exits, also on errors.

    Returns:
        TorchFxTraceHooks; all empty if ``torch.fx._symbolic_trace`` was never imported.

    Source: torch/fx/_symbolic_trace.py (``wrap``, ``_wrapped_fns_to_patch``,
    ``_patch_wrapped_functions``, ``ProxyableClassMeta``, ``_is_fx_tracing_flag`` set by ``Tracer.trace``).
    """
    module = sys.modules.get("torch.fx._symbolic_trace")
    if module is None:
        return TorchFxTraceHooks([], [], {})
    if hasattr(module, "_is_fx_tracing_flag"):
        patcher.patch_value(module, "_is_fx_tracing_flag", True)
    meta = getattr(module, "ProxyableClassMeta", None)
    if meta is not None:
        patcher.patch_method(meta, "__call__", _recording_constructor(meta.__call__))
    return TorchFxTraceHooks(list(getattr(module, "_wrapped_fns_to_patch", {}).items()),
                             list(getattr(module, "_wrapped_methods_to_patch", [])),
                             getattr(module, "_proxyable_classes", {}))


def register_torch_fx_leaf(frame_globals: dict[str, Any], name: str) -> None:
    """Register the global ``name`` of the module whose globals are ``frame_globals`` as a torch.fx leaf
    function, as ``torch.fx.wrap(name)`` called in that module would: torch.fx's tracers (and
    ``torch.fx.experimental.rewriter.RewritingTracer``) then record calls to it as one ``call_function``.
    Called by ``fxdist.wrap``; its other direction is :func:`enter_torch_fx_trace`.

    Source: torch/fx/_symbolic_trace.py (``wrap``, ``_wrapped_fns_to_patch``: ``(id(globals), name)`` keys).
    """
    import torch.fx._symbolic_trace as symbolic_trace

    symbolic_trace._wrapped_fns_to_patch[(id(frame_globals), name)] = frame_globals
