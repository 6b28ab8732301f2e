"""Node: opcode/target rules, immutable args, use-def tracking, list moves, printing, purity.

Differential: the same operations on ``torch.fx`` nodes give the same args, users and printed lines.
"""

from __future__ import annotations

import collections
import operator

import pytest
import torch
import torch.fx as tfx
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.node import map_aggregate as torch_map_aggregate

import fxdist as fx
from fxdist.graph import Graph
from fxdist.node import Node, has_side_effect, immutable_dict, immutable_list, map_aggregate, map_arg

Pair = collections.namedtuple("Pair", "a b")


def _names(nodes) -> list[str]:
    return [n.name for n in nodes]


# -- opcode and target rules -------------------------------------------------------------------------


@pytest.mark.parametrize("G", [Graph, tfx.Graph])
def test_call_function_needs_callable_target_naming_the_node(G) -> None:
    g = G()
    with pytest.raises(ValueError, match=r"name = 'f'.*Callable is expected"):
        g.create_node("call_function", "relu", name="f")


@pytest.mark.parametrize("op", ["placeholder", "get_attr", "call_method", "call_module", "output"])
def test_other_ops_need_str_target(op: str) -> None:
    for G in (Graph, tfx.Graph):
        with pytest.raises(ValueError, match=r"name = 'bad'.*a str is expected"):
            G().create_node(op, torch.relu, name="bad")


def test_unknown_op_is_value_error_and_assertion_error() -> None:
    g = Graph()
    with pytest.raises(ValueError, match=r"'jump' is not one of the six opcodes"):
        g.create_node("jump", "x")
    with pytest.raises(AssertionError):  # what torch.fx code expects
        g.create_node("jump", "x")
    assert len(g.nodes) == 0


def test_exported_from_package() -> None:
    assert fx.Node is Node and fx.Graph is Graph and fx.map_arg is map_arg


# -- args/kwargs storage -----------------------------------------------------------------------------

SAMPLES = [
    (1, 2.5, "s", None, True, 3j, ..., torch.float16, torch.device("cpu"), torch.channels_last, torch.strided),
    [1, [2, (3, {"k": [4]})]],
    {"a": (1, 2), "b": [slice(1, None, 2)]},
    Pair(1, [2]),
    torch.Size([2, 3]),
    (range(3), slice(None)),
]


@pytest.mark.parametrize("value", SAMPLES, ids=range(len(SAMPLES)))
def test_map_aggregate_same_structure_and_types_as_torch_fx(value) -> None:
    def shape(v):
        if isinstance(v, (tuple, list)):
            return (type(v).__name__, [shape(x) for x in v])
        if isinstance(v, dict):
            return (type(v).__name__, {k: shape(x) for k, x in v.items()})
        return v

    ours = map_aggregate(value, lambda v: v)
    theirs = torch_map_aggregate(value, lambda v: v)
    assert shape(ours) == shape(theirs)
    assert ours == theirs


_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=3), st.floats(allow_nan=False),
                    st.sampled_from([torch.float32, torch.device("cpu"), Ellipsis, range(2)]))
_NESTED = st.recursive(_LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.tuples(inner, inner), st.dictionaries(st.text(max_size=2), inner, max_size=3),
    st.builds(Pair, inner, inner), st.builds(slice, inner, inner)), max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(_NESTED)
def test_map_aggregate_random_structures_like_torch_fx(value) -> None:
    def bump(v):
        return v + 1 if type(v) is int else v

    def shape(v):
        if isinstance(v, (tuple, list)):
            return (type(v).__name__, [shape(x) for x in v])
        if isinstance(v, dict):
            return (type(v).__name__, {k: shape(x) for k, x in v.items()})
        if isinstance(v, slice):
            return ("slice", shape(v.start), shape(v.stop), shape(v.step))
        return v

    assert shape(map_aggregate(value, bump)) == shape(torch_map_aggregate(value, bump))


def test_map_arg_only_touches_nodes() -> None:
    g = Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    mapped = map_arg((x, [1, {"k": y}], slice(x, 2)), lambda n: n.name)
    assert mapped == ("x", [1, {"k": "y"}], slice("x", 2, None))
    with pytest.raises(AssertionError, match="fn must be a callable"):
        map_arg((x,), "not callable")


def test_args_are_immutable_both_ways_torch_fx_raised() -> None:
    g = Graph()
    x = g.placeholder("x")
    n = g.call_function(torch.cat, ([x, x],), {"dim": 0})
    assert type(n.args[0]) is immutable_list and type(n.kwargs) is immutable_dict
    for mutate in (lambda: n.args[0].append(x), lambda: n.args[0].__setitem__(0, x),
                   lambda: n.kwargs.update(dim=1), lambda: n.kwargs.__setitem__("dim", 1), lambda: n.kwargs.pop("dim")):
        with pytest.raises(TypeError, match="does not support mutation"):
            mutate()
        with pytest.raises(NotImplementedError):
            mutate()
    assert n.args[0] == [x, x] and n.kwargs == {"dim": 0}
    assert hash(n.args[0]) == hash((x, x))


