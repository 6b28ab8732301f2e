"""``fxdist.wrap`` leaves are leaves for torch.fx's tracers too, as ``torch.fx.wrap`` leaves are for fxdist's.

The same library is written twice, once registering its helpers with ``torch.fx.wrap`` and once with
``fxdist.wrap`` (by name, by function object, as a decorator). Each is traced by ``torch.fx.Tracer``,
``torch.fx.experimental.rewriter.RewritingTracer`` and fxdist: every tracer must give the same graph, code
and values for both. ``fxdist.annotate`` on a torch.fx Proxy sets its node's type, as ``torch.fx.annotate``.
"""

from __future__ import annotations

import linecache

import pytest
import torch
import torch.fx
import torch.fx._symbolic_trace as fx_symbolic_trace
from torch.fx.experimental.rewriter import RewritingTracer

import fxdist as fx
import fxdist._patching as fx_patching
from fxdist.annotate import annotate as fx_annotate
from tests._differential import compare_graphs
from tests.conformance._outcome import assert_same_error, outcome

LIBRARY = '''
import torch
from torch import nn
from {lib} import wrap

def squares(x, y):
    return x * x + y * y

wrap("squares")

def shifted(x, by: float):
    return x + by

wrap(shifted)

@wrap
def clamp_sum(x, lo: float):
    return x.clamp(min=lo).sum()

class Model(nn.Module):
    def forward(self, x, y):
        return clamp_sum(squares(x, y), 0.5) + shifted(torch.relu(y), 2.0).sum()
'''


def _load(lib: str) -> dict:
    namespace: dict = {"__name__": "library"}  # the same for both, so printed targets compare equal
    source, filename = LIBRARY.format(lib=lib), f"<library {lib}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # RewritingTracer reads it
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - fixed text
    return namespace


@pytest.fixture
def libraries():
    """The library registered with torch.fx.wrap and with fxdist.wrap; registrations removed after."""
    loaded = {lib: _load(lib) for lib in ("torch.fx", "fxdist")}
    yield loaded
    for registry in (fx_symbolic_trace._wrapped_fns_to_patch, fx_patching._wrapped_fns_to_patch):
        for key in [k for k, g in registry.items() if any(g is ns for ns in loaded.values())]:
            del registry[key]


def _leaf_targets(graph) -> list[str]:
    return [n.target.__name__ for n in graph.nodes if n.op == "call_function" and n.meta.get("is_wrapped")]


@pytest.mark.parametrize("tracer_cls", [torch.fx.Tracer, RewritingTracer], ids=["Tracer", "RewritingTracer"])
def test_fxdist_wrap_is_a_leaf_for_torch_fx_tracers(libraries, tracer_cls):
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    graphs = {}
    for lib, namespace in libraries.items():
        model = namespace["Model"]()
        graph = tracer_cls().trace(model)
        graphs[lib] = (graph, torch.fx.GraphModule(model, graph))
    (g_torch, gm_torch), (g_ours, gm_ours) = graphs["torch.fx"], graphs["fxdist"]
    assert _leaf_targets(g_ours) == _leaf_targets(g_torch) == ["squares", "clamp_sum", "shifted"]
    assert [n.format_node() for n in g_ours.nodes] == [n.format_node() for n in g_torch.nodes]
    assert gm_ours.code == gm_torch.code
    assert torch.equal(gm_ours(x, y), gm_torch(x, y))


def test_both_registrations_give_the_same_fxdist_graph(libraries):
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    for namespace in libraries.values():
        model = namespace["Model"]()
        gm, theirs = fx.symbolic_trace(model), torch.fx.symbolic_trace(model)
        compare_graphs(gm.graph, theirs.graph)
        assert _leaf_targets(gm.graph) == ["squares", "clamp_sum", "shifted"]
        assert torch.equal(gm(x, y), theirs(x, y))


def _annotated(annotate):
    def f(x):
        return annotate(x + 1, torch.Tensor).relu()
    return f


def _annotated_twice(annotate):
    def f(x):
        return annotate(annotate(x + 1, torch.Tensor), int)
    return f


def test_fxdist_annotate_sets_the_type_of_a_torch_fx_proxy():
    from torch.fx.annotate import annotate as torch_annotate

    ours, theirs = (torch.fx.symbolic_trace(_annotated(a)) for a in (fx_annotate, torch_annotate))
    assert [(n.name, n.type) for n in ours.graph.nodes] == [(n.name, n.type) for n in theirs.graph.nodes]
    assert [n.type for n in ours.graph.nodes if n.name == "add"] == [torch.Tensor]
    assert ours.code == theirs.code and "add : torch.Tensor = x + 1" in ours.code
    assert fx_annotate(3, int) == 3  # not a Proxy: returned untouched, as torch.fx


def test_fxdist_annotate_twice_on_a_torch_fx_proxy_raises_as_torch_fx():
    from torch.fx.annotate import annotate as torch_annotate

    kind_ours, ours = outcome(lambda: torch.fx.symbolic_trace(_annotated_twice(fx_annotate)))
    kind_theirs, theirs = outcome(lambda: torch.fx.symbolic_trace(_annotated_twice(torch_annotate)))
    assert kind_ours == kind_theirs == "raised"
    assert_same_error(ours, theirs, head_chars=80)
