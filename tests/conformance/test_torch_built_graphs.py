"""Graphs that torch builds are accepted by fxdist's consumers wherever torch.fx accepts them.

Producers (each builds a fresh torch.fx GraphModule): ``make_fx``, ``torch.export`` (``graph_module``,
with lifted parameters, and with unbacked symbols from ``nonzero``/``item`` plus their ``_assert_scalar``
guards), torch.fx.experimental's ``RewritingTracer`` (``assert`` rewritten to ``torch._assert``) and
``torch.fx.symbolic_trace`` (with a ``torch.fx.wrap`` leaf). Consumers: ``GraphModule(root, graph)``,
``Transformer``, ``Interpreter``, ``ShapeProp``, ``reinplace`` and ``replace_pattern``. Each test runs
torch.fx's consumer on one fresh copy and fxdist's on another, and compares outputs, node sequences and
metadata; the fxdist result must be an fxdist object (converted at the door by ``fxdist.interop``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.export.graph_signature import InputKind
from torch.fx.experimental.proxy_tensor import make_fx as torch_make_fx
from torch.fx.experimental.rewriter import RewritingTracer
from torch.fx.passes.reinplace import reinplace as torch_reinplace
from torch.fx.passes.shape_prop import ShapeProp as TorchShapeProp
from torch.utils import _pytree as pytree

import fxdist as fx
from fxdist.passes.reinplace import reinplace
from fxdist.passes.shape_prop import ShapeProp


# ---- producers ---------------------------------------------------------------------------------
@torch.fx.wrap
def _scaled_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x + y) * 0.5


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + x.sin()


class _Wrapped(_Mlp):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _scaled_sum(torch.relu(self.lin(x)), x)


class _Asserting(_Mlp):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dim() == 2, "expected (B, F)"
        return torch.relu(self.lin(x)) + 1


class _Nonzero(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nz = x.nonzero()
        torch._check(nz.shape[0] > 1)
        return nz.sum() + nz.shape[0]


class _Item(torch.nn.Module):
    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        k = n.sum().item()
        torch._check(k >= 0)
        torch._check(k < 5)
        return torch.relu(x[:k]) * 2


class Produced(NamedTuple):
    build: Callable[[], torch.fx.GraphModule]
    """A fresh torch.fx GraphModule on every call."""
    inputs: tuple[Any, ...]


def _export(module: torch.nn.Module, args: tuple[Any, ...]) -> Produced:
    """``ExportedProgram.graph_module`` takes parameters as leading placeholders: pass them in."""
    torch.manual_seed(0)
    ep = torch.export.export(module, args)
    user = iter(args)
    flat = tuple(next(user) if s.kind == InputKind.USER_INPUT else ep.state_dict[s.target]
                 for s in ep.graph_signature.input_specs)
    return Produced(lambda: torch.export.export(module, args).graph_module, flat)


def _rewriting_tracer() -> torch.fx.GraphModule:
    tracer = RewritingTracer()
    graph = tracer.trace(_ASSERTING)
    return torch.fx.GraphModule(tracer.root, graph)


torch.manual_seed(0)
_MLP, _WRAPPED, _ASSERTING = _Mlp(), _Wrapped(), _Asserting()
_X = torch.randn(3, 4)
PRODUCERS: dict[str, Produced] = {
    "make_fx": Produced(lambda: torch_make_fx(lambda x, y: torch.relu(x) + y.sin())(_X, _X), (_X, _X.cos())),
    "export": _export(_MLP, (_X,)),
    "export_nonzero": _export(_Nonzero(), (torch.tensor([1.0, 0.0, 2.0]),)),
    "export_item": _export(_Item(), (torch.randn(5), torch.tensor([1, 2]))),
    "rewriting_tracer": Produced(_rewriting_tracer, (_X,)),
    "symbolic_trace_wrap": Produced(lambda: torch.fx.symbolic_trace(_WRAPPED), (_X,)),
}
UNBACKED = ["export_nonzero", "export_item"]


def _assert_same_values(got: Any, expected: Any) -> None:
    got_leaves, got_spec = pytree.tree_flatten(got)
    expected_leaves, expected_spec = pytree.tree_flatten(expected)
    assert got_spec == expected_spec
    for g, e in zip(got_leaves, expected_leaves):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(g, e)
        else:
            assert g == e


def _ops(gm: Any) -> list[tuple[str, Any]]:
    return [(n.op, n.target) for n in gm.graph.nodes]


# ---- GraphModule(root, graph), Interpreter, Transformer ------------------------------------------
@pytest.mark.parametrize("producer", sorted(PRODUCERS))
def test_graph_module_accepts_torch_graph(producer: str) -> None:
    build, inputs = PRODUCERS[producer]
    theirs = build()
    expected = torch.fx.GraphModule(theirs, theirs.graph)(*inputs)
    ours = fx.GraphModule(theirs, build().graph)
    assert isinstance(ours, fx.GraphModule) and isinstance(ours.graph, fx.Graph)
    assert _ops(ours) == _ops(theirs)
    assert [n.name for n in ours.graph.nodes] == [n.name for n in theirs.graph.nodes]
    _assert_same_values(ours(*inputs), expected)
    ours.graph.lint()


def test_graph_module_accepts_rewriting_tracer_graph_and_its_assert() -> None:
    """RewritingTracer returns a bare torch.fx Graph; its ``torch._assert`` still fires."""
    tracer = RewritingTracer()
    graph = tracer.trace(_ASSERTING)
    ours = fx.GraphModule(tracer.root, graph)
    assert isinstance(ours, fx.GraphModule) and isinstance(ours.graph, fx.Graph)
    assert any(n.target is torch._assert for n in ours.graph.nodes)
    torch.testing.assert_close(ours(_X), _ASSERTING(_X))
    with pytest.raises(AssertionError, match=r"expected \(B, F\)"):
        ours(torch.randn(4))


@pytest.mark.parametrize("producer", sorted(PRODUCERS))
def test_interpreter_runs_torch_graph(producer: str) -> None:
    build, inputs = PRODUCERS[producer]
    expected = torch.fx.Interpreter(build()).run(*inputs)
    gm = build()
    interp = fx.Interpreter(gm)
    assert interp.module is gm and isinstance(interp.graph, fx.Graph)  # torch.fx keeps the module too
    _assert_same_values(interp.run(*inputs), expected)


def test_interpreter_with_torch_graph_argument() -> None:
    """``Interpreter(module, graph=<torch.fx.Graph>)``: the module stays, the graph is converted."""
    gm = torch.fx.symbolic_trace(_MLP)
    interp = fx.Interpreter(_MLP, graph=gm.graph)
    assert interp.module is _MLP and isinstance(interp.graph, fx.Graph)
    torch.testing.assert_close(interp.run(_X), torch.fx.Interpreter(_MLP, graph=gm.graph).run(_X))


@pytest.mark.parametrize("producer", sorted(PRODUCERS))
def test_transformer_transforms_torch_graph(producer: str) -> None:
    build, inputs = PRODUCERS[producer]
    theirs = torch.fx.Transformer(build()).transform()
    ours = fx.Transformer(build()).transform()
    assert isinstance(ours, fx.GraphModule) and isinstance(ours.graph, fx.Graph)
    assert _ops(ours) == _ops(theirs)
    _assert_same_values(ours(*inputs), theirs(*inputs))


def test_transformer_override_on_make_fx_graph() -> None:
    """A Transformer subclass written for torch.fx rewrites an aten graph the same way."""

    def swap(base: type) -> type:
        class Swap(base):  # type: ignore[misc, valid-type]
            def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
                if target is torch.ops.aten.relu.default:
                    return torch.ops.aten.sigmoid.default(*args, **kwargs)
                return super().call_function(target, args, kwargs)
        return Swap

    build, inputs = PRODUCERS["make_fx"]
    theirs = swap(torch.fx.Transformer)(build()).transform()
    ours = swap(fx.Transformer)(build()).transform()
    assert torch.ops.aten.sigmoid.default in [t for _, t in _ops(ours)]
    assert _ops(ours) == _ops(theirs)
    torch.testing.assert_close(ours(*inputs), theirs(*inputs))


# ---- ShapeProp -----------------------------------------------------------------------------------
def _tensor_metas(gm: Any) -> dict[str, Any]:
    def shape_dtype(m: Any) -> Any:
        return (tuple(m.shape), m.dtype) if hasattr(m, "dtype") else m

    return {n.name: pytree.tree_map(shape_dtype, n.meta["tensor_meta"], is_leaf=lambda m: hasattr(m, "dtype"))
            for n in gm.graph.nodes if "tensor_meta" in n.meta}


@pytest.mark.parametrize("producer", sorted(PRODUCERS))
def test_shape_prop_records_on_the_callers_torch_graph(producer: str) -> None:
    build, inputs = PRODUCERS[producer]
    theirs, ours = build(), build()
    vals_before = {n.name: n.meta.get("val") for n in ours.graph.nodes}
    _assert_same_values(ShapeProp(ours).propagate(*inputs), TorchShapeProp(theirs).propagate(*inputs))
    expected = _tensor_metas(theirs)
    assert expected, "torch.fx recorded no tensor_meta: the comparison would be empty"
    assert _tensor_metas(ours) == expected  # read from the caller's own torch.fx nodes
    assert {n.name: n.meta["type"] for n in ours.graph.nodes} == {n.name: n.meta["type"] for n in theirs.graph.nodes}
    assert {n.name: n.meta.get("val") for n in ours.graph.nodes} == vals_before  # left to torch, as torch.fx does


@pytest.mark.parametrize("producer", UNBACKED)
def test_shape_prop_fake_mode_rebinds_unbacked_symbols(producer: str) -> None:
    """Under the exported program's fake mode, fresh unbacked symbols are bound to the recorded ones
    (shapes read ``u0`` as in the exported graph) and ``unbacked_bindings`` is updated, as in torch.fx."""
    build, _ = PRODUCERS[producer]
    results = []
    for shape_prop in (TorchShapeProp, ShapeProp):
        gm = build()
        fake_inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
        out = shape_prop(gm, fake_mode=detect_fake_mode(fake_inputs)).propagate(*fake_inputs)
        metas = {k: str(v) for k, v in _tensor_metas(gm).items()}
        bindings = {n.name: {str(k): v for k, v in n.meta["unbacked_bindings"].items()}
                    for n in gm.graph.nodes if "unbacked_bindings" in n.meta}
        results.append((str(out), metas, bindings))
    assert any("u0" in shape for shape in results[0][1].values())
    assert results[1] == results[0]


@pytest.mark.parametrize("producer", UNBACKED)
def test_guards_of_unbacked_symbols_still_fire(producer: str) -> None:
    """The ``_assert_scalar`` guards of ``torch._check`` survive conversion and run in fxdist's modules."""
    build, inputs = PRODUCERS[producer]
    bad = (torch.tensor([0.0, 0.0, 3.0]),) if producer == "export_nonzero" else (inputs[0], torch.tensor([4, 4]))
    for runner in (fx.GraphModule(build(), build().graph), fx.Interpreter(build()).run):
        with pytest.raises(RuntimeError, match="Runtime assertion failed"):
            runner(*bad)
        with pytest.raises(RuntimeError, match="Runtime assertion failed"):
            build()(*bad)  # torch.fx raises the same