def test_namedtuple_args_keep_their_type() -> None:
    g = Graph()
    x = g.placeholder("x")
    n = g.call_function(operator.getitem, (Pair(x, 1), 0))
    assert type(n.args[0]) is Pair and n.args[0].a is x
    assert n.all_input_nodes == [x]


# -- use-def tracking --------------------------------------------------------------------------------


def test_seed_001_section_6_4_use_def_updates() -> None:
    graph = Graph()
    x = graph.placeholder("x")
    y = graph.placeholder("y")
    add = graph.call_function(torch.add, (x, y))
    assert add.all_input_nodes == [x, y]
    assert x.users == {add: None} and y.users == {add: None}
    z = graph.placeholder("z")
    add.args = (x, z)
    assert add.all_input_nodes == [x, z]
    assert y.users == {}
    assert z.users == {add: None}


def test_all_input_nodes_first_appearance_order_args_then_kwargs() -> None:
    g = Graph()
    a, b, c = (g.placeholder(s) for s in "abc")
    n = g.call_function(torch.add, (b, [a, b]), {"out": c, "k": (a,)})
    assert n.all_input_nodes == [b, a, c]
    n.kwargs = {}
    assert n.all_input_nodes == [b, a] and c.users == {}
    n.args = ()
    assert not a.users and not b.users


def _pair_graphs():
    """The same small graph in torch.fx and fxdist: x, y, z placeholders and n = add(x, y)."""
    out = []
    for G in (Graph, tfx.Graph):
        g = G()
        x, y, z = g.placeholder("x"), g.placeholder("y"), g.placeholder("z")
        n = g.call_function(torch.add, (x, y), {"alpha": 1})
        out.append((g, x, y, z, n))
    return out


@pytest.mark.parametrize("edit", [
    lambda x, y, z, n: n.update_arg(1, z),
    lambda x, y, z, n: n.update_arg(0, [y, z]),
    lambda x, y, z, n: n.insert_arg(0, z),
    lambda x, y, z, n: n.insert_arg(2, x),
    lambda x, y, z, n: n.update_kwarg("alpha", z),
    lambda x, y, z, n: n.update_kwarg("other", (x, z)),
    lambda x, y, z, n: n.replace_input_with(x, z),
    lambda x, y, z, n: setattr(n, "kwargs", {"out": y}),
], ids=["update_arg", "update_arg_list", "insert_arg_front", "insert_arg_dup", "update_kwarg",
        "update_kwarg_new", "replace_input_with", "set_kwargs"])
def test_edits_keep_users_exact_like_torch_fx(edit) -> None:
    (g, *ours), (tg, *theirs) = _pair_graphs()
    edit(*ours)
    edit(*theirs)
    assert str(g) == str(tg)
    for a, b in zip(ours, theirs):
        assert _names(a.users) == _names(b.users)
        # same set as torch.fx; the order is first appearance in args then kwargs (torch.fx's
        # insert_arg appends new inputs at the end instead, contradicting its own docstring)
        assert set(_names(a.all_input_nodes)) == set(_names(b.all_input_nodes))
        appearance: list[Node] = []
        # B023: map_arg calls the lambda right here, in this iteration
        map_arg((a.args, a.kwargs), lambda v: appearance.append(v) if v not in appearance else None)  # noqa: B023
        assert a.all_input_nodes == appearance
    g.lint()


def test_insert_arg_rejects_bad_index() -> None:
    (g, x, y, z, n), _ = _pair_graphs()
    with pytest.raises(AssertionError, match=r"got 5 \(node add\)"):
        n.insert_arg(5, z)


def test_replace_all_uses_with_callback_and_meta() -> None:
    g = Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.neg, (x,))
    b = g.call_function(torch.relu, (a,))
    c = g.call_function(torch.sin, (a,), {"k": a})
    new = g.call_function(torch.cos, (x,))
    a.meta["val"] = 1
    changed = a.replace_all_uses_with(new, delete_user_cb=lambda u: u is not b, propagate_meta=True)
    assert changed == [c]
    assert c.args == (new,) and c.kwargs == {"k": new}
    assert _names(a.users) == ["relu"] and _names(new.users) == ["sin"]
    assert new.meta == {"val": 1}
    with pytest.raises(AssertionError, match="already has .meta keys"):
        a.replace_all_uses_with(new, propagate_meta=True)
    assert a.replace_all_uses_with(new) == [b] and not a.users


