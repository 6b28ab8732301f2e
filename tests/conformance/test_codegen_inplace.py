"""In-place Python operators (``operator.iadd``... and ``operator.setitem``) in generated code.

The tracer never records them (a Proxy has no ``__iadd__``: ``x += y`` records ``add``), but graphs
built by hand or by other front ends (dynamo, make_fx) hold them. The reference is eager Python, i.e.
calling the ``operator`` functions node by node, which is what torch.fx's own ``Interpreter`` does.
fxdist's generated code matches it for every operand type. torch.fx's generated code
(``x *= y;  imul = x``) rebinds ``x``, so a later user of an immutable ``x`` (an int) sees the
product: there torch.fx's GraphModule disagrees with its own Interpreter, and fxdist keeps eager's value.
"""

import operator
from typing import Any

import pytest
import torch
import torch.fx

import fxdist as fx

INPLACE = [operator.iadd, operator.isub, operator.imul, operator.ifloordiv, operator.imod, operator.ipow,
           operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.itruediv]


def _graph(lib: Any, op: Any, type_expr: Any = None) -> Any:
    """out = (op(a, b), a): the in-place result and the operand's value afterwards."""
    g = lib.Graph()
    a = g.placeholder("a", type_expr=type_expr)
    b = g.placeholder("b", type_expr=type_expr)
    r = g.call_function(op, (a, b))
    g.output((r, a))
    return g


def _reference(op: Any, *args: Any) -> Any:
    """Eager: torch.fx's Interpreter calls the operator functions one by one."""
    g = _graph(torch.fx, op)
    return torch.fx.Interpreter(torch.fx.GraphModule(torch.nn.Module(), g)).run(*args)


@pytest.mark.parametrize("op", INPLACE, ids=lambda f: f.__name__)
def test_inplace_on_ints_computes_eager_value(op: Any) -> None:
    a, b = (7, 2) if op not in (operator.itruediv,) else (7.0, 2.0)
    gm = fx.GraphModule(torch.nn.Module(), _graph(fx, op))
    assert gm(a, b) == _reference(op, a, b) == (op(a, b), a)
    assert fx.Interpreter(gm).run(a, b) == gm(a, b)


def test_torch_fx_text_rebinds_the_operand_and_fxdist_does_not() -> None:
    ours = fx.GraphModule(torch.nn.Module(), _graph(fx, operator.imul))
    theirs = torch.fx.GraphModule(torch.nn.Module(), _graph(torch.fx, operator.imul))
    assert "a *= b;  imul = a" in theirs.code and theirs(3, 4) == (12, 12)  # the operand changed
    assert "imul = a;  imul *= b" in ours.code and ours(3, 4) == (12, 3) == _reference(operator.imul, 3, 4)


@pytest.mark.parametrize("op", [operator.iadd, operator.imul, operator.isub, operator.itruediv],
                         ids=lambda f: f.__name__)
def test_inplace_on_tensors_mutates_like_eager(op: Any) -> None:
    results = []
    for lib in (fx, torch.fx):
        gm = lib.GraphModule(torch.nn.Module(), _graph(lib, op))
        a = torch.full((3,), 6.0)
        r, after = gm(a, torch.full((3,), 2.0))
        assert r is a and after is a  # mutated in place, the same object
        results.append(a)
    expected = op(torch.full((3,), 6.0), torch.full((3,), 2.0))
    torch.testing.assert_close(results[0], expected)
    torch.testing.assert_close(results[1], expected)


def test_inplace_on_lists_and_tuples() -> None:
    gm = fx.GraphModule(torch.nn.Module(), _graph(fx, operator.iadd))
    lst = [1]
    r, after = gm(lst, [2])
    assert r is lst and lst == [1, 2] and after is lst
    assert gm((1,), (2,)) == ((1, 2), (1,)) == _reference(operator.iadd, (1,), (2,))


def _setitem_graph(lib: Any) -> Any:
    g = lib.Graph()
    x = g.placeholder("x", type_expr=torch.Tensor)
    v = g.placeholder("v", type_expr=float)
    g.call_function(operator.setitem, (x, 0, v))
    g.output(g.call_function(torch.mul, (x, 2)))
    return g


def test_setitem_statement_runs_and_scripts_like_torch_fx() -> None:
    outs = []
    for lib in (fx, torch.fx):
        gm = lib.GraphModule(torch.nn.Module(), _setitem_graph(lib))
        x = torch.zeros(2)
        outs.append((gm(x, 3.0), x.clone(), torch.jit.script(gm)(torch.zeros(2), 3.0)))
    for ours, theirs in zip(outs[0], outs[1]):
        torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(outs[0][0], torch.tensor([6.0, 0.0]))


@pytest.mark.parametrize("type_expr", [torch.Tensor, int])
def test_inplace_graph_scripts(type_expr: Any) -> None:
    """TorchScript has no ``operator.imul``; the statement form compiles (as torch.fx's does)."""
    gm = fx.GraphModule(torch.nn.Module(), _graph(fx, operator.imul, type_expr))
    scripted = torch.jit.script(gm)
    if type_expr is int:
        assert scripted(3, 4) == (12, 3) == gm(3, 4)
    else:
        a = torch.full((2,), 3.0)
        r, after = scripted(a, torch.full((2,), 4.0))
        torch.testing.assert_close(a, torch.full((2,), 12.0))
        torch.testing.assert_close(r, after)