# ---- reinplace -----------------------------------------------------------------------------------
def _functional(x: torch.Tensor) -> torch.Tensor:
    a = x + x
    a.diagonal().fill_(0)
    b = a.mul(2)
    b.add_(1)
    return b.relu()


def test_reinplace_make_fx_graph() -> None:
    x = torch.randn(3, 3)

    def build() -> torch.fx.GraphModule:
        return torch_make_fx(torch.func.functionalize(_functional))(x)

    theirs = torch_reinplace(build(), x)
    mine = build()
    ours = reinplace(mine, x)
    assert isinstance(ours, fx.GraphModule)
    assert _ops(ours) == _ops(theirs)
    assert any(str(t).endswith("_.Tensor") or str(t).endswith("_.default") for _, t in _ops(ours))
    torch.testing.assert_close(ours(x), _functional(x))
    assert _ops(mine) == _ops(ours)  # the caller's torch.fx module has the new graph, as with torch.fx
    torch.testing.assert_close(mine(x), _functional(x))


# ---- replace_pattern ------------------------------------------------------------------------------
def _aten_pattern(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x)


def _aten_replacement(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x)


@pytest.mark.parametrize("producer", ["make_fx", "export", "export_item"])
@pytest.mark.parametrize("as_graph", [False, True])
def test_replace_pattern_aten_graphs(producer: str, as_graph: bool) -> None:
    """Graph, pattern and replacement all from torch (``make_fx``), as GraphModules or Graphs."""
    build, inputs = PRODUCERS[producer]
    example = torch.randn(3)

    def pattern_and_replacement() -> tuple[Any, Any]:
        pat, rep = torch_make_fx(_aten_pattern)(example), torch_make_fx(_aten_replacement)(example)
        return (pat.graph, rep.graph) if as_graph else (pat, rep)

    theirs, mine = build(), build()
    expected = torch.fx.subgraph_rewriter.replace_pattern(theirs, *pattern_and_replacement())
    got = fx.replace_pattern(mine, *pattern_and_replacement())
    assert len(got) == len(expected) >= 1
    assert [m.anchor.name for m in got] == [m.anchor.name for m in expected]
    assert _ops(mine) == _ops(theirs)
    _assert_same_values(mine(*inputs), theirs(*inputs))


