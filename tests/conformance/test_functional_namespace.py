"""``symbolic_trace`` applied to every public callable of ``torch.nn.functional``, with fxdist and torch.fx.

Either both trace (same graph node by node, same printed graph and code) or both raise the same
exception class with the same message head. C functions (``F.conv2d``, ``F.linear``, ``F.gelu``,
in-place ``F.relu_``) are no Python functions: both raise ``AssertionError("Expected FunctionType, ...")``;
fxdist adds a note saying what to trace instead.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx
import torch.nn.functional as F

import fxdist as fx
from tests._differential import compare_graphs
from tests.conformance._outcome import assert_same_error, outcome

NAMES = sorted(n for n in dir(F) if not n.startswith("_") and callable(getattr(F, n)))

# torch.fx 2.13 fails where fxdist does not; each entry says why. The test fails if torch.fx stops failing.
TORCH_FX_FAILS = {
    # its codegen puts the Callable[[Tensor, Tensor], Tensor] annotation's argument list in a dict key
    "triplet_margin_with_distance_loss": (TypeError, "unhashable type: 'list'"),
}
# Printed code that differs, with the reason (fxdist/codegen.py spells these annotations).
CODE_DIFFERS = {
    # ScalingType/SwizzleType are pybind enums whose torch.nn.functional path fxdist's codegen does not
    # trust (it verifies dotted paths), so it binds a global; torch.fx also prints `tuple[int,_]` for
    # `tuple[int, ...]`, which is not valid Python
    "scaled_mm", "scaled_grouped_mm",
}


def _trace(library, fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return outcome(lambda: library.symbolic_trace(fn))


@pytest.mark.parametrize("name", NAMES)
def test_symbolic_trace_of_functional(name):
    fn = getattr(F, name)
    (ours_kind, ours), (theirs_kind, theirs) = _trace(fx, fn), _trace(torch.fx, fn)
    if name in TORCH_FX_FAILS:
        kind, text = TORCH_FX_FAILS[name]
        assert theirs_kind == "raised" and isinstance(theirs, kind) and text in str(theirs)
        assert ours_kind == "ok", ours
        return
    assert ours_kind == theirs_kind, f"fxdist: {ours!r}; torch.fx: {theirs!r}"
    if ours_kind == "raised":
        assert_same_error(ours, theirs)
        return
    compare_graphs(ours.graph, theirs.graph)
    assert str(ours.graph) == str(theirs.graph)
    if name not in CODE_DIFFERS:
        assert ours.code == theirs.code


@pytest.mark.parametrize("fn", [F.conv2d, F.linear, F.gelu, F.relu_, F.avg_pool2d], ids=lambda f: f.__name__)
def test_c_functions_raise_torch_fx_assertion_error_with_a_hint(fn):
    with pytest.raises(AssertionError, match=r"^Expected FunctionType, got <class 'builtin_function_or_method'>$"):
        torch.fx.symbolic_trace(fn)
    with pytest.raises(AssertionError) as info:
        fx.symbolic_trace(fn)
    assert str(info.value) == "Expected FunctionType, got <class 'builtin_function_or_method'>"
    assert f"symbolic_trace(lambda x: {fn.__name__}(x))" in info.value.__notes__[0]


def test_a_class_root_raises_the_same_assertion_error():
    for library in (torch.fx, fx):
        with pytest.raises(AssertionError) as info:
            library.symbolic_trace(torch.dtype)
        assert str(info.value) == "Expected FunctionType, got <class 'type'>"


def test_missing_traced_func_name_is_an_assertion_error():
    class NoForward(torch.nn.Module):
        pass

    for library in (torch.fx, fx):
        tracer = library.Tracer()
        tracer.traced_func_name = "run"
        with pytest.raises(AssertionError, match="^traced_func_name=run doesn't exist in NoForward$"):
            tracer.trace(NoForward())


def test_boolean_dispatch_functional_with_proxied_kwargs_is_a_trace_error():
    # F.max_pool2d is torch._jit_internal.boolean_dispatch: `arg_name in kwargs` iterates the **kwargs Proxy
    with pytest.raises(torch.fx.proxy.TraceError, match="Proxy object cannot be iterated"):
        torch.fx.symbolic_trace(F.max_pool2d)
    with pytest.raises(fx.TraceError, match="Proxy object cannot be iterated") as info:
        fx.symbolic_trace(F.max_pool2d)
    assert not isinstance(info.value, TypeError)
