"""Interpreter and Transformer, differential against torch.fx and eager."""

from __future__ import annotations

import doctest
import inspect
import operator

import pytest
import torch
import torch.fx

import fxdist as fx
import fxdist.interpreter as interpreter_module


class Net(torch.nn.Module):
    """Uses all six opcodes: placeholder, get_attr, call_function, call_method, call_module, output."""

    def __init__(self) -> None:
        super().__init__()
        self.param = torch.nn.Parameter(torch.rand(3, 4))
        self.linear = torch.nn.Linear(4, 5)

    def forward(self, x):
        return self.linear(x + self.param).clamp(min=0.0, max=1.0).neg().sigmoid()


def _graph_signature(graph):
    return [(n.op, str(n.target), str(n.args), str(n.kwargs)) for n in graph.nodes]


@pytest.fixture
def net():
    torch.manual_seed(0)
    return Net()


def test_run_matches_eager_and_torch_fx(net):
    x = torch.randn(3, 4)
    gm = fx.symbolic_trace(net)
    ours = fx.Interpreter(gm).run(x)
    theirs = torch.fx.Interpreter(torch.fx.symbolic_trace(net)).run(x)
    torch.testing.assert_close(ours, net(x))
    torch.testing.assert_close(ours, theirs)


def test_neg_sigmoid_swap_interpreter():
    gm = fx.symbolic_trace(lambda x: torch.sigmoid(x).neg())
    x = torch.randn(3, 4)
    torch.testing.assert_close(neg_sigmoid_swap(fx.Interpreter)(gm).run(x), torch.neg(x).sigmoid())


def test_values_freed_after_last_use():
    def chain(x):
        y = x
        for _ in range(10):
            y = torch.relu(y + 1)
        return y

    gm = fx.symbolic_trace(chain)
    sizes = []

    class Recording(fx.Interpreter):
        def run_node(self, n):
            sizes.append(len(self.env))
            return super().run_node(n)

    interp = Recording(gm)
    out = interp.run(torch.randn(5))
    assert max(sizes) <= 2  # the current node's single live input, plus at most one more
    assert list(interp.env) == [gm.graph.find_nodes(op="output")[0]]
    assert interp.env[list(interp.env)[0]] is out

    sizes.clear()
    keep = Recording(gm, garbage_collect_values=False)
    keep.run(torch.randn(5))
    assert len(keep.env) == len(gm.graph.nodes) and max(sizes) == len(gm.graph.nodes) - 1


def test_value_used_late_is_kept_until_its_last_use():
    gm = fx.symbolic_trace(lambda x: torch.relu(x) + torch.sigmoid(x) * x)
    x = torch.randn(4)
    assert torch.equal(fx.Interpreter(gm).run(x), torch.relu(x) + torch.sigmoid(x) * x)


def test_error_note_names_node_and_stack_trace():
    def bad(x, y):
        z = x * 2
        return z + y

    gm = fx.symbolic_trace(bad)
    add = gm.graph.find_nodes(op="call_function", target=operator.add)[0]
    add.meta["stack_trace"] = '  File "models/bad.py", line 3, in bad\n    return z + y'
    with pytest.raises(RuntimeError, match="must match the size") as info:
        fx.Interpreter(gm).run(torch.randn(3), torch.randn(4))
    notes = "\n".join(info.value.__notes__)
    assert "While executing %add : [num_users=1] = call_function[target=operator.add](args = (%mul, %y)" in notes
    assert 'File "models/bad.py", line 3' in notes


def test_initial_env_partial_evaluation():
    gm = fx.symbolic_trace(lambda x: torch.relu(x) * 3)
    relu = gm.graph.find_nodes(op="call_function", target=torch.relu)[0]
    out = fx.Interpreter(gm).run(torch.full((2,), -5.0), initial_env={relu: torch.ones(2)})
    assert torch.equal(out, torch.full((2,), 3.0))  # relu was not executed