def test_replace_pattern_symbolic_trace_modules() -> None:
    """A torch.fx-traced module rewritten with torch.fx-traced pattern/replacement modules."""

    def pattern(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) + y

    def replacement(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x) - y

    theirs, mine = torch.fx.symbolic_trace(_MLP), torch.fx.symbolic_trace(_MLP)
    expected = torch.fx.subgraph_rewriter.replace_pattern(
        theirs, torch.fx.symbolic_trace(pattern), torch.fx.symbolic_trace(replacement))
    got = fx.replace_pattern(mine, torch.fx.symbolic_trace(pattern), torch.fx.symbolic_trace(replacement))
    assert len(got) == len(expected) == 1
    assert _ops(mine) == _ops(theirs)
    torch.testing.assert_close(mine(_X), theirs(_X))
    # an fxdist module with torch.fx pattern/replacement
    ours = fx.symbolic_trace(_MLP)
    assert len(fx.replace_pattern(ours, torch.fx.symbolic_trace(pattern), torch.fx.symbolic_trace(replacement))) == 1
    assert _ops(ours) == _ops(theirs)
    torch.testing.assert_close(ours(_X), theirs(_X))


@pytest.mark.parametrize("producer", sorted(PRODUCERS))
def test_symbolic_trace_retraces_torch_graph_module(producer: str) -> None:
    """``fxdist.symbolic_trace`` of a torch-built GraphModule records what ``torch.fx.symbolic_trace``
    does (``torch.fx.wrap`` leaves, aten overloads and ``_assert_scalar`` guards included)."""
    build, inputs = PRODUCERS[producer]
    theirs, ours = torch.fx.symbolic_trace(build()), fx.symbolic_trace(build())
    assert isinstance(ours, fx.GraphModule)
    assert _ops(ours) == _ops(theirs)
    _assert_same_values(ours(*inputs), theirs(*inputs))


