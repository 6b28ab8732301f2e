"""Graph: building, naming, insert points, erasure, iteration, find_nodes, copies, DCE, printing.

Most tests build the same graph with ``torch.fx.Graph`` and ``fxdist.Graph`` and compare printed text
and node names; the worked examples of torch.fx's Graph API (torch/fx/graph.py: inserting_after/before,
erase_node, replace_all_uses_with, python_code) are checked against their printed results. Private helpers
tested here through Graph: fxdist/_graph_state.py (pickling without recursion) and fxdist/_body_lines.py
(``on_generate_code`` body transformers).
"""

from __future__ import annotations

import copy
import inspect
import operator
import textwrap
import warnings

import pytest
import torch
import torch.fx as tfx
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fxdist.graph import Graph
from fxdist.node import Node


def _names(nodes) -> list[str]:
    return [n.name for n in nodes]


def _both(build):
    """Run ``build(GraphClass)`` for fxdist and torch.fx; return (ours, theirs)."""
    return build(Graph), build(tfx.Graph)


# -- building and naming -----------------------------------------------------------------------------


def _seed_7_3(G):
    graph = G()
    x = graph.placeholder("x")
    y = graph.placeholder("y")
    add = graph.call_function(operator.add, (x, y))
    relu = graph.call_function(torch.relu, (add,))
    graph.output(relu)
    return graph


def test_seed_001_section_7_3_hand_built_graph() -> None:
    ours, theirs = _both(_seed_7_3)
    assert str(ours) == str(theirs) == textwrap.dedent("""\
        graph():
            %x : [num_users=1] = placeholder[target=x]
            %y : [num_users=1] = placeholder[target=y]
            %add : [num_users=1] = call_function[target=operator.add](args = (%x, %y), kwargs = {})
            %relu : [num_users=1] = call_function[target=torch.relu](args = (%add,), kwargs = {})
            return relu""")
    ours.lint()


def _many_names(G):
    g = G()
    for _ in range(3):
        g.placeholder("input")                      # builtin name -> input_1, input_2, ...
    x = g.placeholder("x")
    g.call_function(torch.relu, (x,))
    g.call_function(operator.add, (x, 1))
    g.call_method("__add__", (x, 1))                # magic method: dunders stripped
    g.call_module("layer1.0.conv", (x,))
    g.get_attr("conv1.weight")
    g.call_method("myMethodName", (x,))             # snake_case
    g.call_module("0", (x,))                        # leading digit
    g.call_function(torch.Tensor.add, (x, 1))
    g.call_function(F.linear, (x, x))
    g.call_function(torch.ops.aten.add.Tensor, (x, x))
    g.call_function(len, (x,))
    g.call_function(getattr, (x, "shape"))
    g.create_node("call_function", operator.mul, (x, 2), name="add_5")  # explicit numbered name
    g.create_node("call_function", operator.mul, (x, 2), name="add")
    g.create_node("call_function", operator.mul, (x, 2), name="add_5")
    g.create_node("call_function", operator.mul, (x, 2), name="torch")
    g.create_node("call_function", operator.mul, (x, 2), name="for")
    g.create_node("call_function", operator.mul, (x, 2), name="a.b-c d")
    g.placeholder("__name__")
    return g


def test_node_names_match_torch_fx() -> None:
    ours, theirs = _both(_many_names)
    assert _names(ours.nodes) == _names(theirs.nodes)
    assert str(ours) == str(theirs)
    assert all(n.name.isidentifier() for n in ours.nodes)


def test_placeholder_default_value_and_type_expr() -> None:
    g = Graph()
    a = g.placeholder("a")
    b = g.placeholder("b", default_value=None)
    c = g.placeholder("c", type_expr=int, default_value=inspect.Signature.empty)
    assert a.args == () and b.args == (None,) and c.args == () and c.type is int


def test_create_node_rejects_non_tuple_args() -> None:
    g = Graph()
    with pytest.raises(TypeError, match="args must be a tuple, got list"):
        g.create_node("call_function", torch.relu, [1])
    with pytest.raises(TypeError, match="kwargs must be a dict"):
        g.create_node("call_function", torch.relu, (1,), [("a", 1)])
    with pytest.raises(AssertionError):  # torch.fx's type, for code written against it
        g.create_node("call_function", torch.relu, [1])
    with pytest.raises(ValueError, match="must be a callable .* or a str, got int 5"):
        g.create_node("call_function", 5)
    with pytest.raises(AssertionError, match="not an output"):
        g.output_node()
    assert len(g.nodes) == 0


