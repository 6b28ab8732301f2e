"""``torch.jit.script`` on fxdist GraphModules, differentially against torch.fx 2.13.

Each case builds the same program with torch.fx and with fxdist (``import fxdist as fx`` code is the
torch.fx code), scripts both GraphModules and compares the scripted outputs with each other and with
eager. The fxdist module keeps its fast ``self._modules[...]`` code; ``__prepare_scriptable__`` hands
TorchScript a torch.fx-style clone.

No ``from __future__ import annotations`` here: the tracer records string annotations as strings, and
TorchScript rejects those for torch.fx too.
"""

import copy
import math
import typing
from typing import Any, List, Optional  # noqa: UP035 - TorchScript reads typing aliases in generated code

import pytest
import torch
import torch.fx

import fxdist as fx

torch.fx.wrap("len")
fx.wrap("len")


def scaled_sum(x: torch.Tensor, k: float) -> torch.Tensor:
    return x.sum(0) * k


torch.fx.wrap("scaled_sum")
fx.wrap("scaled_sum")


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.layers(x), dim=-1)


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4),
                                         torch.nn.ReLU())
        self.pool = torch.nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(self.block(x)), 1)


class TensorConstant(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tensor([1.0, 2.0, 3.0]) * 2


class UsesLen(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * len(x)


class WrappedFunction(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled_sum(x, 0.5) + math.sqrt(4.0)


def halve(x: torch.Tensor) -> torch.Tensor:
    return x / 2


class Autowrapped(torch.nn.Module):
    """``halve`` is autowrapped (Tracer(autowrap_functions=...)); ``math.sqrt`` by autowrap_modules."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return halve(x) * math.sqrt(x.size(0))


class Annotated(torch.nn.Module):
    def forward(self, x: torch.Tensor, n: int, ks: List[int]) -> torch.Tensor:  # noqa: UP006
        return x * n + ks[0] * len(ks)


def _trace(lib: Any, model: torch.nn.Module, **kwargs: Any) -> Any:
    model = copy.deepcopy(model)  # tracing adds _tensor_constantN attributes to the root
    return lib.GraphModule(model, lib.Tracer(**kwargs).trace(model))


def _script_both(model: torch.nn.Module, **tracer_kwargs: Any) -> tuple[Any, Any, Any, Any]:
    ours = _trace(fx, model, **tracer_kwargs)
    theirs = _trace(torch.fx, model, **tracer_kwargs)
    return ours, theirs, torch.jit.script(ours), torch.jit.script(theirs)


CASES = [
    (MLP, (torch.randn(4, 6),)),
    (ConvNet, (torch.randn(2, 3, 5, 5),)),
    (TensorConstant, (torch.randn(2, 3),)),
    (UsesLen, (torch.randn(5, 2),)),
    (WrappedFunction, (torch.randn(3, 2),)),
    (Autowrapped, (torch.randn(4, 2),)),
    (Annotated, (torch.randn(2), 3, [1, 2])),
]


@pytest.mark.parametrize(("model_cls", "inputs"), CASES, ids=[c[0].__name__ for c in CASES])
def test_script_matches_torch_fx(model_cls: type, inputs: tuple[Any, ...]) -> None:
    torch.manual_seed(0)
    model = model_cls().eval()
    ours, theirs, s_ours, s_theirs = _script_both(model, autowrap_functions=(halve,))
    assert isinstance(s_ours, torch.jit.ScriptModule)
    assert [(n.op, str(n.target)) for n in ours.graph.nodes] == [(n.op, str(n.target)) for n in theirs.graph.nodes]
    expected = model(*inputs)
    torch.testing.assert_close(s_ours(*inputs), expected)
    torch.testing.assert_close(s_ours(*inputs), s_theirs(*inputs))
    # scripting neither changes the fxdist module's code nor its outputs
    assert "_modules[" in ours.code or "_modules" not in theirs.code
    torch.testing.assert_close(ours(*inputs), expected)


def test_scripted_graph_is_torch_fx_graph() -> None:
    """The TorchScript IR of both scripted modules has the same nodes (kinds, in order)."""
    ours, theirs, s_ours, s_theirs = _script_both(ConvNet().eval())
    kinds = [[n.kind() for n in s.graph.nodes()] for s in (s_ours, s_theirs)]
    assert kinds[0] == kinds[1]
    assert s_ours.original_name == s_theirs.original_name == "GraphModule"


def test_script_shares_parameters_and_leaves_module_alone() -> None:
    model = MLP()
    gm = fx.symbolic_trace(model)
    code = gm.code
    scripted = torch.jit.script(gm)
    assert gm.code == code
    with torch.no_grad():
        gm.get_submodule("layers.0").weight.add_(1.0)
    x = torch.randn(2, 6)
    torch.testing.assert_close(scripted(x), gm(x))  # the scripted copy saw the in-place update
    assert gm.get_submodule("layers.0") is model.layers[0]


def test_script_nested_graph_modules() -> None:
    inner = fx.symbolic_trace(MLP())
    outer_root = torch.nn.Module()
    outer_root.inner = inner
    g = fx.Graph()
    x = g.placeholder("x", type_expr=torch.Tensor)
    g.output(g.call_function(torch.relu, (g.call_module("inner", (x,)),)), type_expr=torch.Tensor)
    outer = fx.GraphModule(outer_root, g)
    scripted = torch.jit.script(outer)
    x = torch.randn(3, 6)
    torch.testing.assert_close(scripted(x), outer(x))
    assert outer.inner is inner and "_modules[" in inner.code


def test_script_return_annotation_and_typed_nodes() -> None:
    schemas = []
    for lib in (fx, torch.fx):
        g = lib.Graph()
        x = g.placeholder("x", type_expr=torch.Tensor)
        n = g.placeholder("n", type_expr=int)
        size = g.call_method("size", (x, 0), type_expr=int)
        total = g.call_function(torch.add, (size, n), type_expr=int)
        g.output((x, total), type_expr=typing.Tuple[torch.Tensor, int])  # noqa: UP006
        scripted = torch.jit.script(lib.GraphModule(torch.nn.Module(), g))
        out = scripted(torch.ones(4), 3)
        assert out[1] == 7 and isinstance(out[1], int)
        schemas.append(str(scripted.forward.schema).split(" self, ", 1)[1])
    assert schemas[0] == schemas[1] == "Tensor x, int n) -> ((Tensor, int))"


class ListCodeGen(fx.CodeGen):
    """torch.fx's documented custom-CodeGen example: forward takes one list of tensors."""

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str) -> str:
        return (f"\ndef forward(self, args_list: List[torch.Tensor]){maybe_return_annotation}:\n"
                f"    {', '.join(free_vars)} = args_list")

    def additional_globals(self) -> list[tuple[str, Any]]:
        return [("List", typing.List)]  # noqa: UP006

    def process_inputs(self, *inputs: Any) -> Any:
        assert len(inputs) == 1
        return inputs[0]


class TorchListCodeGen(torch.fx.CodeGen):
    gen_fn_def = ListCodeGen.gen_fn_def
    additional_globals = ListCodeGen.additional_globals
    process_inputs = ListCodeGen.process_inputs


def test_script_custom_codegen() -> None:
    def f(a, b):  # noqa: ANN001, ANN202 - annotated free_vars cannot be unpacked from the list
        return a + b

    outputs = []
    for lib, codegen in ((fx, ListCodeGen), (torch.fx, TorchListCodeGen)):
        gm = lib.symbolic_trace(f)
        gm.graph.set_codegen(codegen())
        gm.recompile()
        outputs.append(torch.jit.script(gm)([torch.ones(2), torch.full((2,), 2.0)]))
    torch.testing.assert_close(outputs[0], outputs[1])
    torch.testing.assert_close(outputs[0], torch.full((2,), 3.0))


def f_operators(x: torch.Tensor, y: torch.Tensor) -> Any:
    return (-x, x // 2, x / 2, x % 3, x ** 2, x @ y.t(), x[0, 1:], x[..., None], x > y, x == y,
            ~(x > 0), (x > 0) & (y < 1), (x > 0) | (y < 1), (x > 0) ^ (y < 1))


def f_methods(x: torch.Tensor, y: torch.Tensor) -> Any:
    return x.view(-1).clamp(min=0.0, max=float("inf")).to(torch.float64).sum(dim=0, keepdim=True)


def f_creation(x: torch.Tensor, y: torch.Tensor) -> Any:
    z = torch.zeros(2, 3, dtype=torch.float32, device=torch.device("cpu"))
    return z + x.size(0) + math.pi, torch.cat([x, y], dim=0), torch.nn.functional.relu(x, inplace=False)


def f_shapes(x: torch.Tensor, y: torch.Tensor) -> Any:
    n = x.shape[0]
    return x.reshape(n * x.shape[1]), x.dim(), y.numel()


def f_optional(x: torch.Tensor, y: Optional[torch.Tensor] = None) -> Any:  # noqa: UP007 - TorchScript
    return x + 1


@pytest.mark.parametrize("fn", [f_operators, f_methods, f_creation, f_shapes, f_optional],
                         ids=lambda f: f.__name__)
def test_script_functions_match_torch_fx(fn: Any) -> None:
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    args = (x,) if fn is f_optional else (x, y)
    ours, theirs = torch.jit.script(fx.symbolic_trace(fn)), torch.jit.script(torch.fx.symbolic_trace(fn))
    torch.testing.assert_close(ours(*args), theirs(*args))
    torch.testing.assert_close(ours(*args), fn(*args))


class Parent(torch.nn.Module):
    def __init__(self, child: torch.nn.Module) -> None:
        super().__init__()
        self.child = child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(x) * 2


def test_script_parent_of_graph_module() -> None:
    """torch.jit.script stores the prepared clone in the parent; it computes the same and gets the fast
    code back on its first Python call."""
    parent = Parent(fx.symbolic_trace(MLP()))
    ref = Parent(torch.fx.symbolic_trace(copy.deepcopy(parent.child)))
    x = torch.randn(3, 6)
    scripted, scripted_ref = torch.jit.script(parent), torch.jit.script(ref)
    torch.testing.assert_close(scripted(x), scripted_ref(x))
    torch.testing.assert_close(parent(x), scripted(x))
    assert "_modules[" in parent.child.code
    torch.testing.assert_close(parent(x), ref(x))
