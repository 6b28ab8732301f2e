"""The streaming Criteo reader: vectorised parsing (differential against parse_line), plain / gzip / many
files, shards by file then by line, start-at-batch determinism, malformed lines in gzip, the first pass."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.criteo_parse import hash_ids, parse_chunk
from jobs.criteo_stream import CriteoStream, SharedBatches, line_owner, scan
from jobs.data import NUM_DENSE, NUM_SPARSE, CriteoShard, DataError, MalformedLine, data_files, parse_line, write_synthetic_criteo
from jobs.synth import SynthSpec, write_synthetic

SIZES = [50 + 7 * j for j in range(NUM_SPARSE)]


def _line(label="1", ints=None, cats=None):
    ints = ints if ints is not None else [str(i) for i in range(NUM_DENSE)]
    cats = cats if cats is not None else [f"{j:08x}" for j in range(NUM_SPARSE)]
    return "\t".join([label, *ints, *cats]) + "\n"


def _reference(raw: bytes):
    """parse_line's verdict on one line: None (blank), a reason, or (dense, ids, label)."""
    if not raw.strip():
        return None
    try:
        return parse_line(raw.decode("utf-8"), SIZES)
    except UnicodeDecodeError:
        return "encoding"
    except MalformedLine as e:
        return e.reason


def _assert_same_as_parse_line(buf: bytes) -> None:
    parsed = parse_chunk(buf, examples=10**9)
    ids = hash_ids(parsed.values, parsed.present, SIZES)
    raws = buf.split(b"\n") if buf else []
    if buf.endswith(b"\n"):
        raws = raws[:-1]
    assert parsed.line_count == len(raws)
    expected_bad = {}
    rows = iter(range(len(parsed)))
    for i, raw in enumerate(raws):
        ref = _reference(raw)
        if isinstance(ref, str):
            expected_bad[i] = ref
        elif ref is not None:
            k = next(rows)
            assert parsed.lines[k] == i
            dense, sparse, label = ref
            np.testing.assert_allclose(parsed.dense[k], np.float32(dense), rtol=1e-6)
            assert ids[k].tolist() == sparse and parsed.labels[k] == label
    assert next(rows, None) is None
    assert parsed.malformed_lines == sorted(expected_bad)
    assert dict(parsed.malformed) == {r: list(expected_bad.values()).count(r) for r in set(expected_bad.values())}


_CHARS = st.sampled_from(list("0123456789abcdefABCDEF-+._ \r\x00x") + ["\u00e9", "\u0661", "\t"])
_FIELD = st.one_of(st.text(_CHARS.filter(lambda c: c != "\t"), max_size=22), st.just(""),
                   st.integers(-(2**63), 2**63 - 1).map(str), st.integers(0, 2**64 - 1).map(lambda v: f"{v:x}"),
                   st.integers(0, 2**70).map(str))
_LINE = st.one_of(
    st.lists(_FIELD, min_size=40, max_size=40).map(lambda f: "\t".join(f)),
    st.lists(_FIELD, min_size=38, max_size=41).map(lambda f: "\t".join(f)),
    st.builds(lambda label, ints, cats: _line(label, ints, cats).rstrip("\n"), st.sampled_from(["0", "1", "2"]),
              st.lists(st.one_of(st.just(""), st.integers(-5, 10**12).map(str)), min_size=13, max_size=13),
              st.lists(st.one_of(st.just(""), st.integers(0, 2**32 - 1).map(lambda v: f"{v:08x}")),
                       min_size=26, max_size=26)),
    st.text(max_size=30),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_LINE, min_size=1, max_size=12), st.booleans())
def test_vectorised_parse_matches_parse_line(lines, trailing_newline):
    text = "\n".join(line.replace("\n", " ") for line in lines) + ("\n" if trailing_newline else "")
    _assert_same_as_parse_line(text.encode("utf-8", "surrogatepass"))


