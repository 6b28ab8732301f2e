"""The job's reader: the workload streams batches shared by the phases, and the report shows parse throughput."""

from __future__ import annotations

import pytest
import torch

from recsys.criteo_format import DataError
from recsys.criteo_shard import CriteoShard
from tests.recsys._lines import SIZES
from tests.recsys._lines import criteo_line as _line


def test_report_shows_parse_throughput_next_to_qps():
    from jobs.launcher.report import table
    from jobs.trainer.phases import reader_summary

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
    from jobs.trainer.workload import make_workload

    config = JobConfig().replace(job={"batch_size": 50}, data={"reader_workers": 0, "eval_max_rows": 120},
                                 model={"table_sizes": SIZES})
    from jobs.trainer.metrics import Exporter

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


def test_the_end_stages_read_only_the_complete_lines_of_a_stream(tmp_path):
    """With [data] follow, the int8 comparison's held-out and calibration batches (and so the export's sample input)
    leave out a half-written last line; read whole, the same folder's partial line would be a row."""
    from jobs.config import JobConfig
    from jobs.trainer.workload import inference_batches

    line = lambda n: _line(str(n % 2), ints=[str(n)] * 13)  # noqa: E731
    (tmp_path / "day_0").write_text("".join(line(n) for n in range(20)))
    (tmp_path / "day_1").write_text("".join(line(n) for n in range(20, 29)) + line(29)[:-4])  # its line 9: held out
    config = JobConfig().replace(data={"path": str(tmp_path), "follow": True, "eval_fraction": 0.1},
                                 model={"table_sizes": SIZES}, quant={"eval_batch_size": 4, "calibration_batches": 9})
    ids = lambda batches: [round(v) for b in batches for v in torch.expm1(b[0][:, 0].double()).tolist()]  # noqa: E731
    held_out, calibration = inference_batches(config, tmp_path)
    assert ids(held_out) == [9, 19]  # not the half-written 29
    train = [n for n in range(29) if n % 10 != 9]
    assert ids(calibration) == (train * 2)[:36] and [b[0].shape[0] for b in calibration] == [4] * 9  # wraps around
    whole, _ = inference_batches(config.replace(data={"follow": False}), tmp_path)
    assert ids(whole) == [9, 19, 29]  # what the end stages read before: line 29 with its last id cut short
