"""``PHBase``/``PHWithMeta`` and ``_wrapped_methods_to_patch`` where torch.fx has them.

* ``PHBase`` and ``PHWithMeta`` import from ``fxdist`` and ``fxdist._symbolic_trace``, as from
  ``torch.fx._symbolic_trace``; torch.fx's own PH objects in ``concrete_args`` stay placeholders for fxdist
  (a ``PHWithMeta``'s attributes go onto the node).
* ``fxdist._symbolic_trace._wrapped_methods_to_patch`` exists; tracing reads it and torch.fx's list.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.fx._symbolic_trace as fx_symbolic_trace
from torch import nn

import fxdist
import fxdist as fx
import fxdist._symbolic_trace as fxdist_symbolic_trace
from tests._differential import compare_graphs
from tests.conformance._outcome import assert_same_error, outcome


def test_ph_classes_import_from_the_same_places():
    from fxdist._symbolic_trace import PH, PHBase, PHWithMeta

    assert fxdist.PHBase is PHBase and fxdist.PHWithMeta is PHWithMeta and fxdist.PH is PH
    assert isinstance(PH, PHBase) and issubclass(PHWithMeta, PHBase)
    assert isinstance(fx_symbolic_trace.PH, fx_symbolic_trace.PHBase)  # the names torch.fx has
    assert PHWithMeta(ph_key="k").ph_key == fx_symbolic_trace.PHWithMeta(ph_key="k").ph_key


class Pair(nn.Module):
    def forward(self, x, y):
        return x["a"] * 2 + y


def _placeholders(graph) -> list[tuple[str, object]]:
    return [(n.name, getattr(n, "ph_key", None)) for n in graph.nodes if n.op == "placeholder"]


@pytest.mark.parametrize("marker", [fx_symbolic_trace.PH, fx_symbolic_trace.PHWithMeta(ph_key="a_key")],
                         ids=["PH", "PHWithMeta"])
def test_torch_fx_ph_in_concrete_args_is_a_placeholder(marker):
    ours = fx.symbolic_trace(Pair(), concrete_args={"x": {"a": marker}})
    theirs = torch.fx.symbolic_trace(Pair(), concrete_args={"x": {"a": marker}})
    compare_graphs(ours.graph, theirs.graph)
    assert _placeholders(ours.graph) == _placeholders(theirs.graph)
    assert _placeholders(ours.graph)[0] == ("x_1", getattr(marker, "ph_key", None))
    assert ours.code == theirs.code
    x, y = {"a": torch.randn(3)}, torch.randn(3)
    assert torch.equal(ours(x, y), theirs(x, y))


def test_fxdist_ph_with_meta_matches_torch_fx_ph_with_meta():
    ours = fx.symbolic_trace(Pair(), concrete_args={"x": {"a": fx.PHWithMeta(ph_key="a_key")}})
    theirs = torch.fx.symbolic_trace(Pair(), concrete_args={"x": {"a": fx_symbolic_trace.PHWithMeta(ph_key="a_key")}})
    assert _placeholders(ours.graph) == _placeholders(theirs.graph) == [("x_1", "a_key"), ("y", None)]


class PositionalEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pe", torch.randn(1, 16, 4))

    def forward(self, x):
        return x + self.pe[:, : x.size(1)]


@pytest.mark.parametrize("where", ["fxdist", "torch.fx"])
def test_wrapped_methods_to_patch_is_read_from_both_modules(monkeypatch, where):
    assert fxdist_symbolic_trace._wrapped_methods_to_patch == fx_symbolic_trace._wrapped_methods_to_patch == []
    getitem = [(torch.Tensor, "__getitem__")]
    monkeypatch.setattr(fxdist_symbolic_trace if where == "fxdist" else fx_symbolic_trace,
                        "_wrapped_methods_to_patch", getitem)
    original = torch.Tensor.__getitem__
    ours = fx.symbolic_trace(PositionalEmbedding())  # only the list named by `where` holds the entry
    monkeypatch.setattr(fx_symbolic_trace, "_wrapped_methods_to_patch", getitem)  # torch.fx's reference trace
    theirs = torch.fx.symbolic_trace(PositionalEmbedding())
    compare_graphs(ours.graph, theirs.graph)
    nodes = [n for n in ours.graph.nodes if n.target == "__getitem__"]
    assert len(nodes) == 1 and nodes[0].op == "call_method"
    assert torch.Tensor.__getitem__ is original


def test_without_the_entry_both_fail_the_same_way():
    # a real tensor indexed with a Proxy slice: neither library can trace it without the patch
    kind_ours, ours = outcome(lambda: fx.symbolic_trace(PositionalEmbedding()))
    kind_theirs, theirs = outcome(lambda: torch.fx.symbolic_trace(PositionalEmbedding()))
    assert kind_ours == kind_theirs == "raised"
    assert_same_error(ours, theirs)
