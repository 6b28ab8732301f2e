"""A module traced with nested dict/list inputs (container-valued ``concrete_args``) can be traced again.

torch.fx's generated ``forward`` flattens its arguments with ``fx_pytree.tree_flatten_spec([...],
self._in_spec)``, which indexes the containers, so retracing it with Proxy arguments gives ``getitem``
nodes. fxdist prints the same text and its ``tree_flatten_spec`` accepts a Proxy the same way. Compared:
the printed code of the first and the second trace, the graphs, the values, and the error for an input
that lacks a traced key.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import nn

import fxdist as fx
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
    assert [n.target for n in ours.graph.nodes if n.op == "call_function"][:4] == [__import__("operator").getitem] * 4
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
