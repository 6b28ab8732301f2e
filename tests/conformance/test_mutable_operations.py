"""``check_mutable_operations`` decides as torch.fx does: the call's arguments are bound against every schema
of the target, and the call is refused when the one schema that accepts them is mutable.

``torch.sigmoid(x, out=y)`` binds only ``aten::sigmoid.out`` and is refused; ``torch.add(x, y, out=y)`` binds
more than one overload (ambiguous: not checked, as torch.fx); a functional call is recorded. Compared per
call: the graph, or the exception class and the whole first line of its message.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx

import fxdist as fx
from tests._differential import compare_graphs
from tests.conformance._outcome import assert_same_error, outcome


class Calls(torch.nn.Module):
    def __init__(self, call) -> None:
        super().__init__()
        self.call = call

    def forward(self, x, y):
        return self.call(x, y)


CALLS = {
    "sigmoid_out": (lambda x, y: torch.sigmoid(x, out=y), True),
    "tanh_out": (lambda x, y: torch.tanh(x, out=y), True),
    "clamp_min_out_ambiguous": (lambda x, y: torch.clamp_min(x, 0.5, out=y), False),  # .out and .Tensor_out bind
    "relu_": (lambda x, y: torch.relu_(x), True),
    "aten_add_": (lambda x, y: torch.ops.aten.add_.Tensor(x, y), True),
    "add_out_ambiguous": (lambda x, y: torch.add(x, y, out=y), False),
    "aten_add_out_unbound": (lambda x, y: torch.ops.aten.add.out(x, y), False),
    "sigmoid": (lambda x, y: torch.sigmoid(x), False),
    "add": (lambda x, y: torch.add(x, y, alpha=2), False),
}


def _trace(lib, call):
    tracer = lib.Tracer()
    tracer.check_mutable_operations = True
    return tracer.trace(Calls(call))


@pytest.mark.parametrize("name", list(CALLS))
def test_mutable_operation_check_as_torch_fx(name):
    call, refused = CALLS[name]
    kind_ours, ours = outcome(lambda: _trace(fx, call))
    kind_theirs, theirs = outcome(lambda: _trace(torch.fx, call))
    assert kind_ours == kind_theirs == ("raised" if refused else "ok")
    if refused:
        assert_same_error(ours, theirs, head_chars=400)
        assert str(ours).startswith("Tried to trace mutable operation aten::")
    else:
        compare_graphs(ours, theirs)
