"""Whole-table checkpoints of the ``parameter_servers`` pass restored on other servers (to resume a run on
another number of servers, :mod:`scheduling.placement.restore`): a model trained on 2 servers, then resharded to 3,
then to 1, trains exactly as on 2 servers throughout (losses, tables, optimizer state, a dynamic table's map and
counters, dense weights)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch import nn


class Model(nn.Module):
    """Two fixed tables (EmbeddingBag) and a dynamic one (Embedding over raw ids), then a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.EmbeddingBag(50, 4, mode="sum")        # 800 bytes
        self.small = nn.EmbeddingBag(30, 4, mode="sum")      # 480 bytes
        self.dyn = nn.Embedding(8, 4)                        # dynamic: capacity 16 (256 bytes), raw ids
        self.top = nn.Linear(3 + 12, 1)

    def forward(self, x, a, b, ids):
        h = torch.cat([x, self.big(a), self.small(b), self.dyn(ids)], dim=1)
        return self.top(h).squeeze(1)


def _batch_of(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randn(8, 3, generator=gen), torch.randint(0, 50, (8, 2), generator=gen),
            torch.randint(0, 30, (8, 2), generator=gen),
            torch.randint(0, 24, (8,), generator=gen) * (1 << 40) + 5,   # 24 ids > capacity 16: evictions
            torch.randn(8, generator=gen))


_NAMES = itertools.count()


def _segment(num_servers: int, steps: range, checkpoint: dict | None):
    """Train ``steps`` on ``num_servers`` fresh servers, from ``checkpoint`` (or the seed's weights); returns the
    losses and a checkpoint (dense weights + :func:`table_checkpoint`) with the layout the pass chose."""
    import fxdist
    import scheduling
    from scheduling import placement
    from scheduling.placement.restore import load_table_checkpoint, table_checkpoint, table_layout
    from scheduling.ps import LocalCluster

    torch.manual_seed(0)
    with LocalCluster(num_servers=num_servers):
        to_servers = functools.partial(scheduling.parameter_servers, optimizer="rowwise_adagrad", lr=0.1,
                                       verbose=False, client=f"reshard{next(_NAMES)}", group_tables=False,
                                       dynamic={"dyn": {"capacity": 16, "min_count": 1}})
        gm = fxdist.optimize(Model(), passes=(to_servers,))
        try:
            if checkpoint is not None:
                gm.load_state_dict(checkpoint["dense"], strict=False)
                load_table_checkpoint(gm, checkpoint["tables"])
            opt = torch.optim.SGD(gm.parameters(), lr=0.05)
            losses = []
            for step in steps:
                x, a, b, ids, y = _batch_of(step)
                loss = ((gm(x, a, b, ids) - y) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            placement.flush(gm)
            out = {"dense": {k: v.detach().clone() for k, v in gm.state_dict().items()},
                   "tables": table_checkpoint(gm), "layout": table_layout(gm)}
        finally:
            placement.close(gm)
    return losses, out


@pytest.mark.timeout(300)
def test_training_resharded_2_3_1_equals_training_on_2_servers():
    from scheduling.placement.restore import replan

    k = 4
    ref_losses, ref = _segment(2, range(3 * k), None)
    losses1, ck1 = _segment(2, range(k), None)
    losses2, ck2 = _segment(3, range(k, 2 * k), ck1)
    losses3, ck3 = _segment(1, range(2 * k, 3 * k), ck2)
    # the placement rule moved the tables: largest first to the emptiest server
    where = [{path: t["servers"] for path, t in ck["layout"].items()} for ck in (ck1, ck2, ck3)]
    assert where[0] == {"big": ["ps0"], "small": ["ps1"], "dyn": ["ps1"]}
    assert where[1] == {"big": ["ps0"], "small": ["ps1"], "dyn": ["ps2"]}
    assert where[2] == {"big": ["ps0"], "small": ["ps0"], "dyn": ["ps0"]}
    assert ck1["layout"]["dyn"]["dynamic"] and not ck1["layout"]["big"]["dynamic"]
    # replan predicts the pass's layout on other servers from the recorded one
    assert replan(ck1["layout"], ["ps0", "ps1", "ps2"]) == where[1] and replan(ck1["layout"], ["ps0"]) == where[2]
    assert losses1 + losses2 + losses3 == ref_losses
    assert set(ck3["tables"]) == set(ref["tables"]) == {"big.weight", "big.momentum", "small.weight",
                                                         "small.momentum", "dyn.weight", "dyn.momentum", "dyn.dynamic"}
    for key in ("big.weight", "big.momentum", "small.weight", "small.momentum", "dyn.weight", "dyn.momentum"):
        assert torch.equal(ck3["tables"][key], ref["tables"][key]), key
    dyn, ref_dyn = ck3["tables"]["dyn.dynamic"], ref["tables"]["dyn.dynamic"]
    assert dyn["counters"] == ref_dyn["counters"] and dyn["step"] == ref_dyn["step"] == 3 * k
    assert dyn["counters"]["evictions"] > 0  # the LRU state moved too
    assert torch.equal(dyn["map_ids"], ref_dyn["map_ids"]) and torch.equal(dyn["map_slots"], ref_dyn["map_slots"])
    for key, value in ref["dense"].items():
        assert torch.equal(ck3["dense"][key], value), key


def test_load_table_checkpoint_names_a_missing_dynamic_map():
    _, ck = _segment(1, range(1), None)
    tables = {k: v for k, v in ck["tables"].items() if k != "dyn.dynamic"}
    with pytest.raises(KeyError, match="'dyn' is a dynamic table and the checkpoint has no 'dyn.dynamic'"):
        _segment(1, range(0), {"dense": ck["dense"], "tables": tables})