def test_get_attr_and_call_module_warn_without_reference() -> None:
    root = torch.nn.Module()
    root.lin = torch.nn.Linear(2, 2)
    g = Graph(owning_module=root)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g.get_attr("lin.weight")
        g.call_module("lin", ())
    with pytest.warns(UserWarning, match="no underlying reference.*'lin.nope'"):
        g.get_attr("lin.nope")
    with pytest.warns(UserWarning, match="no underlying reference.*'conv'"):
        g.call_module("conv", ())
    assert g.owning_module is root


# -- insert points -----------------------------------------------------------------------------------


def _inserts(G):
    g = G()
    x = g.placeholder("x")
    out = g.output(x)
    with g.inserting_after(x):
        g.call_function(torch.neg, (x,))
        g.call_function(torch.sin, (x,))            # lands right after x: before neg
    with g.inserting_before(out):
        g.call_function(torch.cos, (x,))
        g.call_function(torch.tan, (x,))            # before out: after cos
    with g.inserting_before():                      # start of graph
        g.placeholder("first")
    with g.inserting_after():                       # end of graph (after output)
        g.call_function(torch.exp, (x,))
    g.call_function(torch.abs, (x,))               # insert point restored: the end
    return g


def test_insert_points_match_torch_fx() -> None:
    ours, theirs = _both(_inserts)
    assert _names(ours.nodes) == _names(theirs.nodes) == [
        "first", "x", "sin", "neg", "cos", "tan", "output", "exp", "abs_1"]


def test_insert_point_of_other_graph_node_is_refused() -> None:
    g1, g2 = Graph(), Graph()
    n = g2.placeholder("x")
    with pytest.raises(ValueError, match="not in this graph"):
        g1.inserting_before(n)
    with pytest.raises(ValueError, match="not in this graph"):
        g1.inserting_after(n)


def test_seed_001_section_8_insert_replace_erase() -> None:
    def build(G):
        graph = _seed_7_3(G)
        x, y, add, relu, out = graph.nodes
        with graph.inserting_after(add):
            neg = graph.call_function(torch.neg, (add,))
        with graph.inserting_before(relu):
            mul = graph.call_function(torch.mul, (neg, x))
        relu.replace_all_uses_with(mul)
        graph.erase_node(relu)
        return graph

    ours, theirs = _both(build)
    assert str(ours) == str(theirs) == textwrap.dedent("""\
        graph():
            %x : [num_users=2] = placeholder[target=x]
            %y : [num_users=1] = placeholder[target=y]
            %add : [num_users=1] = call_function[target=operator.add](args = (%x, %y), kwargs = {})
            %neg : [num_users=1] = call_function[target=torch.neg](args = (%add,), kwargs = {})
            %mul : [num_users=1] = call_function[target=torch.mul](args = (%neg, %x), kwargs = {})
            return mul""")
    ours.lint()


# -- erasure and iteration ---------------------------------------------------------------------------


def test_erase_node_with_users_names_them() -> None:
    g = _seed_7_3(Graph)
    x, y, add, relu, out = g.nodes
    with pytest.raises(RuntimeError, match=r"Tried to erase Node add but it still had 1 users.*Users: relu.*"
                                           r"replace_all_uses_with"):
        g.erase_node(add)
    with pytest.raises(RuntimeError, match=r"still had 1 users.*Users: add"):
        g.erase_node(x)
    assert len(g.nodes) == 5


def test_erase_node_from_wrong_graph_and_twice() -> None:
    g, other = Graph(), Graph()
    n = other.placeholder("x")
    with pytest.raises(RuntimeError, match="wrong graph"):
        g.erase_node(n)
    other.erase_node(n)
    with pytest.warns(UserWarning, match="already erased"):
        other.erase_node(n)
    assert len(other.nodes) == 0


def test_erase_updates_inputs_users_and_length() -> None:
    g = _seed_7_3(Graph)
    x, y, add, relu, out = g.nodes
    out.args = (add,)
    g.erase_node(relu)
    assert _names(add.users) == ["output"] and relu._erased and len(g.nodes) == 4
    assert relu.args == (None,) and relu.all_input_nodes == []
    g.lint()


