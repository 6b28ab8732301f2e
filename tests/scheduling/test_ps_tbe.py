"""The servers' FBGEMM kernel (:mod:`scheduling.ps.tbe`) against fxdist's own stacked path
(``FXDIST_PS_KERNEL=fxdist``), on in-process ``PSServer``s: the same lookups and the same table updates to
float32 rounding, for SGD and row-wise Adagrad, weighted batches, row-wise shards, a table pooling two features
and batches whose keys come in another order (with a key the server does not pool)."""

from __future__ import annotations

import pytest
import torch

from scheduling.ps.server import PSServer
from scheduling.ps.shard_plan import TableSpec, plan_shards
from scheduling.ps.tbe import KERNEL_ENV

pytest.importorskip("fbgemm_gpu")

TABLES = [TableSpec("t0", 50, 8, ("f0",)), TableSpec("t1", 30, 8, ("f1", "f2")), TableSpec("t2", 40, 8, ("f3",))]
B = 6


def _server(monkeypatch, kernel: str, optimizer: str, sharding: str, storage: str = "fp32") -> PSServer:
    monkeypatch.setenv(KERNEL_ENV, kernel)
    server = PSServer("ps0")
    kwargs = {"lr": 0.1, **({"eps": 1e-6} if optimizer == "rowwise_adagrad" else {})}
    server.configure("ns", plan_shards(TABLES, 2, sharding), 0, optimizer, kwargs, seed=3, storage=storage)
    return server


def _batch(gen: torch.Generator, weighted: bool, keys=("f3", "f0", "x", "f2", "f1")):
    rows = {"f0": 50, "f1": 30, "f2": 30, "f3": 40, "x": 7}
    lengths = torch.randint(0, 4, (len(keys) * B,), generator=gen)
    values = torch.cat([torch.randint(0, rows[k], (int(n),), generator=gen)
                        for k, n in zip(keys, lengths.view(len(keys), B).sum(1))])
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return tuple(keys), values, lengths, weights


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
@pytest.mark.parametrize("weighted", [False, True])
def test_fbgemm_kernel_trains_as_the_own_path(monkeypatch, optimizer, sharding, weighted):
    fbgemm = _server(monkeypatch, "fbgemm", optimizer, sharding)
    own = _server(monkeypatch, "fxdist", optimizer, sharding)
    assert fbgemm.fused["ns"] is not None and fbgemm.fused["ns"].kernel is not None
    assert own.fused["ns"].kernel is None
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        batch = _batch(gen, weighted)
        out = fbgemm.lookup("ns", batch)
        torch.testing.assert_close(out, own.lookup("ns", batch), rtol=1e-6, atol=1e-6)
        grad = torch.randn(out.shape, generator=gen)
        assert fbgemm.push("ns", batch, grad) == own.push("ns", batch, grad)
    mine, theirs = fbgemm.state_dict("ns"), own.state_dict("ns")
    assert mine.keys() == theirs.keys()
    for key in mine:
        torch.testing.assert_close(mine[key]["weight"], theirs[key]["weight"], rtol=1e-5, atol=1e-6)
        if mine[key]["state"] is not None:
            torch.testing.assert_close(mine[key]["state"], theirs[key]["state"], rtol=1e-5, atol=1e-6)


def test_the_kernel_applies_to_float32_rows_only(monkeypatch):
    assert _server(monkeypatch, "fbgemm", "sgd", "table_wise", storage="fp16").fused["ns"].kernel is None
    assert _server(monkeypatch, "fbgemm", "sgd", "table_wise", storage="fused8bit").fused["ns"].kernel is None


def test_checkpoint_rows_are_the_kernels(monkeypatch):
    """A server restored from another's state dict holds its rows in the kernel and answers as it."""
    a = _server(monkeypatch, "fbgemm", "rowwise_adagrad", "table_wise")
    gen = torch.Generator().manual_seed(2)
    batch = _batch(gen, False)
    a.push("ns", batch, torch.randn(a.lookup("ns", batch).shape, generator=gen))
    b = _server(monkeypatch, "fbgemm", "rowwise_adagrad", "table_wise")
    b.load_state_dict(a.state_dict())
    assert b.fused["ns"].kernel is not None
    torch.testing.assert_close(b.lookup("ns", batch), a.lookup("ns", batch), rtol=0, atol=0)


def test_own_path_is_the_default(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    server = PSServer("ps0")
    server.configure("ns", plan_shards(TABLES, 1), 0, "sgd", {"lr": 0.1}, seed=3)
    assert server.fused["ns"] is not None and server.fused["ns"].kernel is None