def test_vectorised_parse_on_edge_lines():
    lines = [_line("0", ["", "-1", "0", "1", "9", "-", "+3", *["2"] * 6]), _line(), "\n", " \t \r\n",
             _line(ints=["9" * 19] + ["1"] * 12), _line(ints=["9" * 18] + ["1"] * 12),
             _line(cats=["0" * 16] + ["A"] * 25), _line(cats=["0" * 17] + ["A"] * 25), _line().replace("\n", "\r\r\n"),
             _line(label="1\x00"), "x" * 5 + "\n", _line(cats=["68fd1e64"] * 25 + ["\u00e9"])]
    _assert_same_as_parse_line("".join(lines).encode())
    _assert_same_as_parse_line(b"")
    _assert_same_as_parse_line(_line().encode() + b"\xff\xfe\n" + _line().encode())


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    spec = SynthSpec(seed=7, max_cardinality=300)
    (one,) = write_synthetic(root / "one", 3000, spec=spec)
    gz = write_synthetic(root / "gz", 3000, files=3, gzip_output=True, spec=spec)
    return {"one": one, "gz": gz[0].parent, "glob": str(root / "gz" / "train_*.tsv.gz")}


def test_plain_gzip_and_many_files_hold_the_same_rows(layouts, tmp_path):
    plain = tmp_path / "all.tsv"  # the three gzip files, decompressed into one plain file
    plain.write_bytes(b"".join(gzip.open(p).read() for p in data_files(layouts["gz"])))
    one = CriteoShard(plain, SIZES, eval_fraction=0.0)
    many = CriteoShard(layouts["gz"], SIZES, eval_fraction=0.0)
    assert len(one) == len(many) == 3000 and one.stats.malformed_total == 0
    assert torch.equal(one.sparse, many.sparse) and torch.equal(one.dense, many.dense)
    assert [p.name for p in data_files(layouts["glob"])] == ["train_0.tsv.gz", "train_1.tsv.gz", "train_2.tsv.gz"]


def test_files_in_natural_order(tmp_path):
    for name in ("day_10", "day_2", "day_1", ".hidden"):
        (tmp_path / name).write_text(_line())
    assert [p.name for p in data_files(tmp_path)] == ["day_1", "day_2", "day_10"]
    with pytest.raises(DataError, match="the pattern matches no file"):
        data_files(tmp_path / "nothing_*.gz")


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


