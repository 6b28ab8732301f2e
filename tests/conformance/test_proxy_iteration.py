"""Iterating a Proxy gives torch.fx's ``TraceError: Proxy object cannot be iterated`` wherever it happens:
``for`` loops, ``*proxy``, ``**proxy``, ``dict(proxy)``, ``x in proxy``, ``list``/``tuple``/``zip`` in C code,
and ``F.max_pool2d``'s boolean dispatch. CPython replaces a ``TypeError`` raised by ``__iter__`` with its
own message in some of these, so fxdist's error there is a plain TraceError (a ValueError), as torch.fx's.

Documented difference: ``iter(proxy)`` called directly (the ``try: iter(x) except TypeError`` probe) raises
a TraceError that is also a TypeError, so such probes answer "not iterable" (torch.fx fails the trace,
unless the library special-cases ``torch.fx.Proxy`` as transformers' ``ModelOutput`` does).
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn.functional as F

import fxdist as fx
from tests._differential import compare_graphs
from tests.conformance._outcome import assert_same_error, outcome


def for_loop(x):
    for row in x:
        return row


def star_args(x):
    return torch.cat([*x])


def star_star_kwargs(x):
    return dict(**x)


def dict_of_proxy(x):
    return dict(x)


def contains(x):
    return 1 in x


def list_of_proxy(x):
    return list(x)


def tuple_of_proxy(x):
    return tuple(x)


def zip_in_comprehension(x):
    return [a for a, _ in zip(x, x)]


def keyword_unpacking(x):
    def inner(**kwargs):
        return kwargs

    return inner(**x)


CASES = [for_loop, star_args, star_star_kwargs, dict_of_proxy, contains, list_of_proxy, tuple_of_proxy,
         zip_in_comprehension, keyword_unpacking, F.max_pool2d]


@pytest.mark.parametrize("fn", CASES, ids=lambda f: f.__name__)
def test_iterating_a_proxy_raises_torch_fx_trace_error(fn):
    (ours_kind, ours), (theirs_kind, theirs) = outcome(lambda: fx.symbolic_trace(fn)), \
        outcome(lambda: torch.fx.symbolic_trace(fn))
    assert ours_kind == theirs_kind == "raised", (ours, theirs)
    assert isinstance(theirs, torch.fx.proxy.TraceError)
    assert_same_error(ours, theirs, head_chars=len("Proxy object cannot be iterated."))
    assert str(ours) == str(theirs)  # the whole message, too
    assert not isinstance(ours, TypeError)
    assert "test_proxy_iteration.py" in ours.__notes__[0] or fn is F.max_pool2d  # the user's line


def max_pool_unpacked(x):
    values, indices = F.max_pool2d(x, 2, return_indices=True)
    return values, indices


def test_unpacking_a_c_function_result_records_getitems():
    ours, theirs = fx.symbolic_trace(max_pool_unpacked), torch.fx.symbolic_trace(max_pool_unpacked)
    compare_graphs(ours.graph, theirs.graph)
    assert [n.target.__name__ for n in ours.graph.nodes if n.op == "call_function"][-2:] == ["getitem", "getitem"]
    x = torch.randn(1, 1, 4, 4)
    torch.testing.assert_close(ours(x), max_pool_unpacked(x))


def probe_then_add(x):
    try:
        iter(x)
        return x
    except TypeError:
        return x + 1


def test_iter_probe_is_a_type_error_too():
    with pytest.raises(torch.fx.proxy.TraceError):  # torch.fx: the probe fails the trace
        torch.fx.symbolic_trace(probe_then_add)
    gm = fx.symbolic_trace(probe_then_add)  # fxdist: "not iterable", the except branch is traced
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_function", "output"]
    with pytest.raises(fx.TraceError) as info:
        fx.symbolic_trace(lambda x: iter(x))
    assert isinstance(info.value, TypeError)


def test_iter_probe_is_recognized_in_a_warm_frame_too():
    # after a few eager runs, Python 3.11 specializes the call; the frame then stops at PRECALL
    for _ in range(64):
        probe_then_add(torch.ones(1))
    gm = fx.symbolic_trace(probe_then_add)
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_function", "output"]