def test_reversed_iteration_and_length() -> None:
    g = _seed_7_3(Graph)
    assert _names(reversed(g.nodes)) == ["output", "relu", "add", "y", "x"]
    assert _names(reversed(reversed(g.nodes))) == ["x", "y", "add", "relu", "output"]
    assert len(g.nodes) == 5 == len(reversed(g.nodes))
    assert g.output_node().op == "output"


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_erase_while_iterating(direction: str) -> None:
    g = Graph()
    x = g.placeholder("x")
    dead = [g.call_function(torch.neg, (x,)) for _ in range(5)]
    g.output(x)
    seen = []
    nodes = g.nodes if direction == "forward" else reversed(g.nodes)
    for n in nodes:
        seen.append(n.name)
        if n.target is torch.neg:
            g.erase_node(n)
    expected = ["x", *(d.name for d in dead), "output"]
    assert seen == (expected if direction == "forward" else expected[::-1])
    assert _names(g.nodes) == ["x", "output"] and len(g.nodes) == 2


def test_erasing_the_next_node_while_iterating_skips_it() -> None:
    g = Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.neg, (x,))
    b = g.call_function(torch.neg, (x,))
    g.output(x)
    seen = []
    for n in g.nodes:
        seen.append(n.name)
        if n is a:
            g.erase_node(a)
            g.erase_node(b)
    assert seen == ["x", "neg", "output"]


# -- find_nodes ----------------------------------------------------------------------------------------


def test_find_nodes_after_inserts_erases_and_target_change() -> None:
    g = Graph()
    x = g.placeholder("x")
    r1 = g.call_function(torch.relu, (x,))
    m = g.call_method("view", (r1, -1))
    r2 = g.call_function(torch.relu, (m,))
    with g.inserting_before(r1):
        r0 = g.call_function(torch.relu, (x,))
    out = g.output(r2)
    assert g.find_nodes(op="call_function", target=torch.relu) == [r0, r1, r2]
    assert g.find_nodes(op="call_function", target=torch.relu, sort=False) == [r1, r2, r0]
    assert g.find_nodes(op="call_method", target="view") == [m]
    assert g.find_nodes(op="call_method", target="size") == []
    assert g.find_nodes(op="placeholder") == [x] and g.find_nodes(op="output") == [out]
    g.erase_node(r0)
    assert g.find_nodes(op="call_function", target=torch.relu) == [r1, r2]
    r1.target = torch.sigmoid
    assert g.find_nodes(op="call_function", target=torch.relu) == [r2]
    assert g.find_nodes(op="call_function", target=torch.sigmoid) == [r1]
    r2.op = "call_method"
    r2.target = "relu"
    assert g.find_nodes(op="call_method") == [m, r2]
    with pytest.raises(ValueError, match="needs target"):
        g.find_nodes(op="call_function")
    g.lint()


def test_find_nodes_is_a_table_lookup_not_a_scan() -> None:
    g = Graph()
    x = g.placeholder("x")
    for _ in range(50):
        g.call_function(torch.neg, (x,))
    y = g.call_function(torch.relu, (x,))
    m = g.call_module("layer1", (y,))

    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, v):
            return v

    fn = Unhashable()
    u = g.call_function(fn, (m,))
    g._root._next = g._root  # hide every node from iteration: a scan would find nothing
    assert g.find_nodes(op="call_function", target=torch.relu) == [y]
    assert g.find_nodes(op="call_module", target="layer1") == [m] == g.find_nodes(op="call_module")
    assert g.find_nodes(op="call_function", target=fn) == [u]
    assert g.find_nodes(op="get_attr") == [] and g.find_nodes(op="call_module", target="layer2") == []


# -- copies ------------------------------------------------------------------------------------------


def test_node_copy_graph_copy_and_deepcopy() -> None:
    src = _seed_7_3(Graph)
    for n in src.nodes:
        n.meta["tag"] = n.name
    dst = Graph()
    val_map: dict[Node, Node] = {}
    out = dst.graph_copy(src, val_map)
    dst.output(out)
    assert str(dst) == str(src) and all(val_map[n].graph is dst for n in val_map)
    assert [n.meta["tag"] for n in dst.nodes if n.op != "output"] == ["x", "y", "add", "relu"]
    dst.lint()

    clone = copy.deepcopy(src)
    assert str(clone) == str(src) and clone.output_node().meta == {"tag": "output"}
    next(iter(clone.nodes)).name = "renamed"
    assert next(iter(src.nodes)).name == "x"
    clone.lint()


