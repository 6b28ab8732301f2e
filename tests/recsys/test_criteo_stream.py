"""recsys.criteo_stream: streamed batches equal the in-memory shard's and resume at any batch, worker
processes give the same batches, SharedBatches for the job's phases, closing a stream mid-read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from recsys.criteo_format import NUM_SPARSE
from recsys.criteo_shard import CriteoShard, scan
from recsys.criteo_stream import CriteoStream, SharedBatches
from recsys.criteo_synth import write_synthetic_criteo

SIZES = [50 + 7 * j for j in range(NUM_SPARSE)]


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


_CLOSE_SCRIPT = """
import sys
from recsys.criteo_stream import CriteoStream
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
