"""The typing names ``torch.fx.node`` exports import from ``fxdist.node`` too (``ArgumentT``, ``Argument``,
``Target``), so annotations written against torch.fx keep working with ``import fxdist as fx``.
"""

from __future__ import annotations

import typing

import torch
import torch.fx.node as fx_node

import fxdist.node as fxdist_node
from fxdist.node import Argument, ArgumentT, Target, map_arg


def test_argument_type_variable_matches_torch_fx():
    assert isinstance(ArgumentT, typing.TypeVar) and isinstance(fx_node.ArgumentT, typing.TypeVar)
    assert ArgumentT.__name__ == fx_node.ArgumentT.__name__ == "ArgumentT"
    assert ArgumentT.__bound__ is Argument and fx_node.ArgumentT.__bound__ is fx_node.Argument
    assert (ArgumentT.__covariant__, ArgumentT.__contravariant__) == (
        fx_node.ArgumentT.__covariant__, fx_node.ArgumentT.__contravariant__)
    assert Target == fx_node.Target


def test_map_arg_keeps_the_structure_the_type_variable_promises():
    def double_all(a: ArgumentT) -> ArgumentT:
        return map_arg(a, lambda n: n)

    import fxdist

    graph = fxdist.Graph()
    x = graph.placeholder("x")
    args = (x, [x, 2], {"k": x})
    out = double_all(args)
    assert type(out) is tuple and out[0] is x and out[1][1] == 2 and out[2]["k"] is x

    tgraph = torch.fx.Graph()
    tx = tgraph.placeholder("x")
    tout = fx_node.map_arg((tx, [tx, 2], {"k": tx}), lambda n: n)
    assert [type(v).__name__ for v in out] == [type(v).__name__ for v in tout]
    assert fxdist_node.ArgumentT is ArgumentT
