"""How generated code reaches submodules: torch.fx's ``self.foo.bar.baz`` text where fxdist's fast
``self._modules[...]`` reads could fail or were switched off.

fxdist's default ``CodeGen(fast_module_access=True)`` reads ``self._modules['foo']...`` (see
fxdist/codegen.py). A GraphModule built from a dict root (its values may be any objects), one whose
``call_module`` target is not reachable through ``_modules``, and ``CodeGen(fast_module_access=False)``
print exactly torch.fx 2.13's text; all of them compute what torch.fx computes.
"""

import copy
import pickle
from typing import Any

import pytest
import torch
import torch.fx

import fxdist as fx


def _build(lib: Any) -> Any:
    g = lib.Graph()
    x = g.placeholder("x")
    a = g.call_module("foo.bar.baz", (x,))
    b = g.call_module("layers.0", (a,))
    w = g.get_attr("foo.w")
    g.output(g.call_function(torch.add, (b, w)))
    return g


def _dict_root() -> dict[str, Any]:
    return {"foo.bar.baz": torch.nn.ReLU(), "layers.0": torch.nn.Tanh(), "foo.w": torch.ones(2)}


def _module_root() -> torch.nn.Module:
    root = torch.nn.Module()
    root.foo = torch.nn.Module()
    root.foo.bar = torch.nn.Module()
    root.foo.bar.baz = torch.nn.ReLU()
    root.foo.w = torch.nn.Parameter(torch.ones(2))
    root.layers = torch.nn.Sequential(torch.nn.Tanh())
    return root


def test_dict_root_prints_torch_fx_text() -> None:
    ours = fx.GraphModule(_dict_root(), _build(fx))
    theirs = torch.fx.GraphModule(_dict_root(), _build(torch.fx))
    assert ours.code == theirs.code
    assert "self.foo.bar.baz(x)" in ours.code and 'getattr(self.layers, "0")' in ours.code
    x = torch.randn(2)
    torch.testing.assert_close(ours(x), theirs(x))


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "copy", "recompile"])
def test_dict_root_text_survives_copies(how: str) -> None:
    gm = fx.GraphModule(_dict_root(), _build(fx))
    theirs = torch.fx.GraphModule(_dict_root(), _build(torch.fx))
    if how == "deepcopy":
        gm = copy.deepcopy(gm)
    elif how == "pickle":
        gm = pickle.loads(pickle.dumps(gm))
    elif how == "copy":
        gm = copy.copy(gm)
    else:
        gm.recompile()
    assert gm.code == theirs.code


def test_fast_module_access_false_prints_torch_fx_text() -> None:
    ours = fx.GraphModule(_module_root(), _build(fx))
    assert "self._modules['foo']._modules['bar']._modules['baz'](x)" in ours.code  # the fast default
    theirs = torch.fx.GraphModule(_module_root(), _build(torch.fx))
    ours.graph.set_codegen(fx.CodeGen(fast_module_access=False))
    ours.recompile()
    assert ours.code == theirs.code
    x = torch.randn(2)
    torch.testing.assert_close(ours(x), theirs(x))


def test_traced_module_with_fast_access_off_matches_torch_fx() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(3, 1)))
    ours, theirs = fx.symbolic_trace(model), torch.fx.symbolic_trace(model)
    ours.graph.set_codegen(fx.CodeGen(fast_module_access=False))
    ours.recompile()
    assert ours.code == theirs.code
    assert 'getattr(getattr(self, "1"), "1")' in ours.code


def test_call_module_target_outside_modules_uses_attribute_access() -> None:
    """A call_module target that is a plain callable attribute (not in ``_modules``) still runs."""
    outs, codes = [], []
    for lib in (fx, torch.fx):
        root = torch.nn.Module()
        root.double = lambda t: t * 2  # an attribute, not a submodule
        g = lib.Graph()
        g.output(g.call_module("double", (g.placeholder("x"),)))
        gm = lib.GraphModule(root, g)
        outs.append(gm(torch.ones(2)))
        codes.append(gm.code)
    assert codes[0] == codes[1]
    torch.testing.assert_close(outs[0], outs[1])


def test_deleted_submodule_after_recompile_raises_attribute_error_like_torch_fx() -> None:
    for lib in (fx, torch.fx):
        gm = lib.GraphModule(_module_root(), _build(lib))
        gm.delete_submodule("foo.bar.baz")
        gm.recompile()
        with pytest.raises(AttributeError, match="baz"):
            gm(torch.randn(2))
