"""fxdist's tracer honours what libraries register with torch.fx (``fxdist.interop.enter_torch_fx_trace``):

* ``torch.fx.wrap("name")`` / ``@torch.fx.wrap`` leaf functions and ``_wrapped_methods_to_patch``;
* ``torch.fx._symbolic_trace.is_fx_tracing()`` is True while fxdist traces (and restored after);
* classes made with ``torch.fx.ProxyableClassMeta`` (and fxdist's own) record their construction.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.fx._symbolic_trace as fx_symbolic_trace
from torch import nn

import fxdist as fx
from tests._differential import assert_same_as_torch_fx, compare_graphs

LIBRARY_SOURCE = '''
import torch
import torch.fx

def squares(x, y):
    return x * x + y * y

torch.fx.wrap("squares")

@torch.fx.wrap
def clamp_sum(x, lo: float):
    return x.clamp(min=lo).sum()

def uses_them(x, y):
    return clamp_sum(squares(x, y), 0.5) + torch.relu(y).sum()
'''


@pytest.fixture
def library() -> dict:
    """A module that registers its helpers with torch.fx only, executed at module scope."""
    namespace: dict = {"__name__": "fake_library"}
    exec(compile(LIBRARY_SOURCE, "fake_library.py", "exec"), namespace)  # noqa: S102 - fixed text
    yield namespace
    for key in [k for k, g in fx_symbolic_trace._wrapped_fns_to_patch.items() if g is namespace]:
        del fx_symbolic_trace._wrapped_fns_to_patch[key]


def test_torch_fx_wrap_by_name_and_decorator_are_fxdist_leaves(library):
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    ours, _ = assert_same_as_torch_fx(library["uses_them"], x, y)
    calls = [(n.target, n.meta.get("is_wrapped")) for n in ours.graph.nodes if n.op == "call_function"]
    assert calls[:2] == [(library["squares"], True), (library["clamp_sum"], True)]
    # unpatched again after tracing: the module's globals hold the original functions
    assert not hasattr(library["squares"], "__wrapped__") and not hasattr(library["clamp_sum"], "__wrapped__")


def test_torch_fx_wrapped_methods_are_recorded_as_call_method(monkeypatch):
    # torch.fx's FX_PATCH_GETITEM mode: indexing a real tensor with a Proxy becomes call_method
    monkeypatch.setattr(fx_symbolic_trace, "_wrapped_methods_to_patch", [(torch.Tensor, "__getitem__")])
    original = torch.Tensor.__getitem__

    class PositionalEmbedding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("pe", torch.randn(1, 16, 4))

        def forward(self, x):
            return x + self.pe[:, : x.size(1)]

    ours, _ = assert_same_as_torch_fx(PositionalEmbedding(), torch.randn(2, 5, 4))
    getitem = [n for n in ours.graph.nodes if n.target == "__getitem__"]
    assert len(getitem) == 1 and getitem[0].op == "call_method"
    assert torch.Tensor.__getitem__ is original  # restored after tracing


def test_torch_fx_is_fx_tracing_is_true_only_while_fxdist_traces():
    seen = []

    def f(x):
        seen.append(fx_symbolic_trace.is_fx_symbolic_tracing())
        return x + 1

    fx.symbolic_trace(f)
    assert seen == [True] and not fx_symbolic_trace.is_fx_symbolic_tracing()

    def bad(x):
        seen.append(fx_symbolic_trace.is_fx_symbolic_tracing())
        if x.sum() > 0:
            return x
        return -x

    with pytest.raises(fx.TraceError):
        fx.symbolic_trace(bad)
    assert seen[-1] is True and not fx_symbolic_trace.is_fx_symbolic_tracing()


class TorchFxPair(metaclass=torch.fx.ProxyableClassMeta):
    def __init__(self, left, right):
        self.left, self.right = left, right

    def add(self, other):
        return TorchFxPair(self.left + other.left, self.right + other.right)


class FxdistPair(metaclass=fx.ProxyableClassMeta):
    def __init__(self, left, right):
        self.left, self.right = left, right


def use_torch_fx_pair(x: TorchFxPair, y: torch.Tensor):
    return x.add(TorchFxPair(y, y))


def test_torch_fx_proxyable_class_construction_is_recorded():
    ours, theirs = fx.symbolic_trace(use_torch_fx_pair), torch.fx.symbolic_trace(use_torch_fx_pair)
    compare_graphs(ours.graph, theirs.graph)
    ctor = [n for n in ours.graph.nodes if n.target is TorchFxPair]
    assert len(ctor) == 1 and [a.name for a in ctor[0].args] == ["y", "y"]
    out = ours(TorchFxPair(torch.ones(2), torch.zeros(2)), torch.ones(2))
    assert isinstance(out, TorchFxPair) and torch.equal(out.left, torch.full((2,), 2.0))


def test_fxdist_proxyable_class_meta_records_construction_and_stores_constants():
    const = FxdistPair(torch.ones(1), torch.zeros(1))

    def f(y):
        return FxdistPair(y, const)

    gm = fx.symbolic_trace(f)
    ctor = [n for n in gm.graph.nodes if n.target is FxdistPair]
    assert len(ctor) == 1 and ctor[0].args[0].name == "y"
    getattrs = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    assert getattrs == ["_FxdistPair_constant_0"] and gm._FxdistPair_constant_0 is const
    assert FxdistPair(1, 2).left == 1  # outside tracing: an ordinary class
