"""Resharding (a run resumed on another number of servers): server checkpoints gathered and scattered onto another number of servers
(:mod:`scheduling.ps.reshard`); servers loaded with them train on exactly as the original ones. A model through
the pass on 2, 3, then 1 servers: tests/scheduling/test_placement_restore.py."""

from __future__ import annotations

import pytest
import torch

from scheduling.ps.dynamic import DynamicSpec
from scheduling.ps.reshard import format_moves, gather_tables, layout_of, reshard, scatter_tables
from scheduling.ps.server import PSServer
from scheduling.ps.shard_plan import ShardSpec, TableSpec, plan_shards

FIXED = TableSpec("fixed", 10, 3, ("f",))
DYN = TableSpec("dyn", 6, 3, ("d",), dynamic=DynamicSpec(6, 1))


def _batch(fixed_ids: list[int], dyn_ids: list[int]):
    """A KeyedJaggedTensor's wire form: features f (fixed) and d (dynamic), one id per bag."""
    ids = torch.tensor(fixed_ids + dyn_ids, dtype=torch.int64)
    return (("f", "d"), ids, torch.ones(len(ids), dtype=torch.int64), None)


def _servers(n: int, shards: list[ShardSpec], storage: str = "fp32") -> list[PSServer]:
    servers = [PSServer(f"ps{s}") for s in range(n)]
    for s, srv in enumerate(servers):
        srv.configure("ns", shards, s, "rowwise_adagrad", {"lr": 0.5}, seed=3, storage=storage)
    return servers


def _train(servers: list[PSServer], steps: range) -> list[torch.Tensor]:
    """A lookup and a push on every server each step, as a client does: each server pools its shards' rows of
    the batch, a feature's bags are the sum over servers, and each server gets the gradient columns of its
    features. Returns per step the pooled ``(B, 6)`` rows of f and d (the model's view)."""
    seen = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        batch = _batch(torch.randint(0, 10, (4,), generator=gen).tolist(),
                       (torch.randint(0, 9, (4,), generator=gen) * (1 << 40) + 1).tolist())
        grads = {"f": torch.randn(4, 3, generator=gen), "d": torch.randn(4, 3, generator=gen)}
        pooled = {"f": torch.zeros(4, 3), "d": torch.zeros(4, 3)}
        for srv in servers:
            layout = srv.layouts["ns"]
            if layout:
                rows = srv.lookup("ns", batch)
                for (_, feat), part in zip(layout, rows.split(3, dim=1)):
                    pooled[feat] += part
                srv.push("ns", batch, torch.cat([grads[feat] for _, feat in layout], dim=1))
        seen.append(torch.cat([pooled["f"], pooled["d"]], dim=1))
    return seen


@pytest.mark.parametrize("storage", ["fp32", "fp16"])
def test_resharded_servers_train_exactly_as_the_original_ones(storage):
    """A row-wise fixed table and a dynamic one on 2 servers, resharded to 3 (the fixed table's blocks cut
    anew, the dynamic table moved to another server), train on exactly as the 2 servers do."""
    two = plan_shards([FIXED], 2, "row_wise") + [ShardSpec(DYN, 1, 0, 6)]
    three = plan_shards([FIXED], 3, "row_wise") + [ShardSpec(DYN, 2, 0, 6)]
    ref = _servers(2, two, storage)
    _train(ref, range(5))
    states = [srv.state_dict() for srv in ref]
    assert layout_of(states) == {"ns/dyn": (1,), "ns/fixed": (0, 1)}
    moved = reshard(states, {"ns": three}, 3)
    assert [sorted(m) for m in moved] == [["ns/fixed@0"], ["ns/fixed@4"], ["ns/dyn@0", "ns/fixed@8"]]
    new = _servers(3, three, storage)
    for srv, state in zip(new, moved):
        srv.load_state_dict(state)
    assert layout_of([srv.state_dict() for srv in new]) == {"ns/dyn": (2,), "ns/fixed": (0, 1, 2)}
    a, b = torch.cat(_train(ref, range(5, 10)), 1), torch.cat(_train(new, range(5, 10)), 1)
    assert a.shape == b.shape and torch.equal(a, b)
    before, after = gather_tables([s.state_dict() for s in ref])["ns"], gather_tables([s.state_dict() for s in new])["ns"]
    for name in ("fixed", "dyn"):
        assert torch.equal(before[name]["weight"], after[name]["weight"])
        assert torch.equal(before[name]["state"], after[name]["state"])
    for key in ("map_ids", "map_slots", "last_seen", "cand_ids", "cand_counts"):
        assert torch.equal(before["dyn"]["dynamic"][key], after["dyn"]["dynamic"][key]), key
    assert before["dyn"]["dynamic"]["counters"] == after["dyn"]["dynamic"]["counters"]
    assert before["dyn"]["dynamic"]["step"] == after["dyn"]["dynamic"]["step"] == 10


def test_reshard_refuses_lost_or_mismatched_tables():
    two = plan_shards([FIXED], 2, "row_wise") + [ShardSpec(DYN, 1, 0, 6)]
    states = [srv.state_dict() for srv in _servers(2, two)]
    tables = gather_tables(states)
    with pytest.raises(ValueError, match=r"no shard of tables \['dyn'\]: their rows would be lost"):
        scatter_tables(tables, {"ns": plan_shards([FIXED], 3, "row_wise")}, 3)
    with pytest.raises(ValueError, match="a dynamic table moves whole"):
        scatter_tables(tables, {"ns": [ShardSpec(FIXED, 0, 0, 10), ShardSpec(DYN, 0, 0, 3), ShardSpec(DYN, 1, 3, 6)]}, 2)
    bigger = TableSpec("fixed", 12, 3, ("f",))
    with pytest.raises(ValueError, match=r"checkpoint holds 10 x 3 rows, the new layout 12 x 3"):
        scatter_tables(tables, {"ns": [ShardSpec(bigger, 0, 0, 12), ShardSpec(DYN, 0, 0, 6)]}, 1)
    with pytest.raises(ValueError, match=r"server index 4 outside 0 \.\. 1"):
        scatter_tables(tables, {"ns": [ShardSpec(FIXED, 4, 0, 10), ShardSpec(DYN, 0, 0, 6)]}, 2)
    with pytest.raises(ValueError, match="checkpoint has no tables of 'other'"):
        scatter_tables(tables, {"ns": two, "other": two}, 2)
    with pytest.raises(ValueError, match=r"rows \[5, 10\) are on no server"):
        gather_tables(states[:1])
    with pytest.raises(ValueError, match=r"rows \[0, 5\) are held twice"):
        gather_tables([states[0], states[0]])


def test_format_moves_marks_the_tables_that_stay():
    text = format_moves({"a": ["ps0"], "b": ["ps1"]}, {"a": ["ps0"], "b": ["ps2"], "c": ["ps1"]})
    assert text.splitlines() == ["  a  ps0 -> ps0  (stays)", "  b  ps1 -> ps2", "  c  - -> ps1"]
