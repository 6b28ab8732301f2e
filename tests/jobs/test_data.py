"""Criteo parsing, hashing, log transform, malformed lines, sharding, held-out split, synthetic data."""

from __future__ import annotations

import math

import pytest
import torch

from jobs.data import NUM_DENSE, NUM_SPARSE, CriteoShard, parse_line, resolve_data_path, write_synthetic_criteo


def _line(label="1", ints=None, cats=None):
    ints = ints if ints is not None else [str(i) for i in range(NUM_DENSE)]
    cats = cats if cats is not None else [f"{j:08x}" for j in range(NUM_SPARSE)]
    return "\t".join([label, *ints, *cats]) + "\n"


def test_parse_line_log_transform_and_hashing():
    ints = ["", "-1", "0", "1", "9", *["2"] * (NUM_DENSE - 5)]
    cats = ["", "68fd1e64", *["68fd1e64"] * (NUM_SPARSE - 2)]
    dense, sparse, label = parse_line(_line("0", ints, cats), table_size=1000)
    assert label == 0.0
    assert dense[:5] == [0.0, 0.0, 0.0, math.log(2), math.log(10)]
    assert sparse[0] == 0  # empty categorical -> the "missing" id
    assert all(1 <= s < 1000 for s in sparse[1:])
    # the same value in different tables hashes independently, and hashing is stable across calls
    assert len(set(sparse[1:])) > 1
    assert parse_line(_line("0", ints, cats), table_size=1000)[1] == sparse


@pytest.mark.parametrize(
    "line, reason",
    [
        ("1\t2\t3\n", "field_count"),
        (_line(label="x"), "label"),
        (_line(ints=["1.5"] + ["1"] * (NUM_DENSE - 1)), "integer_feature"),
    ],
)
def test_malformed_reasons(line, reason):
    from jobs.data import MalformedLine

    with pytest.raises(MalformedLine) as info:
        parse_line(line, 100)
    assert info.value.reason == reason


def test_malformed_lines_are_counted_and_skipped(tmp_path):
    path = tmp_path / "c.tsv"
    lines = [_line(str(i % 2)) for i in range(20)]
    lines[3] = "garbage\n"
    lines[7] = _line(label="2")
    lines[11] = "\n"  # blank lines are ignored, not counted
    path.write_text("".join(lines))
    shard = CriteoShard(path, 100, eval_fraction=0.0)
    assert shard.stats.valid == 17
    assert dict(shard.stats.malformed) == {"field_count": 1, "label": 1}
    assert shard.stats.examples[0].startswith("line 4: field_count")
    assert len(shard) == 17


def test_shards_partition_training_lines_and_hold_out_eval(tmp_path):
    path = write_synthetic_criteo(tmp_path / "s.tsv", 103, seed=1)
    shards = [CriteoShard(path, 50, rank=r, world_size=3, eval_fraction=0.1) for r in range(3)]
    held = CriteoShard(path, 50, eval_fraction=0.1, split="eval")
    assert len(held) == 10  # every 10th of 103 lines
    assert sum(len(s) for s in shards) == 93
    rows = torch.cat([s.dense for s in shards] + [held.dense])
    full = CriteoShard(path, 50, eval_fraction=0.0)
    # together, the shards and the held-out rows are exactly the file's rows
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, full.dense.tolist()))
    with pytest.raises(ValueError, match="rank 3 is not in"):
        CriteoShard(path, 50, rank=3, world_size=3)


def test_batches_wrap_and_resume(tmp_path):
    path = write_synthetic_criteo(tmp_path / "s.tsv", 30, seed=2)
    shard = CriteoShard(path, 50, eval_fraction=0.0)
    it = shard.batches(8)
    first = [next(it) for _ in range(5)]  # 40 rows > 30: wraps around
    assert first[0].dense.shape == (8, NUM_DENSE) and first[0].sparse.shape == (8, NUM_SPARSE)
    assert first[0].sparse.dtype == torch.int64 and first[0].labels.shape == (8,)
    assert torch.equal(first[3].labels[6:], shard.labels[:2])
    resumed = next(shard.batches(8, start=3))
    assert torch.equal(resumed.sparse, first[3].sparse)


def test_synthetic_data_is_criteo_format_and_learnable(tmp_path):
    path = write_synthetic_criteo(tmp_path / "s.tsv", 2000, seed=0)
    shard = CriteoShard(path, 1000, eval_fraction=0.0)
    assert shard.stats.malformed_total == 0 and len(shard) == 2000
    rate = shard.labels.mean().item()
    assert 0.1 < rate < 0.6
    # a label that depends on the features: the first categorical feature alone separates classes
    from jobs.stats import auc

    ids = shard.sparse[:, 0]
    means = {int(i): shard.labels[ids == i].mean().item() for i in ids.unique()}
    scores = torch.tensor([means[int(i)] for i in ids])
    assert auc(scores, shard.labels) > 0.6


def test_real_criteo_sample(criteo_path):
    shard = CriteoShard(criteo_path, 20000, rank=0, world_size=2)
    assert shard.stats.valid == 10000 and shard.stats.malformed_total == 0
    assert len(shard) == 4500
    assert shard.dense.min() >= 0 and shard.sparse.max() < 20000


def test_resolve_data_path(tmp_path, monkeypatch):
    import jobs.data

    monkeypatch.setattr(jobs.data, "default_criteo_path", lambda: tmp_path / "absent.txt")
    path, note = resolve_data_path("", tmp_path, 50)
    assert path == tmp_path / "synthetic_criteo.tsv" and path.is_file()
    assert "no Criteo data found" in note and "generated 50 rows" in note
    with pytest.raises(FileNotFoundError, match="no such file"):
        resolve_data_path(str(tmp_path / "missing.tsv"), tmp_path, 50)