def test_graph_copy_with_substituted_input_and_output_node() -> None:
    src = _seed_7_3(Graph)
    dst = Graph()
    z = dst.placeholder("z")
    x_src = next(iter(src.nodes))
    rv, old_out = dst.graph_copy(src, {x_src: z}, return_output_node=True)
    assert old_out is src.output_node() and rv.name == "relu"
    assert _names(dst.nodes) == ["z", "y", "add", "relu"]
    assert dst.find_nodes(op="call_function", target=operator.add)[0].args[0] is z


# -- torch.fx Graph manipulation examples (torch/fx/graph.py) -----------------------------------------------


def test_seed_001_section_10_1_relu_to_gelu_on_built_graph() -> None:
    def build(G):
        graph = G()
        x = graph.placeholder("x")
        lin = graph.call_module("linear", (x,))
        relu = graph.call_function(torch.relu, (lin,))
        graph.output(relu)
        for node in graph.nodes:
            if node.op == "call_function" and node.target == torch.relu:
                with graph.inserting_after(node):
                    new_node = graph.call_function(F.gelu, node.args, node.kwargs)
                node.replace_all_uses_with(new_node)
                graph.erase_node(node)
        return graph

    ours, theirs = _both(build)
    assert str(ours) == str(theirs)
    assert [(n.op, n.name) for n in ours.nodes] == [
        ("placeholder", "x"), ("call_module", "linear"), ("call_function", "gelu"), ("output", "output")]
    ours.lint()


