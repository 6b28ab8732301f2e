"""Pickling GraphModules that call ``torch.ops`` operators (custom ops, ATen overloads), against torch.fx.

``torch.ops`` objects do not pickle by themselves; torch.fx pickles the generated code and re-imports
``torch``, fxdist pickles its graph and names each operator by its verified ``torch.ops`` path.
"""

import copy
import pickle
from typing import Any

import pytest
import torch
import torch.fx

import fxdist as fx
from fxdist._graph_module_io import _TorchOpRef

_LIB = torch.library.Library("fxdist_cgtest", "DEF")  # noqa: TOR901 - a test-only custom op namespace
_LIB.define("scale(Tensor x, float k) -> Tensor")
_LIB.impl("scale", lambda x, k: x * k, "CompositeExplicitAutograd")


def uses_custom_op(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.fxdist_cgtest.scale(x, 2.0) + torch.ops.fxdist_cgtest.scale.default(x, 0.5)


def apply_op(op: Any, x: torch.Tensor) -> torch.Tensor:
    return op(x)


def _aten_graph(lib: Any) -> Any:
    """An ATen-level graph, with an operator also passed as an argument."""
    g = lib.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.ops.aten.add.Tensor, (x, x))
    b = g.call_function(apply_op, (torch.ops.aten.relu.default, a))
    g.output([g.call_function(torch.ops.aten.mul, (b, 3))])
    return g


def _roundtrip(gm: Any) -> Any:
    return pickle.loads(pickle.dumps(gm))


def test_custom_op_pickles_like_torch_fx() -> None:
    ours, theirs = _roundtrip(fx.symbolic_trace(uses_custom_op)), _roundtrip(torch.fx.symbolic_trace(uses_custom_op))
    x = torch.randn(3)
    torch.testing.assert_close(ours(x), uses_custom_op(x))
    torch.testing.assert_close(ours(x), theirs(x))
    targets = [n.target for n in ours.graph.nodes if n.op == "call_function"]
    assert targets[0] is torch.ops.fxdist_cgtest.scale and targets[1] is torch.ops.fxdist_cgtest.scale.default
    assert ours.code == fx.symbolic_trace(uses_custom_op).code


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_aten_ops_in_targets_and_args_round_trip(how: str) -> None:
    ours = fx.GraphModule(torch.nn.Module(), _aten_graph(fx))
    theirs = torch.fx.GraphModule(torch.nn.Module(), _aten_graph(torch.fx))
    copied = _roundtrip(ours) if how == "pickle" else copy.deepcopy(ours)
    x = torch.randn(4)
    torch.testing.assert_close(copied(x), theirs(x))
    assert [n.args for n in copied.graph.nodes][2][0] is torch.ops.aten.relu.default
    assert copied.code == ours.code


def test_missing_operator_names_the_library_to_load() -> None:
    with pytest.raises(RuntimeError, match=r"torch\.ops\.fxdist_not_loaded\.op .*load the library"):
        _TorchOpRef("torch.ops.fxdist_not_loaded.op").resolve()