# -- linked list -------------------------------------------------------------------------------------


def test_prev_next_and_moving_an_existing_node() -> None:
    for G in (Graph, tfx.Graph):
        g = G()
        x, y = g.placeholder("x"), g.placeholder("y")
        a = g.call_function(torch.add, (x, y))
        b = g.call_function(torch.mul, (x, y))
        out = g.output(b)
        assert x.next is y and y.prev is x and out.next is g._root and x.prev is g._root
        a.append(b)        # no-op move: b is already after a
        x.prepend(b)       # move b to the front
        assert _names(g.nodes) == ["mul", "x", "y", "add", "output"]
        out.prepend(b)
        assert _names(g.nodes) == ["x", "y", "add", "mul", "output"]
        assert len(g.nodes) == 5


def test_moving_node_across_graphs_is_refused() -> None:
    g1, g2 = Graph(), Graph()
    a, b = g1.placeholder("a"), g2.placeholder("b")
    with pytest.raises(ValueError, match="another graph"):
        a.prepend(b)


def _insert_pattern(G):
    g = G()
    x = g.placeholder("x")
    out = g.output(x)
    prev = x
    for i in range(100):  # same-gap inserts at both ends and in the middle
        with g.inserting_before(out):
            prev = g.call_function(torch.neg, (prev,))
        with g.inserting_after(x):
            g.call_function(torch.sin, (x,))
        with g.inserting_before(x):
            g.placeholder(f"p{i}")
    return g


def test_sort_keys_follow_position_and_equal_torch_fx_keys() -> None:
    g, tg = _insert_pattern(Graph), _insert_pattern(tfx.Graph)
    nodes = list(g.nodes)
    assert [n._sort_key for n in nodes] == [n._sort_key for n in tg.nodes]
    assert sorted(reversed(nodes)) == nodes
    assert all(a < b and b > a and a <= b and not a >= b for a, b in zip(nodes, nodes[1:]))
    assert g.find_nodes(op="call_function", target=torch.neg) == [n for n in nodes if n.target is torch.neg]


@pytest.mark.parametrize("before,after", [
    ((1, 0, 5), (1, 2, 0)), ((1, 0, 5), (1, 2)), ((1,), (1, 2, 0)), ((1, 1), (1, 2, 0)), ((1, 1), (1, 3)),
    ((1, 1, 7), (1, 2)), ((1,), (3,)), ((1, 5), (3, 1)), ((1, 5), (1, 7, 2, 3)), ((1,), (1, 0, 3)),
    ((0,), (1, -5)),
])
def test_sort_key_between_neighbours_like_torch_fx(before, after) -> None:
    keys = []
    for G in (Graph, tfx.Graph):
        g = G()
        a, b = g.placeholder("a"), g.placeholder("b")
        a._sort_key, b._sort_key = before, after
        with g.inserting_before(b):
            keys.append(g.placeholder("n")._sort_key)
    assert keys[0] == keys[1]
    assert before < keys[0] < after


# -- printing ----------------------------------------------------------------------------------------


def _all_formats(G) -> list[str]:
    g = G()
    x = g.placeholder("x", type_expr=torch.Tensor)
    d = g.placeholder("d", default_value=None)
    w = g.get_attr("sub.w")
    a = g.call_function(torch.add, (x, w), {"alpha": 2.0})
    m = g.call_method("view", (a, torch.Size([1, -1]), [d, (1,)]), type_expr=int)
    c = g.call_module("sub.lin", (m,), {"k": {"a": d}})
    f = g.call_function(len, (c,))
    s = g.call_function(operator.getitem, (f, slice(None, 2)))
    g.call_function(torch.ops.aten.add.Tensor, (s, torch.float32, torch.device("cpu")))
    g.output((s, {"o": a}), type_expr=tuple)
    return [n.format_node() for n in g.nodes] + [str(g)]


def test_format_node_and_str_match_torch_fx() -> None:
    assert _all_formats(Graph) == _all_formats(tfx.Graph)


def test_format_node_with_tensor_metadata_matches_torch_fx() -> None:
    lines = []
    for G in (Graph, tfx.Graph):
        g = G()
        n = g.call_function(torch.relu, (g.placeholder("x"),))
        n.meta["val"] = torch.zeros(2, 3).t()
        lines.append(n.format_node(include_tensor_metadata=True))
    assert lines[0] == lines[1]
    assert lines[0].startswith('%relu : Tensor "f32[3, 2][1, 3]cpu"[num_users=0]')


