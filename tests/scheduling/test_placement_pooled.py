"""scheduling.placement.pooled: a torch.cat of all of a pooled KeyedTensor's features folds into its values()."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedTensor

from fxdist.graph import Graph
from fxdist.graph_module import GraphModule
from scheduling.placement.pooled import fold_regroups

KEYS = ["a", "b", "c"]
DIMS = [2, 3, 2]


def pool(client: str, values: torch.Tensor) -> KeyedTensor:
    """Stands in for ps_pool: the KeyedTensor of ``values`` ``(B, 7)`` under KEYS."""
    return KeyedTensor(keys=KEYS, length_per_key=DIMS, values=values * 1.0)


def _module(order: list[str], dim: int = 1, extra_use: bool = False) -> GraphModule:
    """``pool`` -> ``to_dict`` -> ``getitem`` per key of ``order`` -> ``torch.cat(..., dim)`` (-> also returning the
    first feature alone when ``extra_use``)."""
    graph = Graph()
    x = graph.placeholder("x")
    kt = graph.call_function(pool, ("ps:emb", x))
    parts = graph.call_method("to_dict", (kt,))
    items = [graph.call_function(operator.getitem, (parts, k)) for k in order]
    cat = graph.call_function(torch.cat, (items,), {"dim": dim})
    graph.output((cat, items[0]) if extra_use else cat)
    return GraphModule(nn.Module(), graph)


def _ops(gm: GraphModule) -> list[str]:
    return [n.target if n.op == "call_method" else getattr(n.target, "__name__", "") for n in gm.graph.nodes
            if n.op in ("call_function", "call_method")]


def test_a_cat_of_every_feature_in_key_order_becomes_values_with_the_same_values_and_gradients():
    before, after = _module(KEYS), _module(KEYS)
    assert fold_regroups(after.graph, pool, lambda name: KEYS) == 1
    after.recompile()
    assert _ops(after) == ["pool", "values"]
    x = torch.randn(4, 7, requires_grad=True)
    want, got = before(x), after(x)
    assert torch.equal(want, got)
    grad = torch.randn(4, 7)
    assert torch.equal(torch.autograd.grad(want, x, grad)[0], torch.autograd.grad(got, x, grad)[0])


@pytest.mark.parametrize("order, dim, extra_use", [
    (["b", "a", "c"], 1, False),     # another order: a real regroup
    (["a", "b"], 1, False),          # a subset
    (KEYS, 0, False),                # along the batch
    (KEYS, 1, True),                 # a feature also used on its own
])
def test_anything_else_is_left_as_it_is(order, dim, extra_use):
    gm = _module(order, dim, extra_use)
    before = _ops(gm)
    assert fold_regroups(gm.graph, pool, lambda name: KEYS) == 0
    assert _ops(gm) == before


def test_an_unknown_client_raises_key_error():
    with pytest.raises(KeyError):
        fold_regroups(_module(KEYS).graph, pool, {}.__getitem__)
