"""A parameter server's lookup/push maths (:mod:`scheduling.ps.server`), in process."""

from __future__ import annotations

import torch

from scheduling.ps import server as srv
from scheduling.ps.shard_plan import TableSpec, plan_shards


def test_row_wise_shards_sum_to_the_full_lookup_and_push_touches_only_their_rows():
    spec = TableSpec("t", 6, 3, ("f",))
    weight = torch.randn(6, 3)
    full, parts = srv.PSServer("full"), [srv.PSServer(f"p{i}") for i in range(2)]
    full.configure("ns", plan_shards([spec], 1), 0, "sgd", {"lr": 1.0}, 0, {"t": weight})
    for i, p in enumerate(parts):
        p.configure("ns", plan_shards([spec], 2, "row_wise"), i, "sgd", {"lr": 1.0}, 0, {"t": weight})
    batch = (("f",), torch.tensor([0, 5, 5, 2, 3]), torch.tensor([3, 0, 2]), torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0]))
    expected = full.lookup("ns", batch)
    torch.testing.assert_close(parts[0].lookup("ns", batch) + parts[1].lookup("ns", batch), expected)
    grad = torch.ones(3, 3)
    assert full.push("ns", batch, grad) == 4
    assert [p.push("ns", batch, grad) for p in parts] == [2, 2]      # rows {0, 2} and {3, 5}
    merged = torch.cat([parts[0].shards["ns/t@0"].weight, parts[1].shards["ns/t@3"].weight])
    torch.testing.assert_close(merged, full.shards["ns/t@0"].weight)
    torch.testing.assert_close(full.shards["ns/t@0"].weight[1], weight[1])   # untouched row
