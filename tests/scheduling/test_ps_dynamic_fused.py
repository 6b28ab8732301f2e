"""DynamicFused, the fused server path of a namespace's dynamic tables: the same outputs, rows and counters as
the server's per-shard path."""

from __future__ import annotations

import pytest
import torch

from scheduling.ps.dynamic_fused import DynamicFused
from tests.scheduling.test_ps_dynamic_group import DIM, _same, _server


@pytest.mark.parametrize("keys", [("f0", "f1", "f2"), ("f2", "x", "f0", "f1")])
def test_server_fused_dynamic_path_matches_its_per_shard_path(keys):
    """All-dynamic namespaces take DynamicFused (one group lookup per request); the per-shard path
    (lookup_tables / push_tables) gives the same outputs, rows and counters, whatever the KJT's key order and
    keys not pooled here."""
    fast, slow = _server("fp32"), _server("fp32")
    assert isinstance(fast.fused["ns"], DynamicFused)
    slow.fused["ns"] = None
    for step in range(12):
        gen = torch.Generator().manual_seed(step)
        lengths = torch.randint(0, 4, (len(keys) * 4,), generator=gen)
        values = torch.randint(0, 20, (int(lengths.sum()),), generator=gen) * (1 << 50) + 5
        weights = torch.rand(values.numel(), generator=gen)
        batch = (keys, values, lengths.int(), weights)
        out = fast.lookup("ns", batch)
        assert out.shape == (4, 3 * DIM) and torch.equal(out, slow.lookup("ns", batch)), step
        grad = torch.randn(out.shape, generator=gen)
        assert fast.push("ns", batch, grad) == slow.push("ns", batch, grad)
    for i in range(3):
        a, b = fast.shards[f"ns/d{i}@0"].dynamic, slow.shards[f"ns/d{i}@0"].dynamic
        _same(a, b, i)
        assert a.stats()["evictions"] > 0
    with pytest.raises(ValueError, match="no feature 'f1'"):
        fast.lookup("ns", (("f0", "f2"), torch.zeros(2, dtype=torch.long), torch.ones(8, dtype=torch.int), None))
