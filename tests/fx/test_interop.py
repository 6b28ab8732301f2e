"""from_torch_fx / to_torch_fx: round trips keep nodes, names, meta, types and shared parameters."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx
from torch import nn

import fxdist as fx
from fxdist.interop import from_torch_fx, to_torch_fx


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.param = nn.Parameter(torch.rand(3, 4))
        self.linear = nn.Linear(4, 5)
        self.seq = nn.Sequential(nn.Linear(5, 5), nn.ReLU())

    def forward(self, x, y=None):  # noqa: ANN001, ANN201 - untyped on purpose (no annotations)
        z = self.seq(self.linear(x + self.param).clamp(min=0.0, max=1.0))
        return {"a": z[:, 1:], "b": (torch.sum(z, dim=1), x.shape[0], -z.transpose(0, 1) @ z)}


class Block(nn.Module):
    """A ResNet basic block."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3)
        self.conv2, self.bn2 = nn.Conv2d(3, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.nn.functional.relu(out + x)


MODELS = [(Mixed, (3, 4)), (Block, (2, 3, 6, 6))]


def _shape(a: Any) -> Any:
    """args/kwargs with nodes replaced by their names (node objects differ between graphs)."""
    if isinstance(a, (torch.fx.Node, fx.Node)):
        return ("%", a.name)
    if isinstance(a, (tuple, list)):
        return (type(a).__name__ if not isinstance(a, list) else "list", [_shape(x) for x in a])
    if isinstance(a, dict):
        return {k: _shape(v) for k, v in a.items()}
    if isinstance(a, slice):
        return ("slice", _shape(a.start), _shape(a.stop), _shape(a.step))
    return a


def _nodes(gm: Any) -> list[tuple[Any, ...]]:
    return [(n.op, n.target, n.name, _shape(n.args), _shape(n.kwargs), n.type) for n in gm.graph.nodes]


def _same_outputs(a: Any, b: Any) -> None:
    flat_a, spec_a = torch.utils._pytree.tree_flatten(a)
    flat_b, spec_b = torch.utils._pytree.tree_flatten(b)
    assert spec_a == spec_b
    for x, y in zip(flat_a, flat_b):
        assert torch.allclose(x, y) if isinstance(x, torch.Tensor) else x == y


@pytest.mark.parametrize("model_cls, shape", MODELS, ids=[m.__name__ for m, _ in MODELS])
def test_round_trip_torch_fx_fxdist_torch_fx(model_cls: type, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = model_cls().eval()
    traced = torch.fx.symbolic_trace(model)
    ours = from_torch_fx(traced)
    back = to_torch_fx(ours)
    assert _nodes(ours) == _nodes(traced) == _nodes(back)
    ours.graph.lint()
    back.graph.lint()
    x = torch.randn(*shape)
    expected = model(x)
    for gm in (ours, back):
        _same_outputs(gm(x), expected)
    assert type(ours).__name__ == type(back).__name__ == model_cls.__name__
    for name, p in model.named_parameters():
        if name in dict(ours.named_parameters()):
            assert ours.get_parameter(name) is p and back.get_parameter(name) is p


def test_meta_types_and_module_meta_survive() -> None:
    g = fx.Graph()
    x = g.placeholder("x", type_expr=torch.Tensor)
    r = g.call_function(torch.relu, (x,), type_expr=torch.Tensor)
    r.meta["custom"] = {"tag": 1}
    r.meta["stack_trace"] = 'File "m.py", line 1, in f'
    g.output(r)
    gm = fx.GraphModule(nn.Module(), g, class_name="Tiny")
    gm.meta["origin"] = "test"
    back = from_torch_fx(to_torch_fx(gm))
    relu = [n for n in back.graph.nodes if n.op == "call_function"][0]
    assert relu.meta == r.meta and relu.meta is not r.meta and relu.type is torch.Tensor
    assert back.meta == {"origin": "test"} and "x : torch.Tensor" in back.code
    t = to_torch_fx(gm)
    assert "def forward(self, x : torch.Tensor)" in t.code and t.meta == {"origin": "test"}


def test_fxdist_traced_module_runs_under_torch_compile() -> None:
    torch.manual_seed(0)
    model = Block().eval()
    gm = fx.symbolic_trace(model)
    x = torch.randn(2, 3, 6, 6)
    compiled = torch.compile(to_torch_fx(gm), backend="eager")
    assert torch.allclose(compiled(x), model(x), atol=1e-6)
    direct = torch.compile(gm, backend="eager", fullgraph=True)  # dynamo also reads fxdist's generated code
    assert torch.allclose(direct(x), model(x), atol=1e-6)


def test_training_through_the_converted_module_updates_shared_parameters() -> None:
    model = Mixed()
    gm = to_torch_fx(fx.symbolic_trace(model))
    before = model.linear.weight.detach().clone()
    out = gm(torch.randn(3, 4))
    (out["a"].sum() + out["b"][0].sum()).backward()
    torch.optim.SGD(gm.parameters(), lr=1.0).step()
    assert not torch.equal(before, model.linear.weight)


def test_refusals() -> None:
    with pytest.raises(TypeError, match="torch.fx.GraphModule"):
        from_torch_fx(fx.symbolic_trace(Block()))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fxdist GraphModule"):
        to_torch_fx(torch.fx.symbolic_trace(Block()))  # type: ignore[arg-type]

    def f(d: dict[str, torch.Tensor]) -> torch.Tensor:
        return d["a"] + d["b"]

    # the pytree calling convention is converted, not refused, and comes back to torch.fx
    pytree_traced = torch.fx.symbolic_trace(f, concrete_args={"d": {"a": torch.fx.PH, "b": torch.fx.PH}})
    ours = from_torch_fx(pytree_traced)
    assert ours.code == pytree_traced.code
    d = {"a": torch.ones(2), "b": torch.full((2,), 2.0)}
    assert torch.equal(ours(d), pytree_traced(d))
    back = to_torch_fx(ours)
    assert back.code == pytree_traced.code and torch.equal(back(d), pytree_traced(d))
    boxed = torch.fx.Graph()
    boxed.output(boxed.placeholder("x"))
    boxed.set_codegen(torch.fx.graph._BoxedCodeGen())
    with pytest.raises(ValueError, match="_BoxedCodeGen"):
        from_torch_fx(torch.fx.GraphModule(nn.Module(), boxed))


def test_torch_ao_prepare_calibrate_through_fxdist_and_convert() -> None:
    """to torch.ao (prepare) -> back to fxdist (calibrate with fxdist's forward) -> torch.ao (convert)."""
    import warnings

    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    x = torch.randn(16, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notices
        prepared = prepare_fx(to_torch_fx(fx.symbolic_trace(model)), get_default_qconfig_mapping("fbgemm"),
                              example_inputs=(x,))
        ours = from_torch_fx(prepared)
        ours(x)  # the observers are shared modules: calibrating here calibrates `prepared`
        quantized = from_torch_fx(convert_fx(to_torch_fx(ours)))
    assert "torch.quantize_per_tensor(" in quantized.code
    assert (quantized(x) - model(x)).abs().max() < 0.05
