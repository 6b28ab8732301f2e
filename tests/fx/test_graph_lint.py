"""Graph.lint: each of the five checks of torch.fx's ``Graph.lint`` (torch/fx/graph.py) catches a graph broken
in exactly that way, and the error names the node, keeps torch.fx's key phrase, suggests a fix and shows the marked graph."""

from __future__ import annotations

import operator

import pytest
import torch

from fxdist.graph import Graph
from fxdist.node import Node


def _graph(owner=None):
    g = Graph(owning_module=owner)
    x = g.placeholder("x")
    y = g.placeholder("y")
    add = g.call_function(operator.add, (x, y))
    add_1 = g.call_function(operator.add, (add, x))
    g.output(add_1)
    return g, x, y, add, add_1


def _note(err: pytest.ExceptionInfo) -> str:
    return "\n".join(getattr(err.value, "__notes__", []))


def test_clean_graph_lints() -> None:
    g, *_ = _graph()
    g.lint()


def test_check_1_illegal_opcode() -> None:
    g, x, y, add, add_1 = _graph()
    add.op = "call_fn"
    with pytest.raises(RuntimeError, match=r"Graph.lint: %add \(call_fn\[target=operator.add\]\) had unknown "
                                           r"opcode 'call_fn'\. Set node.op to one of \['placeholder'") as err:
        g.lint()
    assert "  >>> %add : " in _note(err)


def test_check_2_node_from_another_graph() -> None:
    g, x, y, add, add_1 = _graph()
    other = Graph()
    add.graph = other  # a node whose owner is another graph, still linked here
    with pytest.raises(RuntimeError, match=r"%add \(call_function\[target=operator.add\]\) does not belong "
                                           r"to this Graph.*node_copy") as err:
        g.lint()
    assert "  >>> %add : [num_users=1]" in _note(err)


def test_check_2_argument_from_another_graph_message_and_note() -> None:
    g, x, y, add, add_1 = _graph()
    other = Graph()
    w = other.placeholder("w")
    add_1.args = (x, w)
    with pytest.raises(RuntimeError) as err:
        g.lint()
    assert str(err.value) == (
        "Graph.lint: %add_1 (call_function[target=operator.add]) uses %w, which belongs to another graph "
        "(it does not belong to this Graph). If you copied nodes from another graph, pass arg_transform= to "
        "node_copy() to remap its inputs.")
    assert _note(err).splitlines() == [
        "graph with the offending node marked:",
        "      %x : [num_users=2] = placeholder[target=x]",
        "      %y : [num_users=1] = placeholder[target=y]",
        "      %add : [num_users=0] = call_function[target=operator.add](args = (%x, %y), kwargs = {})",
        "  >>> %add_1 : [num_users=1] = call_function[target=operator.add](args = (%x, %w), kwargs = {})",
        "      return add_1",
    ]


def test_check_2_node_copy_without_arg_transform_is_caught() -> None:
    src, *_ = _graph()
    dst = Graph()
    for n in src.nodes:
        dst.node_copy(n)  # forgot arg_transform: the copies use src's nodes
    with pytest.raises(RuntimeError, match=r"%add \(call_function.*uses %x, which belongs to another graph"):
        dst.lint()


def test_check_3_topological_order() -> None:
    g, x, y, add, add_1 = _graph()
    x.prepend(add_1)  # add_1 now comes before everything it uses
    with pytest.raises(RuntimeError, match=r"%add_1 \(call_function\[target=operator.add\]\) uses %add before "
                                           r"it is defined \(Argument 'add' was used before it has been "
                                           r"defined\)\. Keep nodes topologically ordered") as err:
        g.lint()
    assert _note(err).splitlines()[1].startswith("  >>> %add_1")


def test_check_3_input_was_erased() -> None:
    g, x, y, add, add_1 = _graph()
    dead = g.call_function(torch.neg, (x,))
    g.erase_node(dead)
    add_1.args = (add, dead)  # points at an erased node
    with pytest.raises(RuntimeError, match=r"%add_1 .* uses %neg, which was erased"):
        g.lint()


def test_check_4_unique_names() -> None:
    g, x, y, add, add_1 = _graph()
    add_1.name = "add"
    with pytest.raises(RuntimeError, match=r"%add \(call_function.*Node redefined name add\. Names must be "
                                           r"unique") as err:
        g.lint()
    marked = [line for line in _note(err).splitlines() if line.startswith("  >>>")]
    assert marked == ["  >>> %add : [num_users=1] = call_function[target=operator.add](args = (%add, %x), "
                      "kwargs = {})"]


def test_check_5_targets_reachable_in_owning_module() -> None:
    root = torch.nn.Module()
    root.sub = torch.nn.Module()
    root.sub.lin = torch.nn.Linear(2, 2)
    root.register_buffer("buf", torch.zeros(2))
    g, x, y, add, add_1 = _graph(root)
    with g.inserting_before(add):
        g.get_attr("sub.lin.weight")
        g.get_attr("buf")
        g.call_module("sub.lin", (x,))
    g.lint()

    with pytest.warns(UserWarning):
        with g.inserting_before(add):
            bad = g.get_attr("sub.nope.weight")
    with pytest.raises(RuntimeError, match=r"%sub_nope_weight \(get_attr\[target=sub.nope.weight\]\) target "
                                           r"sub.nope.weight references nonexistent attribute nope of sub"):
        g.lint()
    g.erase_node(bad)

    with g.inserting_before(add):
        g.create_node("call_module", "buf", (x,))  # a tensor, not a module
    with pytest.raises(RuntimeError, match=r"target buf: buf of the root module does not reference an "
                                           r"nn.Module"):
        g.lint()


def test_check_5_skipped_without_owning_module() -> None:
    g, x, *_ = _graph()
    with g.inserting_after(x):
        g.get_attr("does.not.exist")
    g.lint()


def test_args_well_formed_and_use_def_consistent() -> None:
    g, x, y, add, add_1 = _graph()
    add._args = (x, x)  # bypassed the setter: users/all_input_nodes are stale
    with pytest.raises(RuntimeError, match=r"%add .* stale use-def data.*assign node.args"):
        g.lint()
    add.args = (x, y)
    g.lint()

    y.users[add_1] = None  # a user that does not use it
    with pytest.raises(RuntimeError, match=r"%y .* lists %add_1 as a user, but %add_1 does not use it"):
        g.lint()
    del y.users[add_1]

    add._args = [x, y]
    with pytest.raises(RuntimeError, match=r"%add .* args of type list, not a tuple"):
        g.lint()
    add.args = (x, y)

    add._target = "add"  # a str target for call_function
    with pytest.raises(RuntimeError, match=r"target 'add' of type str but a Callable is expected"):
        g.lint()


def test_node_not_created_through_graph_is_caught() -> None:
    g, x, y, add, add_1 = _graph()
    stray = Node(g, "stray", "call_function", torch.neg, (x,), {})
    add_1.prepend(stray)  # linked in, but never registered in the find_nodes table
    with pytest.raises(RuntimeError, match=r"%stray .* not added to the side table.*create_node"):
        g.lint()
