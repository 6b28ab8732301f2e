"""Differential testing against torch.fx: trace the same model with both, compare node by node.

``assert_same_as_torch_fx(model, *inputs)`` traces deep copies of ``model`` with fxdist's ``Tracer``
and torch.fx's ``Tracer`` (both optionally subclassed to treat ``leaf_modules`` as leaves), then checks:

1. the same sequence of nodes: ``(op, target)``, node names, and the structure of ``args``/``kwargs``
   (nodes compared by name, containers by type and length, constants by value);
2. fxdist's graph lints;
3. fxdist's GraphModule, torch.fx's GraphModule and eager ``model`` give the same outputs
   (``rtol``/``atol``, 1e-6 by default).

Returns both GraphModules for further checks. torch.fx is used here only as the reference.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

import fxdist as fx


def make_tracers(leaf_modules: Sequence[type] = ()) -> tuple[type, type]:
    """(fxdist Tracer subclass, torch.fx Tracer subclass) that also treat ``leaf_modules`` as leaves."""
    leaves = tuple(leaf_modules)

    class FxdistTracer(fx.Tracer):
        def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
            return isinstance(m, leaves) or super().is_leaf_module(m, qualname)

    class TorchFxTracer(torch.fx.Tracer):
        def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
            return isinstance(m, leaves) or super().is_leaf_module(m, qualname)

    return FxdistTracer, TorchFxTracer


def _same_target(a: Any, b: Any) -> bool:
    if a is b or a == b:
        return True
    # fxdist's own helpers (e.g. _assert_is_none) mirror torch.fx's: same name, other module.
    return (callable(a) and callable(b) and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", 0)
            and getattr(a, "__module__", "").startswith("fxdist"))


def _structure(arg: Any, node_type: type) -> Any:
    """A comparable form of a node argument: nodes by name, containers recursively."""
    if isinstance(arg, node_type):
        return ("%node", arg.name)
    if isinstance(arg, tuple):
        return (type(arg).__name__ if not hasattr(arg, "_fields") else "namedtuple",
                tuple(_structure(a, node_type) for a in arg))
    if isinstance(arg, list):
        return ("list", tuple(_structure(a, node_type) for a in arg))
    if isinstance(arg, dict):
        return ("dict", tuple((k, _structure(v, node_type)) for k, v in arg.items()))
    if isinstance(arg, slice):
        return ("slice", tuple(_structure(a, node_type) for a in (arg.start, arg.stop, arg.step)))
    if isinstance(arg, torch.Tensor):
        return ("tensor", tuple(arg.shape), arg.dtype)
    return ("const", type(arg).__name__, repr(arg))


def compare_graphs(ours: Any, theirs: torch.fx.Graph) -> None:
    """Assert the two graphs hold the same nodes in the same order (see module docstring)."""
    from fxdist.node import Node

    our_nodes, their_nodes = list(ours.nodes), list(theirs.nodes)
    for i, (a, b) in enumerate(zip(our_nodes, their_nodes)):
        where = f"node {i}: fxdist {a.format_node()} vs torch.fx {b.format_node()}"
        assert a.op == b.op, where
        assert _same_target(a.target, b.target), where
        assert a.name == b.name, where
        assert _structure(a.args, Node) == _structure(b.args, torch.fx.Node), where
        assert _structure(a.kwargs, Node) == _structure(b.kwargs, torch.fx.Node), where
    assert len(our_nodes) == len(their_nodes), (
        f"fxdist has {len(our_nodes)} nodes, torch.fx {len(their_nodes)}")


def assert_outputs_close(actual: Any, expected: Any, rtol: float, atol: float, what: str) -> None:
    flat_a, spec_a = pytree.tree_flatten(actual)
    flat_e, spec_e = pytree.tree_flatten(expected)
    assert spec_a == spec_e, f"{what}: output structure {spec_a} != {spec_e}"
    for a, e in zip(flat_a, flat_e):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
        else:
            assert a == e, f"{what}: {a!r} != {e!r}"


def assert_same_as_torch_fx(
    model: torch.nn.Module | Any,
    *inputs: Any,
    tracer_kwargs: dict[str, Any] | None = None,
    leaf_modules: Sequence[type] = (),
    concrete_args: dict[str, Any] | None = None,
    rtol: float = 1e-6,
    atol: float = 1e-6,
    copy_model: bool = True,
) -> tuple[fx.GraphModule, torch.fx.GraphModule]:
    """Trace ``model`` with fxdist and torch.fx and assert the same graph and outputs.

    Args:
        model: an ``nn.Module`` (deep-copied for each tracer) or a plain function.
        inputs: positional inputs for the forward comparison; none skips it.
        tracer_kwargs: passed to both ``Tracer`` constructors (e.g. ``autowrap_functions``).
        leaf_modules: module types both tracers keep as ``call_module`` leaves.
        concrete_args: passed to both ``trace`` calls.
        rtol, atol: tolerances for the outputs, relative to eager.
        copy_model: trace deep copies (default). False saves time and memory on large models that
            store no tensor constants while tracing (else the second tracer would see the first's
            ``_tensor_constant*`` attributes and number its own differently).

    Returns:
        (fxdist GraphModule, torch.fx GraphModule).
    """
    ours_cls, theirs_cls = make_tracers(leaf_modules)
    kwargs = tracer_kwargs or {}
    is_module = isinstance(model, torch.nn.Module)
    ours_root = copy.deepcopy(model) if is_module and copy_model else model
    theirs_root = copy.deepcopy(model) if is_module and copy_model else model

    ours_tracer, theirs_tracer = ours_cls(**kwargs), theirs_cls(**kwargs)
    ours_graph = ours_tracer.trace(ours_root, concrete_args)
    theirs_graph = theirs_tracer.trace(theirs_root, concrete_args)
    name = type(model).__name__ if is_module else model.__name__
    ours_gm = fx.GraphModule(ours_tracer.root, ours_graph, name)
    theirs_gm = torch.fx.GraphModule(theirs_tracer.root, theirs_graph, name)

    compare_graphs(ours_gm.graph, theirs_gm.graph)
    ours_gm.graph.lint()
    if inputs:
        with torch.no_grad():
            expected = model(*inputs)
            assert_outputs_close(ours_gm(*inputs), expected, rtol, atol, "fxdist GraphModule vs eager")
            assert_outputs_close(theirs_gm(*inputs), expected, rtol, atol, "torch.fx GraphModule vs eager")
    return ours_gm, theirs_gm
