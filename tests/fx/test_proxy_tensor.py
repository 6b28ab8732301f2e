"""fxdist.make_fx against torch.fx's make_fx: same ATen nodes (op, target, args, names), same outputs."""

from __future__ import annotations

import operator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.func import functionalize
from torch.fx.experimental.proxy_tensor import make_fx as torch_make_fx
from torch.utils import _pytree as pytree

import fxdist
from fxdist.experimental.proxy_tensor import make_fx
from fxdist.graph_module import GraphModule

aten = torch.ops.aten


def _norm(arg):
    """Arguments with nodes replaced by ("%", name), so graphs from both IRs compare equal."""
    if hasattr(arg, "op") and hasattr(arg, "graph") and hasattr(arg, "users"):
        return ("%", arg.name)
    if isinstance(arg, (tuple, list)):
        return type(arg)(_norm(a) for a in arg)
    if isinstance(arg, dict):
        return {k: _norm(v) for k, v in arg.items()}
    return arg


def _signature(gm):
    return [(n.op, n.name, n.target, _norm(n.args), _norm(n.kwargs)) for n in gm.graph.nodes]


def _assert_same_outputs(a, b):
    leaves_a, leaves_b = pytree.tree_leaves(a), pytree.tree_leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y)
        else:
            assert x == y


class _Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.register_buffer("scale", torch.full((3,), 2.0))

    def forward(self, x):
        return torch.relu(self.lin(x)) * self.scale + torch.tensor([1.0, 2.0, 3.0])


class _ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.emb = torch.nn.Embedding(10, 4)
        self.ln = torch.nn.LayerNorm(4)

    def forward(self, x, idx):
        y = torch.nn.functional.max_pool2d(self.bn(self.conv(x)).relu(), 2)
        z = torch.cat([y.flatten(1), self.ln(self.emb(idx)).flatten(1)], 1)
        z = torch.where(z > 0, z, z * 0.1).masked_fill(z < -1, 0.0)
        return z.softmax(-1), torch.stack([z, z]).to(torch.float64).sum()


def _index_ops(x):
    y = x.clone()
    y[y > 0] = 0
    y[:, 0] += 1
    y.index_add_(0, torch.tensor([0, 2]), torch.ones(2, 3))
    return y, y.argmax(1)


def _elementwise(x, y):
    return torch.sigmoid(x * y + 1.5) - y.exp()


def _views(x):
    a = x.t().reshape(-1)[2:5]
    return a.unsqueeze(0).expand(2, 3), x.shape, x.size(0)


def _inplace(x):
    y = x.clone()
    y.add_(1).mul_(y)
    y[0].zero_()
    return y


def _matmul(x, y):
    return torch.mm(x, y.t()).sum(0), x @ y.t()


def _multi_output(x):
    a, b = x.split(2)
    values, indices = x.max(dim=1)
    return a + b, values, indices


def _mutate_input(x):
    x.mul_(2)
    return x + 1


def _diag_fill(x):
    a = x + x
    a.diagonal().fill_(0)
    a[1] = x[0]
    return a


