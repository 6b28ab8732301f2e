"""A module traced with nested dict/list inputs (container-valued ``concrete_args``) can be traced again.

torch.fx's generated ``forward`` (fxdist's: ``PyTreeCodeGen``) flattens its arguments with
``fx_pytree.tree_flatten_spec([...], self._in_spec)``, which indexes the containers, so retracing it with Proxy arguments gives ``getitem``
nodes. fxdist prints the same text and its ``tree_flatten_spec`` accepts a Proxy the same way. Compared:
the printed code of the first and the second trace, the graphs, the values, and the error for an input
that lacks a traced key; namedtuple specs (type ``collections.namedtuple`` in torch 2.13) and containers
registered with ``register_pytree_flatten_spec`` (``fxdist._pytree``, as torch/fx/_pytree.py), as in
PyTorch's own test_pytree.
"""

from __future__ import annotations

import collections
import operator

import pytest
import torch
import torch.fx
import torch.fx._pytree as torch_fx_pytree
import torch.utils._pytree as pytree
from torch import nn

import fxdist as fx
from fxdist import _pytree as fx_pytree
from tests._differential import compare_graphs
from tests.conformance._outcome import assert_same_error, outcome


class NestedInputs(nn.Module):
    def forward(self, x, y):
        return {"s": x["a"] + y[0], "t": [x["b"] * y[1]]}


def _concrete(lib) -> dict:
    return {"x": {"a": lib.PH, "b": lib.PH}, "y": [lib.PH, lib.PH]}


def _inputs() -> tuple:
    return {"a": torch.randn(3), "b": torch.randn(3)}, [torch.randn(3), torch.randn(3)]


@pytest.fixture(scope="module")
def traced() -> dict:
    return {lib.__name__: lib.symbolic_trace(NestedInputs(), concrete_args=_concrete(lib)) for lib in (fx, torch.fx)}


def test_first_trace_prints_tree_flatten_spec_as_torch_fx(traced):
    ours, theirs = traced["fxdist"], traced["torch.fx"]
    assert ours.code == theirs.code
    assert "fx_pytree.tree_flatten_spec([self, x, y], self._in_spec)" in ours.code
    assert "return pytree.tree_unflatten([add, mul], self._out_spec)" in ours.code
    args = _inputs()
    torch.testing.assert_close(ours(*args), theirs(*args))


def test_retrace_of_pytree_module_matches_torch_fx(traced):
    ours, theirs = fx.symbolic_trace(traced["fxdist"]), torch.fx.symbolic_trace(traced["torch.fx"])
    compare_graphs(ours.graph, theirs.graph)
    assert ours.code == theirs.code
    assert [n.target for n in ours.graph.nodes if n.op == "call_function"][:4] == [operator.getitem] * 4
    args = _inputs()
    expected = NestedInputs()(*args)
    torch.testing.assert_close(ours(*args), expected)
    torch.testing.assert_close(theirs(*args), expected)


def test_missing_key_raises_as_torch_fx(traced):
    x, y = _inputs()
    del x["b"]
    kind_ours, ours = outcome(lambda: traced["fxdist"](x, y))
    kind_theirs, theirs = outcome(lambda: traced["torch.fx"](x, y))
    assert kind_ours == kind_theirs == "raised"
    assert_same_error(ours, theirs)
    assert "structure the module was traced with" in ours.__notes__[0]  # fxdist's note says what was expected


Pair = collections.namedtuple("Pair", "a b")


class NamedTupleInputs(nn.Module):
    def forward(self, x):
        return Pair(x.a + 1, x.b * 2)


