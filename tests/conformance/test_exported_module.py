"""``ExportedProgram.module()`` in fxdist: its pytree calling convention (``_PyTreeCodeGen``) is converted.

``torch.export``'s unlifted module takes the user's nested arguments (``forward(self, d, y)`` with ``d`` a
dict), flattens them with ``fx_pytree.tree_flatten_spec(([d, y], {}), self._in_spec)`` and rebuilds a
nested output. fxdist converts that code generator (``fxdist.interop``) instead of refusing it, so
``ShapeProp``, ``GraphModule(root, graph)`` and ``Interpreter`` take these modules as torch.fx does.
Compared with torch.fx: the printed code, the outputs, every node's ``tensor_meta``, and under the exported
program's fake mode the unbacked symbols of ``nonzero``/``item`` (``u0``) and their ``unbacked_bindings``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx
from torch import nn
from torch._guards import detect_fake_mode
from torch.fx.passes.shape_prop import ShapeProp as TorchShapeProp
from torch.utils import _pytree as pytree

import fxdist as fx
from fxdist.passes.shape_prop import ShapeProp
from tests.conformance._outcome import assert_same_error, outcome


class NestedIO(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, d, y, *, scale):
        return {"out": self.lin(d["a"]) * scale + y, "rows": [torch.nonzero(y)]}


class ItemSlice(nn.Module):
    def forward(self, x, n):
        k = n.sum().item()
        torch._check(k >= 0)
        torch._check(k < 5)
        return torch.relu(x[:k]) * 2


torch.manual_seed(0)
CASES: dict[str, tuple[nn.Module, tuple[Any, ...], dict[str, Any]]] = {
    "nested_io": (NestedIO(), ({"a": torch.randn(2, 4)}, torch.randn(2, 3)), {"scale": torch.tensor(2.0)}),
    "item_slice": (ItemSlice(), (torch.randn(5), torch.tensor([1, 2])), {}),
}


def _module(case: str) -> tuple[torch.fx.GraphModule, tuple[Any, ...], dict[str, Any]]:
    model, args, kwargs = CASES[case]
    return torch.export.export(model, args, kwargs).module(), args, kwargs


def _tensor_metas(gm: Any) -> dict[str, str]:
    return {n.name: str(n.meta["tensor_meta"]) for n in gm.graph.nodes if "tensor_meta" in n.meta}


@pytest.mark.parametrize("case", sorted(CASES))
def test_converted_module_prints_and_runs_as_torch_fx(case: str) -> None:
    theirs, args, kwargs = _module(case)
    ours = fx.GraphModule(theirs, theirs.graph)
    assert "fx_pytree.tree_flatten_spec(([" in theirs.code
    assert ours.code.replace("self._modules['_guards_fn']", "self._guards_fn") == theirs.code
    torch.testing.assert_close(ours(*args, **kwargs), theirs(*args, **kwargs))
    flat = pytree.arg_tree_leaves(*args, **kwargs)  # Interpreter.run takes the flat inputs, as torch.fx's
    torch.testing.assert_close(fx.Interpreter(theirs).run(*flat), torch.fx.Interpreter(theirs).run(*flat))


@pytest.mark.parametrize("case", sorted(CASES))
def test_shape_prop_on_exported_module_as_torch_fx(case: str) -> None:
    (theirs, args, kwargs), (ours, _, _) = _module(case), _module(case)
    flat = pytree.arg_tree_leaves(*args, **kwargs)
    torch.testing.assert_close(ShapeProp(ours).propagate(*flat), TorchShapeProp(theirs).propagate(*flat))
    expected = _tensor_metas(theirs)
    assert expected and _tensor_metas(ours) == expected  # recorded on the caller's own torch.fx nodes


def test_shape_prop_fake_mode_keeps_unbacked_symbols_as_torch_fx() -> None:
    results = []
    for shape_prop in (TorchShapeProp, ShapeProp):
        gm, _, _ = _module("item_slice")
        fake = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
        out = shape_prop(gm, fake_mode=detect_fake_mode(fake)).propagate(*fake)
        bindings = {n.name: {str(k): v for k, v in n.meta["unbacked_bindings"].items()}
                    for n in gm.graph.nodes if "unbacked_bindings" in n.meta}
        results.append((str(out), _tensor_metas(gm), bindings))
    assert any("u0" in meta for meta in results[0][1].values()) and results[0][2]
    assert results[1] == results[0]


def test_wrong_structure_raises_as_torch_fx() -> None:
    exported, args, kwargs = _module("nested_io")
    # the same door on both sides (the exported module's own pre-hooks check inputs before forward)
    ours, theirs = fx.GraphModule(exported, exported.graph), torch.fx.GraphModule(exported, exported.graph)
    bad = ({"b": args[0]["a"]}, args[1])
    kind_ours, err_ours = outcome(lambda: ours(*bad, **kwargs))
    kind_theirs, err_theirs = outcome(lambda: theirs(*bad, **kwargs))
    assert kind_ours == kind_theirs == "raised"
    assert_same_error(err_ours, err_theirs)


def test_boxed_codegen_is_still_refused_clearly() -> None:
    graph = torch.fx.Graph()
    graph.output(graph.placeholder("x"))
    graph.set_codegen(torch.fx.graph._BoxedCodeGen())
    with pytest.raises(ValueError, match="_BoxedCodeGen"):
        fx.GraphModule(nn.Module(), graph)
