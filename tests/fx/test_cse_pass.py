"""``fxdist.passes.dialect.common.cse_pass`` against ``torch.fx.passes.dialect.common.cse_pass``: the same
program traced by each (``symbolic_trace`` and ``make_fx``) gives the same CSE'd graph, ``modified`` flag
and outputs, with and without the banned list."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx as torch_make_fx
from torch.fx.passes.dialect.common import cse_pass as torch_cse

import fxdist as fx
from fxdist.experimental.proxy_tensor import make_fx
from fxdist.passes.dialect.common import cse_pass


def repeated_kwargs(x):
    return x.sum(dim=1, keepdim=True) + x.sum(dim=1, keepdim=True) + x.sum(dim=1)


def repeated_lists(x):
    return torch.cat((x, x)) + torch.cat((x, x)) + torch.cat([x, x.cos()])


def repeated_chain(x):
    return x.cos().sin() * x.cos().sin()


def nothing_to_merge(x):
    return x.cos() + x.sin()


def random_calls(x):
    return torch.rand_like(x) + torch.rand_like(x) + (x + 1) + (x + 1)


PROGRAMS = [repeated_kwargs, repeated_lists, repeated_chain, nothing_to_merge, random_calls]


def _names(gm):
    return [(n.op, n.name, str(n.target)) for n in gm.graph.nodes]


@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("banned", [False, True], ids=["all", "banned"])
def test_make_fx_graphs_cse_like_torch_fx(fn, banned):
    x = torch.randn(3, 4)
    ours_pass = cse_pass.CSEPass(banned_ops=cse_pass.get_CSE_banned_ops() if banned else None)
    ours = ours_pass(make_fx(fn)(x))
    theirs = torch_cse.CSEPass(banned_ops=torch_cse.get_CSE_banned_ops() if banned else None)(torch_make_fx(fn)(x))
    assert ours.modified == theirs.modified
    assert _names(ours.graph_module) == _names(theirs.graph_module)
    assert isinstance(ours.graph_module, fx.GraphModule)
    if fn is not random_calls:
        torch.testing.assert_close(ours.graph_module(x), theirs.graph_module(x))
    second = ours_pass(ours.graph_module)  # a fixed point
    assert not second.modified and second.graph_module is ours.graph_module


@pytest.mark.parametrize("fn", PROGRAMS[:4], ids=lambda f: f.__name__)
def test_symbolic_trace_graphs_cse_like_torch_fx(fn):
    x = torch.randn(3, 4)
    ours = cse_pass.CSEPass()(fx.symbolic_trace(fn))
    theirs = torch_cse.CSEPass()(torch.fx.symbolic_trace(fn))
    assert ours.modified == theirs.modified
    assert _names(ours.graph_module) == _names(theirs.graph_module)
    assert ours.graph_module.code == theirs.graph_module.code
    torch.testing.assert_close(ours.graph_module(x), fn(x))


def test_banned_list_matches_torch_fx():
    assert cse_pass.get_CSE_banned_ops() == torch_cse.get_CSE_banned_ops()
    assert cse_pass.get_CSE_banned_ops() is not cse_pass.get_CSE_banned_ops()
    add_banned = cse_pass.CSEPass(banned_ops={torch.ops.aten.add})
    assert not add_banned(make_fx(lambda x: (x + 1) * (x + 1))(torch.randn(2))).modified