def test_retrace_with_a_namedtuple_spec_matches_torch_fx():
    """In torch 2.13 a namedtuple's spec has type ``collections.namedtuple`` and the class as its context;
    torch.fx's ``tree_flatten_spec`` indexes it through its registry, so the retrace gives ``getitem`` nodes."""
    traced = {lib.__name__: lib.symbolic_trace(NamedTupleInputs(), concrete_args={"x": Pair(lib.PH, lib.PH)})
              for lib in (fx, torch.fx)}
    ours, theirs = fx.symbolic_trace(traced["fxdist"]), torch.fx.symbolic_trace(traced["torch.fx"])
    compare_graphs(ours.graph, theirs.graph)
    assert ours.code == theirs.code
    assert [n.target for n in ours.graph.nodes if n.op == "call_function"][:2] == [operator.getitem] * 2
    x = Pair(torch.randn(3), torch.randn(3))
    out = ours(x)
    assert type(out) is Pair
    torch.testing.assert_close(out, theirs(x))
    torch.testing.assert_close(out, Pair(x.a + 1, x.b * 2))


class Box:
    """A container registered with ``torch.utils._pytree`` whose children are reached by name, not index."""

    def __init__(self, first, second) -> None:
        self.first, self.second = first, second


class BoxInputs(nn.Module):
    def forward(self, box):
        return box.first - box.second


@pytest.fixture
def box_registered():
    pytree.register_pytree_node(Box, lambda b: ([b.first, b.second], None), lambda xs, _: Box(*xs),
                                serialized_type_name="tests.conformance.test_pytree_retrace.Box")
    yield
    pytree._deregister_pytree_node(Box)


@pytest.mark.usefixtures("box_registered")
def test_register_pytree_flatten_spec_is_used_for_a_registered_container_as_in_torch_fx():
    """Without a flatten spec, a Proxy of a ``Box`` cannot be flattened on retrace (both libraries raise);
    with ``register_pytree_flatten_spec`` (fxdist's own registry, torch.fx's for torch.fx) both retrace it by
    calling the function, and give the same graph and values."""
    traced = {lib.__name__: lib.symbolic_trace(BoxInputs(), concrete_args={"box": Box(lib.PH, lib.PH)})
              for lib in (fx, torch.fx)}
    box = Box(torch.randn(3), torch.randn(3))
    for gm in traced.values():
        torch.testing.assert_close(gm(box), box.first - box.second)
    kind_ours, ours_error = outcome(lambda: fx.symbolic_trace(traced["fxdist"]))
    kind_theirs, theirs_error = outcome(lambda: torch.fx.symbolic_trace(traced["torch.fx"]))
    assert kind_ours == kind_theirs == "raised"
    assert type(ours_error) is type(theirs_error) is RuntimeError
    assert "is different from expected spec" in str(ours_error)

    by_name = lambda b, spec: [b.first, b.second]  # noqa: E731 - getattr on a Proxy records nodes
    fx_pytree.register_pytree_flatten_spec(Box, by_name)
    torch_fx_pytree.register_pytree_flatten_spec(Box, by_name)
    try:
        ours, theirs = fx.symbolic_trace(traced["fxdist"]), torch.fx.symbolic_trace(traced["torch.fx"])
    finally:
        fx_pytree._deregister_pytree_flatten_spec(Box)
        torch_fx_pytree._deregister_pytree_flatten_spec(Box)
    compare_graphs(ours.graph, theirs.graph)
    assert [n.target for n in ours.graph.nodes if n.op == "call_function"] == [getattr, getattr, operator.sub]
    torch.testing.assert_close(ours(box), box.first - box.second)
    assert Box not in fx_pytree.SUPPORTED_NODES


def test_registry_covers_torch_fx_builtin_types():
    """dict, list, tuple, namedtuples and every ``torch.return_types`` class, as torch/fx/_pytree.py."""
    builtin = {dict, list, tuple, collections.namedtuple, *torch.return_types.all_return_types}
    assert builtin <= set(fx_pytree.SUPPORTED_NODES)
    assert set(fx_pytree.SUPPORTED_NODES) == set(torch_fx_pytree.SUPPORTED_NODES) & set(fx_pytree.SUPPORTED_NODES)
    values = torch.return_types.max((torch.tensor(3.0), torch.tensor(1)))
    _, spec = pytree.tree_flatten(values)
    assert fx_pytree.tree_flatten_spec(values, spec) == list(values)
