"""``concrete_args`` with ``PH`` / ``PHBase`` / ``PHWithMeta`` leaves, nested in dicts, lists and tuples.

Compared node by node with torch.fx (same placeholders ``d_1, d_2...``, same guards, same ``ph_key``
copied from ``PHWithMeta``), and the GraphModules give the same results when called with the original
nested arguments. One documented difference (fxdist/tracer.py ``Tracer._specialize``): a placeholder
guarded to a specialized value defaults to that value in fxdist, to none in torch.fx.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch.fx._symbolic_trace import PH as TORCH_PH
from torch.fx._symbolic_trace import PHWithMeta as TorchPHWithMeta

import fxdist as fx
from fxdist.node import Node
from fxdist.tracer import PH, PHBase, PHWithMeta
from tests._differential import _structure, assert_outputs_close, compare_graphs


def weighted(x, d):
    return x * d["a"] + d["b"][0] - d["b"][1]


def branchy(x, flag, pair):
    return x + pair[0] if flag else x - pair[1]


class Marked(PHWithMeta):
    """A PHBase subclass carrying two attributes for the placeholder."""

    def __init__(self, ph_key: str, unit: str) -> None:
        super().__init__(ph_key)
        self.unit = unit


class TorchMarked(TorchPHWithMeta):
    def __init__(self, ph_key: str, unit: str) -> None:
        super().__init__(ph_key)
        self.unit = unit


CASES = {
    # name: (function, concrete_args from (PH, PHWithMeta, Marked), inputs, {guarded placeholder: value})
    "all-symbolic dict of list": (weighted, lambda P, W, M: {"d": {"a": P, "b": [P, P]}},
                                  (torch.randn(3), {"a": torch.randn(3), "b": [torch.randn(3), torch.randn(3)]}), {}),
    "x itself PH, tuple leaf": (weighted, lambda P, W, M: {"x": P, "d": {"a": P, "b": (P, P)}},
                                (torch.randn(3), {"a": torch.randn(3), "b": (torch.randn(3), torch.randn(3))}), {}),
    "PHWithMeta keys": (weighted, lambda P, W, M: {"d": {"a": W(ph_key="scale"), "b": [P, M("offset", "m")]}},
                        (torch.randn(3), {"a": torch.randn(3), "b": [torch.randn(3), torch.randn(3)]}), {}),
    "constant leaf guarded": (weighted, lambda P, W, M: {"d": {"a": P, "b": [P, 3.0]}},
                              (torch.randn(3), {"a": torch.randn(3), "b": [torch.randn(3), 3.0]}), {"d_3": 3.0}),
    "bool and None specialized": (branchy, lambda P, W, M: {"flag": False, "pair": (None, P)},
                                  (torch.randn(3), False, (None, torch.randn(3))), {"flag_1": False, "pair_1": None}),
}


def _diff_nodes(ours: fx.GraphModule, theirs: torch.fx.GraphModule) -> list[str]:
    """Names of nodes whose args differ (compare_graphs checks everything else)."""
    return [a.name for a, b in zip(ours.graph.nodes, theirs.graph.nodes)
            if _structure(a.args, Node) != _structure(b.args, torch.fx.Node)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_concrete_args_with_placeholders_like_torch_fx(case):
    fn, make, inputs, guarded = CASES[case]
    ours = fx.symbolic_trace(fn, concrete_args=make(PH, PHWithMeta, Marked))
    theirs = torch.fx.symbolic_trace(fn, concrete_args=make(TORCH_PH, TorchPHWithMeta, TorchMarked))
    # the one documented difference: guarded placeholders default to the traced value
    assert _diff_nodes(ours, theirs) == list(guarded)
    for n in ours.graph.nodes:
        if n.name in guarded:
            assert n.args == (guarded[n.name],) and not [m for m in theirs.graph.nodes if m.name == n.name][0].args
            n.args = ()
    compare_graphs(ours.graph, theirs.graph)
    ph_meta = [(n.name, getattr(n, "ph_key", None), getattr(n, "unit", None))
               for n in ours.graph.nodes if n.op == "placeholder"]
    assert ph_meta == [(n.name, getattr(n, "ph_key", None), getattr(n, "unit", None))
                       for n in theirs.graph.nodes if n.op == "placeholder"]
    assert_outputs_close(ours(*inputs), fn(*inputs), 1e-6, 1e-6, "fxdist vs eager")
    assert_outputs_close(theirs(*inputs), fn(*inputs), 1e-6, 1e-6, "torch.fx vs eager")


def test_phwithmeta_attributes_reach_the_placeholders():
    gm = fx.symbolic_trace(weighted, concrete_args={"d": {"a": PHWithMeta("scale"), "b": [PH, Marked("off", "m")]}})
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    assert placeholders["d_1"].ph_key == "scale" and placeholders["d_3"].unit == "m"
    assert not hasattr(placeholders["d_2"], "ph_key")
    assert isinstance(PH, PHBase) and repr(PH) == repr(TORCH_PH) == "PH"


def test_specialized_value_is_guarded_at_run_time():
    gm = fx.symbolic_trace(weighted, concrete_args={"d": {"a": PH, "b": [PH, 3.0]}})
    x = torch.randn(3)
    with pytest.raises(AssertionError, match="d has been specialized to have value 3.0 but got another value"):
        gm(x, {"a": x, "b": [x, 4.0]})