CASES = {
    "elementwise": (_elementwise, lambda: (torch.randn(3, 4), torch.randn(3, 4))),
    "views": (_views, lambda: (torch.randn(3, 4),)),
    "inplace": (_inplace, lambda: (torch.randn(3, 3),)),
    "matmul": (_matmul, lambda: (torch.randn(3, 5), torch.randn(2, 5))),
    "multi_output": (_multi_output, lambda: (torch.randn(4, 3),)),
    "module": (_Small(), lambda: (torch.randn(2, 4),)),
    "convnet_train": (_ConvNet().train(), lambda: (torch.randn(2, 3, 6, 6), torch.tensor([[1, 2], [3, 4]]))),
    "convnet_eval": (_ConvNet().eval(), lambda: (torch.randn(2, 3, 6, 6), torch.tensor([[1, 2], [3, 4]]))),
    "index_ops": (_index_ops, lambda: (torch.randn(4, 3),)),
    "index_ops_functionalized": (functionalize(_index_ops), lambda: (torch.randn(4, 3),)),
    "functionalized": (functionalize(_diag_fill), lambda: (torch.randn(3, 3),)),
    "functionalized_no_views": (
        functionalize(_diag_fill, remove="mutations_and_views"),
        lambda: (torch.randn(3, 3),),
    ),
    "functionalized_input_mutation": (functionalize(_mutate_input), lambda: (torch.randn(3),)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_graph_and_outputs_as_torch_make_fx(name):
    fn, make_inputs = CASES[name]
    torch.manual_seed(0)
    inputs = make_inputs()
    ours = make_fx(fn)(*[t.clone() for t in inputs])
    ref = torch_make_fx(fn)(*[t.clone() for t in inputs])
    assert isinstance(ours, GraphModule)
    assert _signature(ours) == _signature(ref)
    if not isinstance(fn, torch.nn.Module):
        assert type(ours).__name__ == type(ref).__name__
    ours.graph.lint()
    ins_ours, ins_ref = [t.clone() for t in inputs], [t.clone() for t in inputs]
    _assert_same_outputs(ours(*ins_ours), ref(*ins_ref))
    _assert_same_outputs(ins_ours, ins_ref)  # input mutations (copy_) happen alike


def test_targets_are_aten_op_overloads_and_meta_is_fake():
    gm = make_fx(_Small())(torch.randn(2, 4))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert calls and all(isinstance(n.target, torch._ops.OpOverload) for n in calls)
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        assert isinstance(node.meta["val"], FakeTensor), node.name
        if node.op != "get_attr":
            assert tuple(node.meta["tensor_meta"].shape) == tuple(node.meta["val"].shape)
    assert gm.graph.find_nodes(op="call_function", target=aten.addmm.default)[0].meta["val"].shape == (2, 3)


def test_module_parameters_and_constants_become_get_attr():
    model = _Small()
    gm = make_fx(model)(torch.randn(2, 4))
    attrs = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    assert attrs == ["_param_constant0", "_param_constant1", "_tensor_constant0", "_tensor_constant1"]
    assert set(dict(gm.named_parameters())) == {"_param_constant0", "_param_constant1"}
    assert torch.equal(gm._param_constant0, model.lin.weight)
    assert torch.equal(gm._tensor_constant0, model.scale)
    lift = gm.graph.find_nodes(op="call_function", target=aten.lift_fresh_copy.default)
    assert len(lift) == 1  # torch.tensor literal copied, so in-place ops can't mutate the constant


def test_fake_mode_gives_the_same_graph_without_computing():
    fn, make_inputs = CASES["functionalized"]
    inputs = make_inputs()
    real, fake = make_fx(fn)(*inputs), make_fx(fn, tracing_mode="fake")(*inputs)
    assert _signature(real) == _signature(fake)
    torch.testing.assert_close(fake(*inputs), real(*inputs))
    # modules trace in fake mode too (parameters are turned into FakeTensors on the fly)
    gm = make_fx(_Small(), tracing_mode="fake")(torch.randn(2, 4))
    assert isinstance(gm.graph.find_nodes(op="call_function", target=aten.addmm.default)[0].meta["val"], FakeTensor)


def test_decomposition_table_traces_through_the_decomposition():
    def addmm_decomp(bias, a, b, beta=1, alpha=1):
        return bias + torch.mm(a, b)

    table = {aten.addmm.default: addmm_decomp}
    model = _Small()
    x = torch.randn(2, 4)
    ours = make_fx(model, decomposition_table=table)(x)
    ref = torch_make_fx(model, decomposition_table=table)(x)
    assert _signature(ours) == _signature(ref)
    assert not ours.graph.find_nodes(op="call_function", target=aten.addmm.default)
    torch.testing.assert_close(ours(x), model(x))


def test_nested_inputs_become_flat_placeholders_and_getitem_nodes():
    def f(xs, n):
        return xs[0] * n + xs[1], xs[1].unbind(0)

    xs = [torch.randn(2, 2), torch.randn(2, 2)]
    gm = make_fx(f)(xs, 3)
    assert [n.name for n in gm.graph.find_nodes(op="placeholder")] == ["xs_1", "xs_2", "n_1"]
    getitems = gm.graph.find_nodes(op="call_function", target=operator.getitem)
    assert len(getitems) == 2
    out, parts = gm(xs[0], xs[1], 3)
    torch.testing.assert_close(out, xs[0] * 3 + xs[1])
    assert len(parts) == 2 and torch.equal(parts[1], xs[1][1])


def test_exported_from_fxdist_namespace():
    assert fxdist.make_fx is make_fx


def test_bad_tracing_mode_raises():
    with pytest.raises(ValueError, match="tracing_mode 'bogus'"):
        make_fx(_elementwise, tracing_mode="bogus")
    with pytest.raises(NotImplementedError, match="symbolic"):
        make_fx(_elementwise, tracing_mode="symbolic")


def test_pre_dispatch_is_refused_with_a_reason():
    with pytest.raises(NotImplementedError, match="PreDispatch"):
        make_fx(_elementwise, pre_dispatch=True)


def test_data_dependent_values_raise_and_constants_fold():
    def reads_value(x):
        return x * x.sum().item()

    def branches(x):
        return x if x.sum() > 0 else -x

    for fn in (reads_value, branches):
        with pytest.raises(RuntimeError, match=r"_local_scalar_dense.*reads the value of a traced tensor"):
            make_fx(fn)(torch.randn(3))
        with pytest.raises(RuntimeError, match="_local_scalar_dense"):
            torch_make_fx(fn)(torch.randn(3))  # torch.fx refuses too

    def literal(x):
        return x * torch.tensor(3.0).item()

    x = torch.randn(3)
    ours, ref = make_fx(literal)(x), torch_make_fx(literal)(x)
    assert _signature(ours) == _signature(ref)
    torch.testing.assert_close(ours(x), x * 3.0)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_same_graph_under_no_grad_and_inference_mode(context):
    # without autograd, composite ops (linear, layer_norm, ...) reach the mode and are decomposed there
    model = _ConvNet().eval()
    args = (torch.randn(2, 3, 6, 6), torch.tensor([[1, 2], [3, 4]]))
    with context():
        ours, ref = make_fx(model)(*args), torch_make_fx(model)(*args)
    assert _signature(ours) == _signature(ref)
    _assert_same_outputs(ours(*args), model(*args))
