"""The socket transport's restricted unpickler (``scheduling.ps.transport.safe_pickle``)."""

from __future__ import annotations

import collections
import io
import os
import pickle
import subprocess

import numpy
import pytest
import torch

from scheduling.ps.dynamic import DynamicSpec
from scheduling.ps.shard_plan import ShardSpec, TableSpec
from scheduling.ps.transport import safe_pickle
from scheduling.ps.transport.socket_wire import dumps


class _Call:
    """Pickles as a call of ``fn(*args)`` (what a hostile message does)."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _loads(obj):
    meta, buffers = dumps(obj)
    return safe_pickle.loads(meta, [torch.from_numpy(numpy.frombuffer(bytes(b), numpy.uint8).copy())
                                    for b in buffers])


@pytest.mark.parametrize("fn, args, named", [
    (os.system, ("true",), "posix.system"),
    (subprocess.call, (["true"],), "subprocess.call"),
    (eval, ("1",), "builtins.eval"),
    (getattr, ("x", "upper"), "builtins.getattr"),
    (torch.load, ("x",), "torch.serialization.load"),
    (bytearray, (1 << 40,), "builtins.bytearray"),
])
def test_a_global_off_the_list_is_refused_by_name(fn, args, named):
    data = pickle.dumps(_Call(fn, *args), protocol=5)
    with pytest.raises(pickle.UnpicklingError, match=rf"refused global {named}"):
        safe_pickle.loads(data)


def test_what_requests_and_answers_carry_decodes_unchanged():
    spec = ShardSpec(TableSpec("t", 10, 4, ("f",), dynamic=DynamicSpec(8)), 0, 0, 10)
    value = ("ns", (torch.arange(5), torch.ones(3, dtype=torch.float16)), None, ("client", 3, 60.0, ("g", 0, 2, 1)),
             [spec], collections.OrderedDict(a=torch.zeros(2, 2)), {1, 2}, frozenset({3}), slice(1, 2), range(3),
             1 + 2j, torch.Size([2, 3]), torch.device("cpu"), torch.bfloat16, ValueError("bad"), KeyError("k"),
             torch.nn.Parameter(torch.ones(2)), torch.eye(3).to_sparse())
    got = _loads(value)
    assert got[0] == "ns" and torch.equal(got[1][0], torch.arange(5)) and got[1][1].dtype == torch.float16
    assert got[3] == ("client", 3, 60.0, ("g", 0, 2, 1)) and got[4] == [spec]
    assert isinstance(got[5], collections.OrderedDict) and got[6:13] == value[6:13] and got[13] is torch.bfloat16
    assert type(got[14]) is ValueError and got[14].args == ("bad",) and type(got[15]) is KeyError
    assert isinstance(got[16], torch.nn.Parameter) and torch.equal(got[17].to_dense(), torch.eye(3))


def test_the_project_exceptions_cross():
    from scheduling.ps.client import PSUnavailableError

    got = _loads(PSUnavailableError("server gone"))
    assert type(got) is PSUnavailableError and "server gone" in str(got)


def test_a_tensor_rebuild_needs_a_received_buffer():
    from scheduling.ps.transport.socket_wire import _rebuild

    data = pickle.dumps(_Call(_rebuild, b"\x00" * 8, torch.float32, (2,)), protocol=5)
    with pytest.raises(pickle.UnpicklingError, match="not a received byte buffer"):
        safe_pickle.loads(data)


def test_a_sparse_tensor_with_indices_out_of_its_size_is_refused():
    bad = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2), (5,))
    meta, buffers = dumps(bad)
    index = torch.from_numpy(numpy.frombuffer(bytes(buffers[0]), numpy.uint8).copy())
    index.view(torch.int64)[1] = 1 << 40            # an index far outside the tensor
    with pytest.raises(RuntimeError, match="index"):
        safe_pickle.loads(meta, [index] + [torch.from_numpy(numpy.frombuffer(bytes(b), numpy.uint8).copy())
                                            for b in buffers[1:]])


def test_the_legacy_setstate_of_a_tensor_cannot_grow_a_received_buffer():
    """A message may apply torch's legacy ``Tensor.__setstate__`` (``set_`` with any size) to a rebuilt tensor: the
    received buffers are numpy memory, which torch refuses to resize (no allocation beyond the frame limits)."""
    from scheduling.ps.transport.socket_wire import _rebuild

    class _Grow:
        def __reduce__(self):
            source = _Call(_rebuild, pickle.PickleBuffer(bytearray(4)), torch.float32, (1,))
            return _rebuild, (pickle.PickleBuffer(bytearray(4)), torch.float32, (1,)), (source, 0, (1 << 30,), (1,))

    buffers: list = []
    data = pickle.dumps(_Grow(), protocol=5, buffer_callback=buffers.append)
    fresh = [torch.from_numpy(numpy.empty(4, numpy.uint8)) for _ in buffers]
    with pytest.raises(RuntimeError, match="not resizable"):
        safe_pickle.loads(data, fresh)


def test_unpickling_is_not_much_slower_than_pickle_loads():
    import timeit

    meta, buffers = dumps(("ns", (torch.arange(64), torch.arange(65), torch.ones(64)), None, ("c", 1, 60.0)))
    bufs = [torch.from_numpy(numpy.frombuffer(bytes(b), numpy.uint8).copy()) for b in buffers]
    plain = min(timeit.repeat(lambda: pickle.load(io.BytesIO(meta), buffers=bufs), number=2000, repeat=3))
    safe = min(timeit.repeat(lambda: safe_pickle.loads(meta, bufs), number=2000, repeat=3))
    assert safe < plain * 2 + 0.02, (safe, plain)    # per message: a few microseconds at most
