"""Retracing a GraphModule keeps its leaf functions as single ``call_function`` nodes.

torch.fx emits ``wrap("name")`` lines into the generated code for every node recorded as a leaf
(``meta["is_wrapped"]``: ``wrap``-registered and autowrapped functions, builtins such as ``len``);
fxdist reads the same information from the GraphModule's graph when it traces it again, as the root
or as a submodule that is traced through. Compared node by node with torch.fx retracing its own
GraphModule.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx
from torch import nn

import fxdist as fx
from tests._differential import assert_outputs_close, compare_graphs


def scale_rows(x, n):
    return x * n


fx.wrap("scale_rows")
torch.fx.wrap("scale_rows")
fx.wrap("len")
torch.fx.wrap("len")


def with_leaves(x):
    return scale_rows(x, len(x)) + math.sqrt(x.size(1))


class Outer(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).relu()


def _leaves(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and n.meta.get("is_wrapped")]


def test_retracing_a_graph_module_keeps_wrapped_functions_and_len():
    ours, theirs = fx.symbolic_trace(with_leaves), torch.fx.symbolic_trace(with_leaves)
    compare_graphs(ours.graph, theirs.graph)
    ours2, theirs2 = fx.symbolic_trace(ours), torch.fx.symbolic_trace(theirs)
    compare_graphs(ours2.graph, theirs2.graph)
    assert _leaves(ours2) == [len, scale_rows, math.sqrt]
    x = torch.randn(3, 4)
    assert_outputs_close(ours2(x), with_leaves(x), 1e-6, 1e-6, "retraced fxdist GraphModule vs eager")
    compare_graphs(fx.symbolic_trace(ours2).graph, theirs2.graph)  # and again


def test_graph_module_traced_through_as_a_submodule_keeps_its_leaves():
    ours, theirs = fx.symbolic_trace(Outer(fx.symbolic_trace(with_leaves))), \
        torch.fx.symbolic_trace(Outer(torch.fx.symbolic_trace(with_leaves)))
    compare_graphs(ours.graph, theirs.graph)
    assert _leaves(ours) == [len, scale_rows, math.sqrt]


def test_torch_fx_graph_module_retraced_by_fxdist():
    # torch.fx's own wrap("len") lines registered the generated globals with torch.fx.wrap
    theirs = torch.fx.symbolic_trace(with_leaves)
    ours = fx.symbolic_trace(theirs)
    compare_graphs(ours.graph, torch.fx.symbolic_trace(theirs).graph)
    assert _leaves(ours) == [len, scale_rows, math.sqrt]


def test_len_elsewhere_is_still_an_error_after_a_retrace():
    fx.symbolic_trace(fx.symbolic_trace(with_leaves))  # patched len only in the generated globals
    namespace: dict = {}
    exec("def uses_len(x):\n    return x.view(len(x), -1)\n", namespace)  # noqa: S102 - fixed text
    with pytest.raises(RuntimeError, match="'len' is not supported in symbolic tracing by default"):
        torch.fx.symbolic_trace(namespace["uses_len"])
    with pytest.raises(RuntimeError, match="'len' is not supported in symbolic tracing by default"):
        fx.symbolic_trace(namespace["uses_len"])
    assert "len" not in namespace
