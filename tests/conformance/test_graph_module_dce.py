"""``Graph.eliminate_dead_code`` keeps what torch.fx 2.13 keeps: collectives and torch's own registrations.

torch.fx decides with ``torch._library.utils.is_impure``: mutable schemas (every ``c10d::*_`` op), ops
with a registered effect, and its ``_side_effectful_functions`` set, which torch fills on import
(``_c10d_functional.wait_tensor``/``isend``/``irecv``/``batch_p2p_ops`` from
torch/distributed/_functional_collectives.py, dynamo's stream ops, ...). Functional collectives such as
``_c10d_functional.all_reduce`` return new tensors and are pure in both. fxdist matches by op name, so
it needs no torch.distributed import. fxdist additionally keeps Python-level ``torch.distributed``
calls (``dist.all_reduce(t)`` mutates ``t``; torch.fx would erase an unused one).
"""

import importlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx

import fxdist as fx

for _module in ("torch.distributed._functional_collectives", "torch._dynamo.variables.streams",
                "torch._dynamo.tensor_version_op", "torch.distributed.pipelining",
                "torch._functorch._activation_offloading.offload_ops"):
    try:  # fill torch.fx's registry the way these modules do in a real program
        importlib.import_module(_module)
    except Exception:  # noqa: BLE001, S110 - an optional part of torch missing in this build
        pass

from torch.fx.node import _side_effectful_functions  # noqa: E402 - after the imports that fill it


def _collective_ops() -> list[Any]:
    ops = []
    for schema in torch._C._jit_get_all_schemas():
        ns, _, name = schema.name.partition("::")
        if ns in ("_c10d_functional", "c10d", "_c10d_functional_autograd"):
            packet = getattr(getattr(torch.ops, ns), name)
            ops += [packet, getattr(packet, schema.overload_name or "default")]
    return sorted(set(ops), key=str)


COLLECTIVES = _collective_ops()


def _kept(lib: Any, target: Any, args: tuple[Any, ...] = ()) -> bool:
    """Whether DCE keeps an unused call of ``target``."""
    g = lib.Graph()
    x = g.placeholder("x")
    g.call_function(target, args or (x,))
    g.output(x)
    g.eliminate_dead_code()
    return len(g.nodes) == 3


def test_collective_ops_exist() -> None:
    names = {str(op) for op in COLLECTIVES}
    assert {"_c10d_functional.wait_tensor.default", "_c10d_functional.all_reduce", "c10d.allreduce_.default",
            "c10d.barrier"} <= names


@pytest.mark.parametrize("op", COLLECTIVES, ids=str)
def test_dce_keeps_collectives_like_torch_fx(op: Any) -> None:
    assert _kept(fx, op) == _kept(torch.fx, op)


def test_waits_and_inplace_collectives_are_kept() -> None:
    for op in (torch.ops._c10d_functional.wait_tensor, torch.ops._c10d_functional.wait_tensor.default,
               torch.ops._c10d_functional.isend.default, torch.ops.c10d.allreduce_, torch.ops.c10d.broadcast_.default):
        assert _kept(fx, op), op
    assert not _kept(fx, torch.ops._c10d_functional.all_reduce.default)  # functional: pure, as in torch.fx


def _name(fn: Any) -> str:
    """A name of ``fn`` the same in every process (``str`` of a plain function holds its address: the parallel
    suite's workers must collect the same test ids)."""
    qualname = getattr(fn, "__qualname__", None)
    return f"{getattr(fn, '__module__', None)}.{qualname}" if qualname is not None else str(fn)


@pytest.mark.parametrize("fn", sorted(_side_effectful_functions, key=_name), ids=_name)
def test_everything_torch_registers_with_torch_fx_is_kept(fn: Any) -> None:
    assert _kept(fx, fn)


def test_python_level_collectives_kept_only_by_fxdist() -> None:
    """A documented extension: an unused ``dist.all_reduce(t)`` still reduces ``t`` in place."""
    assert _kept(fx, dist.all_reduce) and not _kept(torch.fx, dist.all_reduce)


def logged(x: Any) -> Any:
    return x


torch.fx.has_side_effect(logged)  # code written for torch.fx registers there (torchrec does)


def test_functions_registered_with_torch_fx_are_kept() -> None:
    assert _kept(fx, logged) and _kept(torch.fx, logged)