def test_replace_pattern_replacement_with_submodule_writes_it_back() -> None:
    """A replacement that calls a submodule: the caller's torch.fx module receives that submodule (the
    new ``call_module`` target) together with the new graph, as with torch.fx's replace_pattern."""

    class Replacement(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = torch.nn.Tanh()

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.act(x) * y

    def pattern(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) + y

    theirs, mine = torch.fx.symbolic_trace(_MLP), torch.fx.symbolic_trace(_MLP)
    torch.fx.subgraph_rewriter.replace_pattern(theirs, pattern, torch.fx.symbolic_trace(Replacement()))
    assert len(fx.replace_pattern(mine, pattern, torch.fx.symbolic_trace(Replacement()))) == 1
    assert ("call_module", "act") in _ops(mine)
    assert _ops(mine) == _ops(theirs)
    assert isinstance(mine.get_submodule("act"), torch.nn.Tanh)
    assert [name for name, _ in mine.named_modules()] == [name for name, _ in theirs.named_modules()]
    torch.testing.assert_close(mine(_X), theirs(_X))


def test_graph_from_torch_fx_copies_and_refuses_other_types() -> None:
    from fxdist.interop import graph_from_torch_fx

    source = torch.fx.symbolic_trace(_WRAPPED).graph
    graph = graph_from_torch_fx(source)
    assert isinstance(graph, fx.Graph) and str(graph) == str(source)
    first = next(iter(graph.nodes))
    first.meta["mark"] = 1
    assert "mark" not in next(iter(source.nodes)).meta  # a copy, unlike the doors' shared meta
    with pytest.raises(TypeError, match="expects a torch.fx.Graph, got Graph"):
        graph_from_torch_fx(graph)


def test_replace_pattern_of_a_submodule_call_deletes_it_as_torch_fx() -> None:
    """Pattern and replacement call submodules: the matched submodule goes, the new one comes."""

    def holding(**modules: torch.nn.Module) -> torch.nn.Module:
        class Holder(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                for name, m in modules.items():
                    self.add_module(name, m)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                for m in self.children():
                    x = m(x)
                return x
        return Holder()

    def build() -> torch.fx.GraphModule:
        return torch.fx.symbolic_trace(holding(a=torch.nn.ReLU(), b=_MLP.lin))

    def args() -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        return torch.fx.symbolic_trace(holding(a=torch.nn.ReLU())), torch.fx.symbolic_trace(holding(t=torch.nn.Tanh()))

    theirs, mine = build(), build()
    assert len(torch.fx.subgraph_rewriter.replace_pattern(theirs, *args())) == len(fx.replace_pattern(mine, *args())) == 1
    assert [name for name, _ in mine.named_modules()] == [name for name, _ in theirs.named_modules()] == ["", "b", "t"]
    assert _ops(mine) == _ops(theirs)
    torch.testing.assert_close(mine(_X), theirs(_X))
