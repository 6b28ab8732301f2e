"""Trace errors: torch.fx's exception types and messages, plus the user's file, line and source."""

from __future__ import annotations

import inspect
import os
import re
import sys

import pytest
import torch
import torch.fx
from torch import nn

import fxdist as fx
from fxdist.errors import (
    ProxyUsageError,
    TraceError,
    describe_location,
    location_of_stack_trace,
    user_frame,
)
from fxdist.tracer import Tracer, symbolic_trace

THIS_FILE = re.escape(__file__.rsplit("/", 1)[-1])


def _line_of(fn, text: str) -> int:
    """The absolute line number of the first line of ``fn`` containing ``text``."""
    lines, start = inspect.getsourcelines(fn)
    for offset, line in enumerate(lines):
        if text in line:
            return start + offset
    raise AssertionError(f"{text!r} not in {fn.__name__}")


def _notes(excinfo) -> str:
    return "\n".join(getattr(excinfo.value, "__notes__", []))


class DynamicIf(nn.Module):
    def forward(self, dense):
        if dense.sum() > 0:
            return dense
        return -dense


def test_dynamic_control_flow_names_user_line():
    with pytest.raises(TraceError, match="symbolically traced variables cannot be used as inputs to control flow") as ei:
        symbolic_trace(DynamicIf())
    line = _line_of(DynamicIf.forward, "if dense.sum() > 0:")
    assert re.search(rf"at .*{THIS_FILE}:{line} in forward: `if dense.sum\(\) > 0:`; use concrete_args=", _notes(ei))
    assert isinstance(ei.value, ValueError)
    # args are torch.fx's message, untouched
    assert ei.value.args == ("symbolically traced variables cannot be used as inputs to control flow",)
    with pytest.raises(torch.fx.proxy.TraceError) as theirs:
        torch.fx.symbolic_trace(DynamicIf())
    assert theirs.value.args == ei.value.args


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = DynamicIf()

    def forward(self, x):
        return self.inner(x) * 2


def test_error_in_nested_module_points_at_inner_forward():
    with pytest.raises(TraceError, match=rf"{THIS_FILE}:{_line_of(DynamicIf.forward, 'if dense')}"):
        symbolic_trace(Nested())


def iterate(x):
    total = 0
    for row in x:
        total = total + row
    return total


def test_iterating_a_proxy():
    with pytest.raises(TraceError, match="Proxy object cannot be iterated") as ei:
        symbolic_trace(iterate)
    assert f"{_line_of(iterate, 'for row in x:')} in iterate: `for row in x:`" in _notes(ei)
    with pytest.raises(torch.fx.proxy.TraceError, match="Proxy object cannot be iterated"):
        torch.fx.symbolic_trace(iterate)


def star_args(x):
    return torch.stack([*x])


def test_star_expanding_a_proxy():
    with pytest.raises(TraceError, match="cannot be iterated"):
        symbolic_trace(star_args)


def length(x):
    return x.view(len(x), -1)


def test_len_without_wrap_is_trace_error_and_runtime_error():
    with pytest.raises(TraceError, match="'len' is not supported in symbolic tracing by default") as ei:
        symbolic_trace(length)
    assert isinstance(ei.value, RuntimeError) and isinstance(ei.value, ProxyUsageError)
    assert "in length: `return x.view(len(x), -1)`" in _notes(ei)
    with pytest.raises(RuntimeError, match="'len' is not supported"):
        torch.fx.symbolic_trace(length)


class DictKey(nn.Module):
    def forward(self, x):
        return x.index_select({x: 1})


def test_proxy_as_dict_key_in_an_argument():
    with pytest.raises(TraceError, match="Keys for dictionaries used as an argument cannot contain a Node") as ei:
        symbolic_trace(DictKey())
    assert isinstance(ei.value, RuntimeError)
    assert f":{_line_of(DictKey.forward, 'index_select')} in forward" in _notes(ei)
    with pytest.raises(RuntimeError, match="cannot contain a Node"):
        torch.fx.symbolic_trace(DictKey())


def test_user_frame_skips_frames_of_torch_code():
    torch_dir = os.path.dirname(torch.__file__)
    namespace = {}
    exec(compile("def call(fn):\n    return fn()\n", os.path.join(torch_dir, "_fake_lib.py"), "exec"), namespace)
    frame = namespace["call"](lambda: user_frame(sys._getframe()))
    assert frame.f_code.co_name == "<lambda>"
    frame = namespace["call"](user_frame)  # the innermost frame is torch's: skipped
    assert frame.f_code.co_name == "test_user_frame_skips_frames_of_torch_code"


def test_custom_to_bool_can_decide_branches():
    class AlwaysTrue(Tracer):
        def to_bool(self, obj):
            return True

    graph = AlwaysTrue().trace(DynamicIf())
    assert [n.op for n in graph.nodes][-1] == "output"
    assert "neg" not in [n.name for n in graph.nodes]


def test_patches_restored_after_every_error_kind():
    call, getattr_ = nn.Module.__call__, nn.Module.__getattr__
    for root in (DynamicIf(), iterate, length, DictKey(), Nested()):
        with pytest.raises(ValueError):
            symbolic_trace(root)
        assert nn.Module.__call__ is call and nn.Module.__getattr__ is getattr_
    assert not fx.tracer.is_fx_tracing()


def test_trace_error_is_not_noted_twice():
    class Twice(Tracer):
        def to_bool(self, obj):
            try:
                return super().to_bool(obj)
            except TraceError:
                raise

    with pytest.raises(TraceError) as ei:
        Twice().trace(DynamicIf())
    assert len(ei.value.__notes__) == 1


# -- the helpers passes use ------------------------------------------------------------------------


def test_user_frame_skips_fxdist_and_torch():
    frame = user_frame()
    assert frame is not None and frame.f_code.co_name == "test_user_frame_skips_fxdist_and_torch"


def test_location_of_stack_trace_reads_the_innermost_frame():
    class Doubling(nn.Module):
        def forward(self, x):
            return x * 2

    gm = symbolic_trace(Doubling())
    mul = [n for n in gm.graph.nodes if n.op == "call_function"][0]
    line = _line_of(Doubling.forward, "return x * 2")
    assert location_of_stack_trace(mul.stack_trace) == f"tests/fx/{__file__.rsplit('/', 1)[-1]}:{line} in forward: `return x * 2`"
    assert location_of_stack_trace(None) is None and location_of_stack_trace("no frames") is None
    site = describe_location("/x/site-packages/torchrec/models/dlrm.py", 87, "forward", "  if d > 0:\n")
    assert site == "torchrec/models/dlrm.py:87 in forward: `if d > 0:`"
