"""recsys.criteo_shard: shards by file then by line, the held-out split, rows in memory (plain / gzip / many
files), malformed lines counted and skipped, the first pass, whole-file reads; one id hash for every reader."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch

from recsys.criteo_format import NUM_DENSE, NUM_SPARSE, DataError, data_files
from recsys.criteo_shard import CriteoShard, line_owner, read_file, scan
from recsys.criteo_stream import CriteoStream
from recsys.criteo_synth import write_synthetic_criteo

SIZES = [50 + 7 * j for j in range(NUM_SPARSE)]


def _line(label="1", ints=None, cats=None):
    ints = ints if ints is not None else [str(i) for i in range(NUM_DENSE)]
    cats = cats if cats is not None else [f"{j:08x}" for j in range(NUM_SPARSE)]
    return "\t".join([label, *ints, *cats]) + "\n"


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


def test_real_criteo_sample(criteo_path):
    shard = CriteoShard(criteo_path, 20000, rank=0, world_size=2)
    assert shard.stats.valid == 10000 and shard.stats.malformed_total == 0
    assert len(shard) == 4500
    assert shard.dense.min() >= 0 and shard.sparse.max() < 20000


def test_plain_gzip_and_many_files_hold_the_same_rows(layouts, tmp_path):
    plain = tmp_path / "all.tsv"  # the three gzip files, decompressed into one plain file
    plain.write_bytes(b"".join(gzip.open(p).read() for p in data_files(layouts["gz"])))
    one = CriteoShard(plain, SIZES, eval_fraction=0.0)
    many = CriteoShard(layouts["gz"], SIZES, eval_fraction=0.0)
    assert len(one) == len(many) == 3000 and one.stats.malformed_total == 0
    assert torch.equal(one.sparse, many.sparse) and torch.equal(one.dense, many.dense)
    assert [p.name for p in data_files(layouts["glob"])] == ["train_0.tsv.gz", "train_1.tsv.gz", "train_2.tsv.gz"]


@pytest.mark.parametrize("layout, world, sharding", [("one", 2, "by line"), ("gz", 2, "by file"),
                                                     ("gz", 3, "by file"), ("gz", 4, "by line")])
def test_shards_by_file_then_by_line_partition_the_rows(layouts, layout, world, sharding):
    path = layouts[layout]
    plan = scan(path, world, 0.1)
    assert plan.sharding == sharding and plan.lines == 3000
    shards = [CriteoShard(path, SIZES, rank=r, world_size=world, eval_fraction=0.1) for r in range(world)]
    held = CriteoShard(path, SIZES, eval_fraction=0.1, split="eval")
    assert [len(s) for s in shards] == plan.rows and len(held) == plan.eval_rows == 300  # every 10th line a file
    full = CriteoShard(path, SIZES, eval_fraction=0.0)
    rows = torch.cat([s.sparse for s in shards] + [held.sparse])
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, full.sparse.tolist()))
    if sharding == "by file":  # rank r reads files r, r + world, ...
        files = data_files(path)
        first = CriteoShard(files[1], SIZES, eval_fraction=0.1)
        assert torch.equal(shards[1].sparse[: len(first)], first.sparse)


def test_line_owner_deals_training_lines_round_robin():
    lines = np.arange(12)
    assert line_owner(0, 1, 2, 4, lines).tolist() == [0, 1, 0, -1, 1, 0, 1, -1, 0, 1, 0, -1]
    assert line_owner(3, 4, 2, 0, lines).tolist() == [1] * 12


def test_malformed_lines_are_counted_in_gzip_input(tmp_path):
    lines = [_line(str(i % 2)) for i in range(40)]
    lines[5], lines[17], lines[30] = "garbage\n", _line(label="7"), _line(ints=["1.5"] + ["1"] * 12)
    lines[22] = "\n"
    path = tmp_path / "bad.gz"
    with gzip.open(path, "wt") as f:
        f.write("".join(lines))
    plan = scan(path, 1, 0.0)
    assert plan.stats["valid"] == 36 and plan.lines == 40
    assert plan.stats["malformed"] == {"field_count": 1, "label": 1, "integer_feature": 1}
    assert plan.stats["examples"][0].startswith("line 6: field_count")
    stream = CriteoStream(plan.files, SIZES, workers=0, rows_per_epoch=plan.rows[0], chunk_bytes=1000)
    batches = stream.batches(10)
    for _ in range(4):
        next(batches)
    assert stream.malformed == {"field_count": 1, "label": 1, "integer_feature": 1}
    shard = CriteoShard(path, SIZES, eval_fraction=0.0)
    assert dict(shard.stats.malformed) == plan.stats["malformed"] and len(shard) == 36


def test_first_pass_counts_distinct_values_per_feature(layouts, tmp_path):
    plan = scan(layouts["gz"], 2, 0.1, distinct_cap=10**6)
    rows = [line.rstrip("\n").split("\t") for p in data_files(layouts["gz"]) for line in gzip.open(p, "rt")]
    exact = [len({int(r[14 + j], 16) for r in rows if r[14 + j]}) for j in range(NUM_SPARSE)]
    assert plan.distinct == exact and all(plan.distinct_exact)
    assert max(exact) <= 300 and min(exact) >= 2
    capped = scan(layouts["gz"], 2, 0.1, distinct_cap=50)
    assert [d if ok else None for d, ok in zip(capped.distinct, capped.distinct_exact)] == \
        [d if d <= 50 else None for d in exact]
    assert all(d > 50 for d, ok in zip(capped.distinct, capped.distinct_exact) if not ok)


def test_read_file_takes_every_row_in_order_and_refuses_a_malformed_line(tmp_path):
    path = tmp_path / "c.tsv"
    lines = [_line(str(i % 2)) for i in range(20)]
    lines[11] = "\n"  # blank lines are skipped
    path.write_text("".join(lines) + "garbage\n")
    shard = CriteoShard(path, SIZES, eval_fraction=0.0)  # skips the malformed line
    with pytest.raises(DataError, match=r"c\.tsv:21: expected 40 tab-separated columns \(label, I1..I13, C1..C26\), "
                                        r"got 1"):
        read_file(path, SIZES)
    dense, sparse, labels = read_file(path, SIZES, limit=19)  # the malformed line is past the limit
    assert torch.equal(sparse, shard.sparse) and torch.equal(dense, shard.dense) and torch.equal(labels, shard.labels)
    assert len(read_file(path, SIZES, limit=5, chunk_bytes=300)[2]) == 5
    path.write_bytes(_line().encode() + b"\xff\n")
    with pytest.raises(DataError, match=r"c\.tsv:2: not UTF-8 at byte 0"):
        read_file(path, SIZES)
