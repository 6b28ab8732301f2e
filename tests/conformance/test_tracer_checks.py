"""Tracer checks that torch.fx makes: ``out=`` ATen variants refused under ``check_mutable_operations``, and a
root that lacks an attribute its forward reads."""

from __future__ import annotations

import pytest
import torch
import torch.fx

import fxdist


class OutVariant(torch.nn.Module):
    def forward(self, x, out):
        return torch.ops.aten.add.out(x, x, out=out)


class InPlaceBuiltin(torch.nn.Module):
    def forward(self, x):
        return torch.relu_(x)


class MissingAttribute(torch.nn.Module):
    def forward(self, x):
        return self.missing(x)


def _outcome(lib, module, check: bool):
    tracer = lib.Tracer()
    tracer.check_mutable_operations = check
    try:
        graph = tracer.trace(module)
    except Exception as e:  # the class and the message are what we compare
        return type(e), str(e)
    return "graph", [(n.op, str(n.target)) for n in graph.nodes]


@pytest.mark.parametrize("module", [OutVariant(), InPlaceBuiltin()], ids=["add.out", "relu_"])
@pytest.mark.parametrize("check", [True, False])
def test_mutable_operations_as_torch_fx(module, check):
    ours, theirs = _outcome(fxdist, module, check), _outcome(torch.fx, module, check)
    assert ours == theirs
    if check:
        assert ours[0] is RuntimeError and ours[1].startswith("Tried to trace mutable operation")


def test_missing_attribute_as_torch_fx():
    ours, theirs = _outcome(fxdist, MissingAttribute(), False), _outcome(torch.fx, MissingAttribute(), False)
    assert ours == theirs and ours[0] is AttributeError


def _apply_twice(x, fn, n):
    for _ in range(n):
        x = fn(x) + 1
    return x


def test_partial_tracing_with_a_function_as_concrete_arg_like_torch_fx():
    concrete = {"fn": torch.relu, "n": 2}
    with pytest.warns(UserWarning, match="Was not able to add assertion to guarantee correct input fn"):
        ours = fxdist.symbolic_trace(_apply_twice, concrete_args=concrete)
    theirs = torch.fx.symbolic_trace(_apply_twice, concrete_args=concrete)
    assert [(n.op, n.name) for n in ours.graph.nodes] == [(n.op, n.name) for n in theirs.graph.nodes]
    x = torch.randn(4)
    expected = _apply_twice(x, torch.relu, 2)
    torch.testing.assert_close(theirs(x, torch.relu, 2), expected)
    torch.testing.assert_close(ours(x, torch.relu, 2), expected)
    torch.testing.assert_close(ours(x, n_1=2, fn_1=torch.relu), expected)
