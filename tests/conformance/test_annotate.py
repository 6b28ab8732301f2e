"""``fxdist.annotate.annotate`` sets ``Node.type`` like ``torch.fx.annotate.annotate``: same graph, same printed
graph and code, same RuntimeError when the value already has a type."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch.fx.annotate import annotate as torch_fx_annotate

import fxdist as fx
from fxdist.annotate import annotate
from tests._differential import compare_graphs


def rows_with(annotate_fn):
    def rows(x):
        n = annotate_fn(x.size(0), int)
        return x.view(n, -1), annotate_fn(3, str)

    return rows


def test_annotate_sets_node_type_like_torch_fx():
    ours, theirs = fx.symbolic_trace(rows_with(annotate)), torch.fx.symbolic_trace(rows_with(torch_fx_annotate))
    compare_graphs(ours.graph, theirs.graph)
    assert [n.type for n in ours.graph.nodes] == [n.type for n in theirs.graph.nodes]
    assert next(n for n in ours.graph.nodes if n.target == "size").type is int
    assert str(ours.graph) == str(theirs.graph)
    assert "size : int = x.size(0)" in ours.code and "size : int = x.size(0)" in theirs.code
    x = torch.randn(2, 3, 4)
    assert ours(x)[0].shape == (2, 12) and ours(x)[1] == 3  # non-Proxy values pass through


def test_annotating_a_typed_value_is_a_runtime_error():
    def typed(x: torch.Tensor):
        return annotate(x, int)

    def typed_torch_fx(x: torch.Tensor):
        return torch_fx_annotate(x, int)

    with pytest.raises(RuntimeError, match="Tried to annotate a value that already had a type on it!") as theirs:
        torch.fx.symbolic_trace(typed_torch_fx)
    with pytest.raises(RuntimeError, match="Tried to annotate a value that already had a type on it!") as ours:
        fx.symbolic_trace(typed)
    assert str(ours.value).startswith(str(theirs.value))  # plus the node's name
