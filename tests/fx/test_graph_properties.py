"""Property test: random edit sequences keep a graph valid and its generated code correct.

Edits (insert a node, replace all uses, erase a dead node, node_copy everything into a new graph)
are drawn by hypothesis on a graph of elementwise torch ops. After every edit ``lint()`` passes and
node names are unique; after the sequence the recompiled GraphModule computes the same as a tiny
dict-based evaluator written here (it walks the node list and shares nothing with fxdist's codegen
or Interpreter).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import fxdist as fx

UNARY = [torch.neg, torch.sin, torch.relu, torch.tanh, torch.abs]
BINARY = [torch.add, torch.mul, operator.add, operator.sub, operator.truediv]


def reference_eval(graph: fx.Graph, inputs: list[torch.Tensor]) -> Any:
    """Evaluate ``graph`` by walking its nodes with a dict environment."""
    env: dict[Any, Any] = {}
    feed = iter(inputs)

    def value(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return env[a]
        if isinstance(a, (tuple, list)):
            return type(a)(value(x) for x in a) if isinstance(a, tuple) else [value(x) for x in a]
        return a

    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = next(feed)
        elif node.op == "call_function":
            env[node] = node.target(*value(node.args), **{k: value(v) for k, v in node.kwargs.items()})
        elif node.op == "output":
            return value(node.args[0])
        else:
            raise AssertionError(f"unexpected op {node.op}")
    raise AssertionError("no output node")


def initial_graph() -> fx.Graph:
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    s = g.call_function(torch.sin, (a,))
    m = g.call_function(operator.mul, (s, b))
    g.output((m, g.call_function(torch.relu, (m,))))
    return g


def body(g: fx.Graph) -> list[fx.Node]:
    return [n for n in g.nodes if n.op not in ("placeholder", "output")]


def insert_node(g: fx.Graph, data: st.DataObject) -> None:
    nodes = [n for n in g.nodes if n.op != "output"]
    first = max(i for i, n in enumerate(nodes) if n.op == "placeholder")
    at = data.draw(st.integers(first, len(nodes) - 1), label="insert after")
    inputs = st.sampled_from(nodes[: at + 1])
    with g.inserting_after(nodes[at]):
        if data.draw(st.booleans(), label="unary"):
            new = g.call_function(data.draw(st.sampled_from(UNARY)), (data.draw(inputs),))
        else:
            rhs = data.draw(st.one_of(inputs, st.floats(-2, 2, allow_nan=False)), label="rhs")
            new = g.call_function(data.draw(st.sampled_from(BINARY)), (data.draw(inputs), rhs))
    users = [n for n in nodes[at + 1:] if n.op != "placeholder"] + [g.output_node()]
    user = data.draw(st.sampled_from(users), label="rewired user")
    if user.all_input_nodes:  # make the new node reachable: it replaces one input of a later node
        user.replace_input_with(data.draw(st.sampled_from(user.all_input_nodes)), new)


def replace_uses(g: fx.Graph, data: st.DataObject) -> None:
    nodes = list(g.nodes)
    candidates = body(g)
    if not candidates:
        return
    old = data.draw(st.sampled_from(candidates), label="replaced")
    new = data.draw(st.sampled_from(nodes[: nodes.index(old)]), label="replacement")
    old.replace_all_uses_with(new)


def erase_dead(g: fx.Graph, data: st.DataObject) -> None:
    dead = [n for n in body(g) if not n.users]
    if dead:
        g.erase_node(data.draw(st.sampled_from(dead), label="erased"))


def copy_graph(g: fx.Graph, data: st.DataObject) -> fx.Graph:
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in g.nodes:
        env[node] = new.node_copy(node, lambda n: env[n])
    return new


EDITS = {"insert": insert_node, "replace": replace_uses, "erase": erase_dead, "copy": copy_graph}


def check_invariants(g: fx.Graph) -> None:
    g.lint()
    names = [n.name for n in g.nodes]
    assert len(names) == len(set(names)), names


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), edits=st.lists(st.sampled_from(sorted(EDITS)), min_size=1, max_size=8))
def test_random_edits_keep_graph_valid_and_code_correct(data: st.DataObject, edits: list[str]) -> None:
    g = initial_graph()
    for edit in edits:
        result = EDITS[edit](g, data)
        g = result if result is not None else g
        check_invariants(g)
    gm = fx.GraphModule(nn.Module(), g)
    inputs = [torch.linspace(-2, 2, 5), torch.linspace(1, -1, 5)]
    got, want = gm(*inputs), reference_eval(g, inputs)
    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert torch.allclose(x, y, equal_nan=True), gm.code