def test_seed_001_section_10_1_relu_to_gelu_traced() -> None:
    import fxdist as fx

    class MyModule(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(10, 20)

        def forward(self, x):
            return torch.relu(self.linear(x))

    m = MyModule()
    traced = fx.symbolic_trace(m)
    graph = traced.graph
    assert [(n.op, n.name) for n in graph.nodes] == [
        ("placeholder", "x"), ("call_module", "linear"), ("call_function", "relu"), ("output", "output")]
    for node in graph.nodes:
        if node.op == "call_function" and node.target == torch.relu:
            with graph.inserting_after(node):
                new_node = graph.call_function(F.gelu, node.args, node.kwargs)
            node.replace_all_uses_with(new_node)
            graph.erase_node(node)
    graph.lint()
    traced.recompile()
    assert "gelu" in traced.code and "relu" not in traced.code
    x = torch.randn(3, 10)
    torch.testing.assert_close(traced(x), F.gelu(m.linear(x)))


def _use_def_table(graph) -> list[str]:
    return [f"{n.name:12s} | inputs: {str([i.name for i in n.all_input_nodes]):30s} | users: "
            f"{[u.name for u in n.users]}" for n in graph.nodes]


def test_seed_001_section_10_2_use_def_table() -> None:
    def build(G):  # Net.forward: a = x + y; b = a * x; c = torch.relu(b); return c
        g = G()
        x, y = g.placeholder("x"), g.placeholder("y")
        a = g.call_function(operator.add, (x, y))
        b = g.call_function(operator.mul, (a, x))
        g.output(g.call_function(torch.relu, (b,)))
        return g

    ours, theirs = _both(build)
    table = _use_def_table(ours)
    assert table == _use_def_table(theirs)
    assert [line.replace(" ", "") for line in table] == [
        "x|inputs:[]|users:['add','mul']",
        "y|inputs:[]|users:['add']",
        "add|inputs:['x','y']|users:['mul']",
        "mul|inputs:['add','x']|users:['relu']",
        "relu|inputs:['mul']|users:['output']",
        "output|inputs:['relu']|users:[]",
    ]


# -- dead code elimination ---------------------------------------------------------------------------


def test_dce_removes_dead_chains_like_torch_fx() -> None:
    def build(G):
        g = G()
        x = g.placeholder("x")
        a = g.call_function(torch.neg, (x,))
        g.call_function(torch.sin, (a,))             # dead, and makes `a` dead once erased
        b = g.call_method("relu", (x,))
        g.output(b)
        changed = g.eliminate_dead_code()
        return g, changed

    (ours, c1), (theirs, c2) = _both(build)
    assert c1 is c2 is True
    assert str(ours) == str(theirs) and _names(ours.nodes) == ["x", "relu", "output"]
    assert ours.eliminate_dead_code() is False


def test_dce_keeps_impure_nodes() -> None:
    import torch.distributed.rpc as rpc

    root = torch.nn.Module()
    root.drop = torch.nn.Dropout()
    g = Graph(owning_module=root)
    x = g.placeholder("x")
    kept = [
        g.call_method("add_", (x, 1)),
        g.call_function(rpc.rpc_sync, ("worker1", torch.add, (x, 1))),
        g.call_function(torch.rand, (3,)),
        g.call_function(torch._assert, (x, "msg")),
        g.call_module("drop", (x,)),
    ]
    marked = g.call_function(torch.neg, (x,))
    marked.meta["impure"] = True
    dead = [g.call_function(torch.neg, (x,)), g.call_method("add", (x, 1)), g.call_function(torch.relu, (x,))]
    g.output(x)
    assert g.eliminate_dead_code() is True
    assert _names(g.nodes) == ["x", *(n.name for n in kept), marked.name, "output"]
    assert all(n._erased for n in dead)
    # a caller-supplied purity test overrides the default
    assert g.eliminate_dead_code(is_impure_node=lambda n: n.op in ("placeholder", "output")) is True
    assert _names(g.nodes) == ["x", "output"]


def test_dce_recurses_into_graph_module_children_referenced_by_get_attr() -> None:
    import fxdist as fx

    def sub(x):
        x.neg()  # dead
        return x + 1

    root = torch.nn.Module()
    root.child = fx.symbolic_trace(sub)
    g = Graph()
    x = g.placeholder("x")
    g.output((g.call_module("child", (x,)), g.get_attr("child")))
    gm = fx.GraphModule(root, g)
    assert [n.name for n in gm.child.graph.nodes] == ["x", "neg", "add", "output"]
    assert gm.graph.eliminate_dead_code() is True
    assert [n.name for n in gm.child.graph.nodes] == ["x", "add", "output"]
    assert "neg" not in gm.child.code
    torch.testing.assert_close(gm(torch.ones(2))[0], torch.full((2,), 2.0))


def test_dce_refuses_an_unordered_graph() -> None:
    g = _seed_7_3(Graph)
    x, y, add, relu, out = g.nodes
    relu.prepend(out)  # output before relu: relu is used before it is defined
    with pytest.raises(RuntimeError, match="before it has been defined"):
        g.eliminate_dead_code()


# -- printing and code -------------------------------------------------------------------------------


def test_print_tabular_columns(capsys) -> None:
    g = _seed_7_3(Graph)
    g.print_tabular()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["opcode", "name", "target", "args", "kwargs"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].split() == ["placeholder", "x", "x", "()", "{}"]
    assert lines[4].split()[:2] == ["call_function", "add"] and "(x, y)" in lines[4]
    assert lines[-1].split() == ["output", "output", "output", "(relu,)", "{}"]


def test_python_code_delegates_to_codegen() -> None:
    g = _seed_7_3(Graph)
    code = g.python_code("self")
    assert "def forward(self, x, y):" in code.src
    namespace = dict(code.globals)
    exec(code.src, namespace)
    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(namespace["forward"](None, x, y), torch.relu(x + y))


# -- property: random edit sequences agree with torch.fx ---------------------------------------------

_KINDS = ["add", "add", "add", "insert_before", "insert_after", "replace", "erase", "move", "set_args", "kwarg",
          "insert_arg"]
_EDITS = st.lists(st.tuples(st.sampled_from(_KINDS), st.integers(0, 1000), st.integers(0, 1000)),
                  min_size=4, max_size=30)


def _apply(G, edits):
    """Replay ``edits`` on a fresh graph of class ``G``; only edits that keep the graph valid apply."""
    g = G()
    g.placeholder("x"), g.placeholder("y")
    out = g.output(None)
    g.inserting_before(out)  # permanent insert point: just before the output
    fns = [torch.neg, operator.add, torch.relu]
    for kind, i, j in edits:
        order = [n for n in g.nodes if n.op != "output"]
        a, b = order[i % len(order)], order[j % len(order)]
        first, second = sorted((a, b), key=order.index)
        if kind == "add":
            g.call_function(fns[i % 3], (first, second) if i % 3 == 1 else (first,))
        elif kind in ("insert_before", "insert_after") and second.op != "placeholder" and first is not second:
            with g.inserting_before(second) if kind == "insert_before" else g.inserting_after(first):
                g.call_function(fns[j % 3], (first,))
        elif kind == "replace" and first is not second and second.op != "placeholder":
            second.replace_all_uses_with(first)
        elif kind == "erase" and not a.users and a.op != "placeholder":
            g.erase_node(a)
        elif kind == "move" and not b.users and b.op != "placeholder":
            out.prepend(b)
        elif kind == "set_args" and second.op == "call_function" and first is not second:
            second.args = (first,) * len(second.args)
        elif kind == "kwarg" and second.op == "call_function" and first is not second:
            second.update_kwarg(f"k{i % 2}", [first, {"n": first}])
        elif kind == "insert_arg" and second.op == "call_function" and first is not second:
            second.insert_arg(j % (len(second.args) + 1), first)
    out.args = (list(g.nodes)[-2],)
    return g


@settings(max_examples=100, deadline=None)
@given(_EDITS)
def test_random_edit_sequences_match_torch_fx_and_lint(edits) -> None:
    ours, theirs = _apply(Graph, edits), _apply(tfx.Graph, edits)
    assert str(ours) == str(theirs)
    assert [n._sort_key for n in ours.nodes] == [n._sort_key for n in theirs.nodes]
    ours.lint()
    assert sorted(reversed(list(ours.nodes))) == list(ours.nodes)
    for n in ours.nodes:
        for u in n.users:
            assert n in u.all_input_nodes
        if n.op == "call_function":  # the side table agrees with a scan
            assert ours.find_nodes(op=n.op, target=n.target) == [m for m in ours.nodes if m.target is n.target]
    assert ours.find_nodes(op="placeholder") == [m for m in ours.nodes if m.op == "placeholder"]


# -- pickling and code hooks ---------------------------------------------------------------------------


def test_pickle_round_trip_of_a_long_graph_without_recursion() -> None:
    import pickle

    g = Graph()
    x = g.placeholder("x")
    prev = x
    for i in range(2000):  # a naive pickle follows _next pointers and overflows the stack here
        prev = g.call_function(operator.add, (prev, x), {"k": [prev, (x, 1)]} if i % 7 == 0 else None)
    prev.meta["tag"] = "last"
    x.meta["view_of"] = prev                 # nodes inside meta, as passes store them
    x.meta["group"] = [prev, {"first": x}]
    dead = g.call_function(torch.neg, (x,))
    g.erase_node(dead)
    g.output(prev)
    g2 = pickle.loads(pickle.dumps(g))
    assert str(g2) == str(g) and len(g2.nodes) == 2002
    g2.lint()
    last = g2.output_node().args[0]
    assert last.meta == {"tag": "last"} and last.name == "add_1999"
    first = next(iter(g2.nodes))
    assert first.meta["view_of"] is last and first.meta["group"] == [last, {"first": first}]
    # the namespace survived: names continue where the original graph's would
    assert g2.call_function(torch.neg, (first,)).name == g.call_function(torch.neg, (x,)).name == "neg_1"
    assert g2.find_nodes(op="call_function", target=torch.neg)[0].graph is g2


def test_on_generate_code_installs_and_restores_a_body_transformer() -> None:
    g = _seed_7_3(Graph)

    def add_comment(body):
        return ["# transformed\n", *body]

    plain = g.python_code("self").src
    with g.on_generate_code(lambda current: add_comment):
        assert "# transformed" in g.python_code("self").src
    assert g.python_code("self").src == plain


def test_deepcopy_of_nodes_maps_into_one_copied_graph() -> None:
    g = Graph()
    x = g.placeholder("x")
    prev = x
    for _ in range(2000):  # a recursive copy along _prev/_next would overflow the stack
        prev = g.call_function(operator.add, (prev, x))
    out = g.output(prev)
    cx, cprev, cout = copy.deepcopy([x, prev, out])
    assert (cx.name, cprev.name, cout.name) == ("x", "add_1999", "output")
    assert cx.graph is cprev.graph is cout.graph and cx.graph is not g
    assert cprev.args == (cprev.prev, cx) and cout.args == (cprev,)
    assert str(cx.graph) == str(g)
    dead = g.call_function(torch.neg, (x,))
    g.erase_node(dead)
    with pytest.raises(RuntimeError, match="cannot deepcopy node neg: it is erased"):
        copy.deepcopy(dead)


def test_pickling_nodes_pickles_their_graph_once() -> None:
    import pickle

    g = Graph()
    x = g.placeholder("x")
    prev = x
    for _ in range(2000):
        prev = g.call_function(operator.add, (prev, x))
    g.output(prev)
    px, pprev = pickle.loads(pickle.dumps([x, prev]))
    assert (px.name, pprev.name) == ("x", "add_1999") and px.graph is pprev.graph is not g
    assert pprev.args[1] is px and str(px.graph) == str(g)
    shallow = copy.copy(x)
    assert shallow is not x and shallow.name == "x" and shallow.graph is g
