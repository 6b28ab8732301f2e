"""scheduling.ps.dynamic_index: the hash table, LRU log and free slots behind dynamic tables, against plain
Python dicts and sorts."""

from __future__ import annotations

import random

import pytest
import torch

from scheduling.ps.dynamic import DynamicSpec, DynamicTable
from scheduling.ps.dynamic_index import SlotIndex, mix64_torch
from scheduling.ps.optimizer import make_optimizer
from tests.scheduling.test_ps_dynamic import Reference


def test_hash_table_finds_every_id_after_inserts_removals_and_rehashes():
    cap, tables = 64, 2
    index = SlotIndex(tables, cap)
    slot_id = torch.full((tables, cap), -1, dtype=torch.int64)
    rng = random.Random(0)
    truth: list[dict[int, int]] = [{}, {}]
    for _ in range(200):                                     # far more removals than H / 4: rehashes happen
        for t in range(tables):
            if len(truth[t]) == cap or (truth[t] and rng.random() < 0.5):
                ident = rng.choice(sorted(truth[t]))
                s = truth[t].pop(ident)
                index.remove(torch.tensor([t]), torch.tensor([s]))
                slot_id[t, s] = -1
            else:
                s = int((slot_id[t] < 0).nonzero()[0])
                ident = rng.randrange(1 << 62)            # raw ids are >= 0 (-1 marks a free slot)
                if ident in truth[t]:
                    continue
                slot_id[t, s] = ident
                truth[t][ident] = s
                index.insert(torch.tensor([t]), torch.tensor([s]), torch.tensor([ident]))
            index.maintain(slot_id)
    assert int(index.deleted.max()) <= index.hsize // 4
    for t in range(tables):
        ids = list(truth[t]) + [12345678901, 5]
        found = index.find(slot_id, torch.full((len(ids),), t), torch.tensor(ids))
        assert found.tolist() == [truth[t].get(i, -1) for i in ids]


def test_victims_are_the_least_recently_seen_ties_by_smallest_id_and_the_log_stays_bounded():
    cap = 8
    index = SlotIndex(1, cap)
    slot_id = torch.full((1, cap), -1, dtype=torch.int64)
    last_seen = torch.zeros(1, cap, dtype=torch.int64)
    rng = random.Random(1)
    tix = torch.tensor([0])
    for step in range(1, 400):
        occ = (slot_id[0] >= 0).nonzero().flatten()
        seen = sorted(rng.sample(occ.tolist(), min(len(occ), 3)), key=lambda s: int(slot_id[0, s]))
        last_seen[0, seen] = step
        expect = sorted((s for s in occ.tolist() if s not in seen),
                        key=lambda s: (int(last_seen[0, s]), int(slot_id[0, s])))[:2]
        fresh = []
        if int(index.high[0]) < cap:
            fresh = index.take_free([0], tix, torch.tensor([1]))[0].tolist()
        else:
            got, n = index.victims(tix, torch.tensor([2]), slot_id, last_seen)
            assert got[0, :int(n[0])].tolist() == expect
            fresh = expect
        for s in fresh:
            slot_id[0, s] = rng.randrange(1 << 40)
            last_seen[0, s] = step
        rows = sorted(set(seen) | set(fresh), key=lambda s: int(slot_id[0, s]))
        entries = torch.tensor([[step * cap + s for s in rows]], dtype=torch.int64)
        index.append(tix, entries, torch.tensor([len(rows)]), slot_id, last_seen)
        assert int(index.tail[0] - index.head[0]) <= index.log.shape[1] == cap + cap // 2 + 1024


def test_a_rehash_wraps_a_cluster_at_the_end_of_the_table_to_its_front():
    cap = 8
    index = SlotIndex(1, cap)
    h = index.hsize
    homes = mix64_torch(torch.arange(100_000)) & (h - 1)
    ids = (homes == h - 1).nonzero().flatten()[:3].tolist() + (homes == 0).nonzero().flatten()[:2].tolist()
    slot_id = torch.full((1, cap), -1, dtype=torch.int64)
    slot_id[0, :5] = torch.tensor(ids)
    index.reindex(0, slot_id, torch.zeros(1, cap, dtype=torch.int64))
    assert index.hslot[0, h - 1] >= 0 and index.hslot[0, :4].ge(0).all()      # the cluster wrapped
    found = index.find(slot_id, torch.zeros(6, dtype=torch.int64), torch.tensor(ids + [100_001]))
    assert found.tolist() == [0, 1, 2, 3, 4, -1]


@pytest.mark.usefixtures("dynamic_backend")
@pytest.mark.parametrize("capacity, min_count, expire", [(6, 1, None), (8, 2, 5), (10, 1, 3)])
def test_long_runs_through_log_compactions_and_rehashes_match_the_reference(capacity, min_count, expire):
    """Enough steps that each table's log is compacted and its hash table rebuilt several times: slots,
    candidates and rejections follow the one-id-at-a-time reference exactly, rows within float rounding."""
    table = DynamicTable(3, DynamicSpec(capacity, min_count, expire), make_optimizer("sgd", lr=0.5), seed=7, salt=1)
    ref = Reference(3, capacity, min_count, expire, 0.5)
    gen = torch.Generator().manual_seed(capacity)
    compactions = 0
    for step in range(600):
        ids = torch.randint(0, 30, (20,), generator=gen) * 1_000_003 + (1 << 41)
        tail = int(table.group.index.tail[0])
        # rows within float rounding: over hundreds of steps the reference's per-id gradient sums
        # (``grads[ids == i].sum(0)``) and the table's ``index_add_`` can round differently; slots are exact
        torch.testing.assert_close(table.lookup(ids)[0], ref.lookup(ids), rtol=0, atol=1e-5)
        compactions += int(table.group.index.tail[0]) < tail
        grads = torch.randn(20, 3, generator=gen)
        table.push(ids, grads)
        ref.push(ids, grads)
        assert {i: int(s) for i, s in zip(table.map_ids.tolist(), table.map_slots)} == ref.slot, step
    assert compactions >= 2
    assert table.stats()["rejected"] == ref.rejected
    assert sorted(table.cand_ids.tolist()) == sorted(ref.cand)