def test_boxed_run_clears_inputs_and_checks_count():
    gm = fx.symbolic_trace(lambda x, y: x - y)
    args = [torch.ones(2), torch.ones(2) * 3]
    assert torch.equal(fx.Interpreter(gm).boxed_run(args), torch.full((2,), -2.0))
    assert args == []
    with pytest.raises(RuntimeError, match=r"expected 2 arguments for placeholders but received 1 \(missing arguments\)"):
        fx.Interpreter(gm).boxed_run([torch.ones(2)])


def test_placeholder_defaults_and_missing_args():
    def f(x, scale=3.0):
        return x * scale

    gm = fx.symbolic_trace(f)
    assert torch.equal(fx.Interpreter(gm).run(torch.ones(2)), torch.full((2,), 3.0))
    assert torch.equal(fx.Interpreter(gm).run(torch.ones(2), 5.0), torch.full((2,), 5.0))
    with pytest.raises(RuntimeError, match="Expected positional argument for parameter x"):
        fx.Interpreter(gm).run()


def test_fetch_attr_names_missing_path(net):
    gm = fx.symbolic_trace(net)
    interp = fx.Interpreter(gm)
    assert interp.fetch_attr("linear.weight") is gm.linear.weight
    with pytest.raises(RuntimeError, match="nonexistent target linear.nope"):
        interp.fetch_attr("linear.nope")


def test_graph_argument_overrides_module_graph(net):
    gm = fx.symbolic_trace(net)
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_module("linear", (x,)))
    inp = torch.randn(2, 4)
    torch.testing.assert_close(fx.Interpreter(gm, graph=g).run(inp), net.linear(inp))


# ---- Transformer -------------------------------------------------------------------------------


def neg_sigmoid_swap(base):
    """The torch.fx documentation's Interpreter example, as a subclass of ``base`` (fxdist's or torch.fx's
    Interpreter/Transformer)."""

    class NegSigmSwap(base):
        def call_function(self, target, args, kwargs):
            if target is torch.sigmoid:
                return torch.neg(*args, **kwargs)
            return super().call_function(target, args, kwargs)

        def call_method(self, target, args, kwargs):
            if target == "neg":
                call_self, *args_tail = args
                return call_self.sigmoid(*args_tail, **kwargs)
            return super().call_method(target, args, kwargs)

    return NegSigmSwap


def relu_to_gelu(base):
    """The torch.fx paper's Figure 2 rewrite (relu -> gelu), as a Transformer subclass."""

    class ToGelu(base):
        def call_function(self, target, args, kwargs):
            if target in (torch.relu, torch.nn.functional.relu):
                return torch.nn.functional.gelu(args[0])
            return super().call_function(target, args, kwargs)

    return ToGelu


def test_neg_sigmoid_swap_transformer_same_as_torch_fx():
    fn = lambda x: torch.sigmoid(x).neg()  # noqa: E731
    ours = neg_sigmoid_swap(fx.Transformer)(fx.symbolic_trace(fn)).transform()
    theirs = neg_sigmoid_swap(torch.fx.Transformer)(torch.fx.symbolic_trace(fn)).transform()
    assert str(ours.graph) == str(theirs.graph)
    assert ours.code == theirs.code
    x = torch.randn(3, 4)
    torch.testing.assert_close(ours(x), torch.neg(x).sigmoid())
    ours.graph.lint()


def test_identity_transform_preserves_graph_and_state(net):
    gm = fx.symbolic_trace(net)
    gm.graph.find_nodes(op="call_module")[0].meta["stack_trace"] = "File x.py, line 1"
    out = fx.Transformer(gm).transform()
    assert _graph_signature(out.graph) == _graph_signature(gm.graph)
    assert [n.name for n in out.graph.nodes] == [n.name for n in gm.graph.nodes]
    assert out.linear is gm.linear and out.param is gm.param
    assert out.graph.find_nodes(op="call_module")[0].meta["stack_trace"] == "File x.py, line 1"
    x = torch.randn(3, 4)
    torch.testing.assert_close(out(x), net(x))