@pytest.mark.parametrize("layout", ["one", "gz"])
def test_stream_batches_equal_the_in_memory_shard_and_resume_at_any_batch(layouts, layout):
    path = layouts[layout]
    plan = scan(path, 2, 0.1)
    shard = CriteoShard(path, SIZES, rank=1, world_size=2, eval_fraction=0.1)
    stream = CriteoStream(plan.files, SIZES, rank=1, world_size=2, every=plan.every, workers=0,
                          rows_per_epoch=plan.rows[1], chunk_bytes=20_000)
    want = shard.batches(100)
    got = stream.batches(100)
    epoch = -(-len(shard) // 100) + 3  # past the end of the epoch: batches wrap around
    uninterrupted = [next(got) for _ in range(epoch)]
    for a in uninterrupted:
        b = next(want)
        assert torch.equal(a.sparse, b.sparse) and torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
    for start in (1, 7, epoch - 2):
        resumed = next(stream.batches(100, start=start))
        assert torch.equal(resumed.sparse, uninterrupted[start].sparse)
    assert stream.stats()["lines_per_s"] > 0 and stream.stats()["rows"] >= epoch * 100


def test_worker_processes_give_the_same_batches(layouts):
    plan = scan(layouts["gz"], 1, 0.1)
    make = lambda workers: CriteoStream(plan.files, SIZES, every=plan.every, workers=workers,  # noqa: E731
                                        rows_per_epoch=plan.rows[0], chunk_bytes=30_000)
    inline, workers = make(0), make(2)
    try:
        a, b = inline.batches(64, start=3), workers.batches(64, start=3)
        for _ in range(-(-plan.rows[0] // 64) + 2):  # an epoch and a bit
            x, y = next(a), next(b)
            assert torch.equal(x.sparse, y.sparse) and torch.equal(x.dense, y.dense)
        assert workers.stats()["workers"] == 2 and workers.stats()["lines"] > 0
    finally:
        workers.close()


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


def test_shared_batches_keep_only_the_lead_of_the_fastest_reader():
    shared = SharedBatches(iter(range(1000)), readers=2)
    a, b = shared.reader(), shared.reader()
    for block in range(5):  # the phases alternate blocks of 10 steps
        assert [next(a) for _ in range(10)] == list(range(10 * block, 10 * block + 10))
        assert len(shared.buffer) <= 10
        assert [next(b) for _ in range(10)] == list(range(10 * block, 10 * block + 10))
        assert len(shared.buffer) == 0
    with pytest.raises(RuntimeError, match="only 2 readers"):
        shared.reader()


def test_hash_spreads_ids_over_each_table():
    values = np.arange(20000, dtype=np.uint64)[:, None].repeat(NUM_SPARSE, axis=1)
    ids = hash_ids(values, np.ones_like(values, dtype=bool), SIZES)
    for j, size in enumerate(SIZES):
        counts = np.bincount(ids[:, j], minlength=size)
        assert counts[0] == 0 and len(counts) == size
        assert counts[1:].min() > 0.5 * 20000 / (size - 1)  # near uniform


def test_report_shows_parse_throughput_next_to_qps():
    from jobs.report import table
    from jobs.worker import reader_summary

    reader = reader_summary([{"lines_per_s": 90_000.0, "capacity_lines_per_s": 180_000.0, "workers": 2,
                              "lines": 10, "rows": 9}, None])
    results = {"config": {}, "phases": {"baseline": {"qps": 5000.0, "reader": reader}},
               "data": {"parse": {"valid": 10, "malformed": {}},
                        "scan": {"lines": 10, "files": 2, "lines_per_s": 400_000.0, "sharding": "by file"}}}
    text = table(results)
    assert "first pass: 10 lines in 2 file(s), 400,000 lines/s (one process); shards by file" in text
    assert "reader: 90,000 lines/s per worker, 2 worker(s) per trainer, 180,000 lines/s in all vs training " \
           "5,000 samples/s" in text


def test_the_job_workload_streams_shared_batches_and_bounds_the_held_out_rows(layouts, tmp_path):
    from jobs import criteo
    from jobs.config import JobConfig
    from jobs.workload import make_workload

    config = JobConfig().replace(job={"batch_size": 50}, data={"reader_workers": 0, "eval_max_rows": 120},
                                 model={"table_sizes": SIZES})
    from jobs.metrics import Exporter

    exporter = Exporter("t", 0)  # its own registry
    work = make_workload(config, 0, 2, str(layouts["gz"]), exporter=exporter)
    shard = CriteoShard(layouts["gz"], SIZES, rank=0, world_size=2)
    try:
        assert work.rows == len(shard) and len(work.eval_shard) == 120 and work.parse["valid"] == 3000
        base, opt = work.train_batches(4), work.train_batches(4)  # the two phases of the job
        want = shard.batches(50, start=4)
        for _ in range(6):
            (dense_a, kjt_a, _), (dense_b, kjt_b, _), c = next(base), next(opt), next(want)
            assert dense_a is dense_b  # parsed once, shared by the phases
            assert torch.equal(kjt_a.values(), criteo.to_kjt(c.sparse).values()) and torch.equal(dense_a, c.dense)
            assert torch.equal(kjt_a.values(), kjt_b.values())
        assert work.reader_stats()["rows"] >= 300
        rate = exporter.registry.get_sample_value("fxdist_reader_lines_per_second", {"job": "t", "rank": "0"})
        assert rate == pytest.approx(work.reader_stats()["lines_per_s"]) and rate > 0
    finally:
        work.close()
    (tmp_path / "one.tsv").write_text(_line() + "bad line\n")
    with pytest.raises(DataError, match=r"CriteoShard: .* has no valid train line for rank 1 of 2 \(1 valid, 1 malf"):
        make_workload(config, 1, 2, str(tmp_path / "one.tsv"))


_CLOSE_SCRIPT = """
import sys
from jobs.criteo_stream import CriteoStream
if __name__ == "__main__":
    for i in range(6):
        stream = CriteoStream([sys.argv[1]], [1000] * 26, workers=2)
        batches = stream.batches(64)
        for _ in range(2 + i % 3):
            next(batches)
        stream.close()
    print("closed")
"""


def test_closing_a_stream_mid_read_ends_its_workers_quietly(tmp_path):
    """torch's DataLoader workers often abort in C++ static destruction when the stream closes ("terminate
    called without an active exception": 6 of 15 closes before :func:`exit_without_static_destructors`)."""
    import subprocess
    import sys

    path = write_synthetic_criteo(tmp_path / "c.tsv", 20000, seed=3)
    script = tmp_path / "close.py"
    script.write_text(_CLOSE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0 and "closed" in done.stdout, done.stderr[-2000:]
    assert "terminate called" not in done.stderr and "Aborted" not in done.stderr, done.stderr[-2000:]