def test_repr_is_name_unless_overridden_and_stack_trace_property() -> None:
    g = Graph()
    x = g.placeholder("x")
    assert repr(x) == "x" and x.stack_trace is None
    x.stack_trace = 'File "m.py", line 3'
    assert x.meta["stack_trace"] == 'File "m.py", line 3' == x.stack_trace
    x._repr_fn = lambda n: f"<{n.name}>"
    assert repr(x) == "<x>"


def test_pretty_print_target() -> None:
    assert Node._pretty_print_target("a.b") == "a.b"
    assert Node._pretty_print_target(operator.add) == "operator.add"
    assert Node._pretty_print_target(getattr) == "builtins.getattr"
    assert Node._pretty_print_target(torch.relu) == "torch.relu"
    assert Node._pretty_print_target(torch.Tensor.add) == "torch.Tensor.add"
    assert Node._pretty_print_target(F.gelu) == "torch._C._nn.gelu"  # as torch.fx prints it
    assert Node._pretty_print_target(F.dropout) == "torch.nn.functional.dropout"
    assert Node._pretty_print_target(torch.ops.aten.mm.default) == "torch.ops.aten.mm.default"


# -- purity ------------------------------------------------------------------------------------------


def _node(op: str, target, args=(), kwargs=None, owner=None) -> Node:
    g = Graph(owning_module=owner)
    x = g.placeholder("x")
    return g.create_node(op, target, (x, *args), kwargs)


def test_is_impure_rules() -> None:
    import torch.distributed.rpc as rpc  # test only: the IR itself never imports torch.distributed

    pure = [("call_function", torch.add), ("call_function", operator.add), ("call_method", "add"),
            ("call_function", torch.ops.aten.add.Tensor), ("call_function", F.relu)]
    impure = [("call_function", torch._assert), ("call_function", operator.setitem),
              ("call_method", "add_"), ("call_method", "copy_"), ("call_function", torch.relu_),
              ("call_function", torch.ops.aten.add_.Tensor), ("call_function", rpc.rpc_sync),
              ("call_function", rpc.rpc_async), ("call_function", rpc.remote),
              ("call_function", torch.rand), ("call_function", torch.ops.aten.rand.default),
              ("call_function", torch.ops.aten.bernoulli.default), ("call_method", "bernoulli")]
    assert [t for op, t in pure if _node(op, t).is_impure()] == []
    assert [t for op, t in impure if not _node(op, t).is_impure()] == []
    assert not _node("call_function", torch.ops.aten.bernoulli.default).is_impure(impure_random=False)


def test_is_impure_dropout_depends_on_training() -> None:
    assert _node("call_function", F.dropout).is_impure()          # training defaults to True
    assert _node("call_function", F.dropout, (0.5, False)).is_impure() is False
    assert _node("call_function", F.dropout, (), {"training": False}).is_impure() is False
    assert _node("call_function", F.dropout, (), {"training": True}).is_impure()
    assert _node("call_function", torch.dropout, (0.1, True)).is_impure()
    assert not _node("call_function", torch.dropout, (0.1, False)).is_impure()


def test_is_impure_call_module_and_meta_and_registry() -> None:
    owner = torch.nn.Module()
    owner.drop = torch.nn.Dropout(0.5)
    owner.lin = torch.nn.Linear(2, 2)
    assert _node("call_module", "drop", owner=owner).is_impure()
    owner.eval()
    assert not _node("call_module", "drop", owner=owner).is_impure()
    assert not _node("call_module", "lin", owner=owner).is_impure()
    owner.lin._is_impure = True
    assert _node("call_module", "lin", owner=owner).is_impure()

    n = _node("call_function", torch.add)
    assert not n.is_impure()
    n.meta["impure"] = True
    assert n.is_impure()

    def log_value(v):
        return v

    assert not _node("call_function", log_value).is_impure()
    assert has_side_effect(log_value) is log_value
    assert _node("call_function", log_value).is_impure()
    g = Graph()
    assert g.placeholder("p").is_impure() and g.output(None).is_impure()


def test_immutable_containers_are_pytree_nodes() -> None:
    import torch.utils._pytree as pytree

    value = immutable_dict(a=immutable_list([1, 2]), b=3)
    leaves, spec = pytree.tree_flatten(value)
    assert leaves == [1, 2, 3]
    rebuilt = pytree.tree_unflatten([10, 20, 30], spec)
    assert rebuilt == {"a": [10, 20], "b": 30}
    assert type(rebuilt) is immutable_dict and type(rebuilt["a"]) is immutable_list
    assert [path for path, _ in pytree.tree_flatten_with_path(value)[0]][0] == (
        pytree.MappingKey("a"), pytree.SequenceKey(0))


def test_docstring_examples() -> None:
    import doctest

    import fxdist._namespace
    import fxdist.graph
    import fxdist.node

    for module in (fxdist.node, fxdist.graph, fxdist._namespace):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__