def test_transformer_keeps_placeholder_defaults():
    def f(x, scale=2.5):
        return x * scale

    out = fx.Transformer(fx.symbolic_trace(f)).transform()
    placeholders = out.graph.find_nodes(op="placeholder")
    assert [(p.name, p.args) for p in placeholders] == [("x", ()), ("scale", (2.5,))]
    assert torch.equal(out(torch.ones(2)), torch.full((2,), 2.5))
    assert inspect.signature(out.forward).parameters["scale"].default == 2.5


def test_relu_to_gelu_transformer_matches_torch_fx():
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x).sum(dim=0) + torch.nn.functional.relu(x).mean()

    ours = relu_to_gelu(fx.Transformer)(fx.symbolic_trace(M())).transform()
    theirs = relu_to_gelu(torch.fx.Transformer)(torch.fx.symbolic_trace(M())).transform()
    assert _graph_signature(ours.graph) == _graph_signature(theirs.graph)
    x = torch.randn(4, 3)
    torch.testing.assert_close(ours(x), theirs(x))
    torch.testing.assert_close(ours(x), torch.nn.functional.gelu(x).sum(dim=0) + torch.nn.functional.gelu(x).mean())


def test_docstring_examples():
    result = doctest.testmod(interpreter_module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_transformer_override_may_use_parameters_and_constants(net):
    class AddBias(fx.Transformer):
        def call_module(self, target, args, kwargs):
            out = super().call_module(target, args, kwargs)
            return out + self.module.linear.bias + torch.ones(5)  # a parameter and a plain tensor

    gm = fx.symbolic_trace(net)
    out = AddBias(gm).transform()
    get_attrs = [n.target for n in out.graph.nodes if n.op == "get_attr"]
    assert get_attrs == ["param", "linear.bias", "_tensor_constant0"]
    x = torch.randn(3, 4)
    expected = (net.linear(x + net.param) + net.linear.bias + 1).clamp(min=0.0, max=1.0).neg().sigmoid()
    torch.testing.assert_close(out(x), expected)
    out.graph.lint()


def test_random_programs_interpret_like_generated_code():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    ops = [(operator.add, 2), (operator.mul, 2), (torch.relu, 1), (torch.tanh, 1), (torch.maximum, 2)]
    step = st.tuples(st.integers(0, len(ops) - 1), st.integers(0, 40), st.integers(0, 40))

    @settings(max_examples=25, deadline=None, database=None)
    @given(st.lists(step, min_size=1, max_size=15), st.integers(1, 3), st.lists(st.integers(0, 40), min_size=1, max_size=3))
    def check(program, n_inputs, outputs):
        graph = fx.Graph()
        values = [graph.placeholder(f"x{i}") for i in range(n_inputs)]
        for op_index, a, b in program:
            fn, arity = ops[op_index]
            values.append(graph.call_function(fn, (values[a % len(values)], values[b % len(values)])[:arity]))
        graph.output(tuple(values[o % len(values)] for o in outputs))
        gm = fx.GraphModule(torch.nn.Module(), graph)
        inputs = [torch.randn(4) for _ in range(n_inputs)]
        interp = fx.Interpreter(gm)
        result = interp.run(*inputs)
        torch.testing.assert_close(result, gm(*inputs), equal_nan=True)  # long mul chains can reach inf * 0
        assert list(interp.env) == [graph.find_nodes(op="output")[0]]  # everything else was freed

    check()


def test_star_args_placeholder_takes_the_remaining_inputs():
    graph = fx.Graph()
    _first, rest = graph.placeholder("x"), graph.placeholder("*args")
    graph.output(graph.call_function(torch.stack, (rest,)))
    assert rest.target == "*args"
    out = fx.Interpreter(torch.nn.Module(), graph=graph).run(torch.zeros(2), torch.ones(2), torch.ones(2) * 2)
    assert torch.equal(out, torch.tensor([[1.0, 1.0], [2.0, 2.0]]))
