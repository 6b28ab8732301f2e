"""FxGraphDrawer: dot source, shapes from ShapeProp, rendering, and the missing-Graphviz error."""

from __future__ import annotations

import shutil

import pytest
import torch

import fxdist as fx
from fxdist.passes import graph_drawer
from fxdist.passes.graph_drawer import FxGraphDrawer, GraphvizNotFoundError
from fxdist.passes.shape_prop import ShapeProp


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4))
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.linear(x * self.scale)).sum(dim=-1, keepdim=True)


def _traced():
    gm = fx.symbolic_trace(Net())
    ShapeProp(gm).propagate(torch.randn(2, 4))
    return gm


def _names(dot) -> set[str]:
    return {n.get_name().strip('"') for n in dot.get_nodes()}


def test_every_node_and_edge_is_drawn_with_shapes() -> None:
    gm = _traced()
    dot = FxGraphDrawer(gm, "net", ignore_parameters_and_buffers=True).get_dot_graph()
    assert _names(dot) == {n.name for n in gm.graph.nodes}
    expected_edges = {(n.name, u.name) for n in gm.graph.nodes for u in n.users}
    assert {(e.get_source(), e.get_destination()) for e in dot.get_edges()} == expected_edges
    source = dot.to_string()
    assert "float32[2, 3]" in source  # the linear output, from ShapeProp
    assert "op_code=call_module" in source and "torch.nn.modules.linear.Linear" in source


def test_parameters_of_modules_become_records() -> None:
    dot = FxGraphDrawer(_traced(), "net").get_dot_graph()
    assert {"linear_weight", "linear_bias"} <= _names(dot)
    assert "float32[3, 4]" in dot.to_string()


def test_ignore_getattr_leaves_out_attribute_nodes() -> None:
    gm = _traced()
    getattrs = {n.name for n in gm.graph.nodes if n.op == "get_attr"}
    assert getattrs, "the model reads a parameter with get_attr"
    dot = FxGraphDrawer(gm, "net", ignore_getattr=True).get_dot_graph()
    assert not getattrs & _names(dot)


def test_record_characters_in_arguments_are_escaped() -> None:
    def f(x):
        return torch.nn.functional.pad(x, (1, 1)).add(1).view(-1), "{a|b<c>}"

    gm = fx.symbolic_trace(f)
    if shutil.which("dot") is None:
        pytest.skip("Graphviz's dot binary is not installed")
    svg = FxGraphDrawer(gm, "f").get_dot_graph().create_svg()
    assert b"<svg" in svg


def test_render_svg_and_png(tmp_path) -> None:
    if shutil.which("dot") is None:
        pytest.skip("Graphviz's dot binary is not installed (scripts/bootstrap.sh installs it)")
    drawer = FxGraphDrawer(_traced(), "net")
    svg = drawer.render(tmp_path / "net.svg").read_text()
    assert "<svg" in svg and "linear" in svg
    png = drawer.render(tmp_path / "net.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "digraph" in drawer.render(tmp_path / "net.dot").read_text()


def test_missing_dot_binary_gives_an_install_hint(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(graph_drawer.shutil, "which", lambda name: None)
    with pytest.raises(GraphvizNotFoundError, match="apt-get install graphviz"):
        FxGraphDrawer(_traced(), "net").render(tmp_path / "net.svg")
    assert not (tmp_path / "net.svg").exists()


def test_rejects_a_plain_module() -> None:
    with pytest.raises(TypeError, match="GraphModule"):
        FxGraphDrawer(Net(), "net")


def test_unknown_submodule_graph() -> None:
    with pytest.raises(KeyError, match="no GraphModule submodule 'nope'"):
        FxGraphDrawer(_traced(), "net").get_dot_graph("nope")
