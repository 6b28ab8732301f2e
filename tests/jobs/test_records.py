"""The record types of ``jobs.records`` name the keys their producers write (a TypedDict is a plain dict at run
time, so only such a check ties the two together)."""

from __future__ import annotations

import typing

from jobs import records
from jobs.hosting import Hosting
from jobs.stats import interleaved_gain, median_interval
from jobs.trainer.phases import reader_summary


def _keys(cls: type) -> set[str]:
    return set(typing.get_type_hints(cls))


def test_each_producer_writes_the_keys_of_its_record():
    assert set(median_interval([1.0, 2.0, 3.0])) == _keys(records.MedianInterval)
    assert set(interleaved_gain([{"baseline": [1.0, 1.0], "optimized": [0.5, 0.5]}])) == _keys(records.Gain)
    assert set(Hosting(True, "auto", "why", 4.0).to_json()) == _keys(records.HostingRecord)
    stats = {"lines_per_s": 1.0, "capacity_lines_per_s": 2.0, "workers": 2, "lines": 3, "rows": 3}
    assert set(reader_summary([stats]) or {}) == _keys(records.ReaderSummary)


def test_optional_keys_are_marked_and_where_has_its_in_key():
    assert records.Quality.__required_keys__ == frozenset()
    assert records.TableSizes.__required_keys__ == {"sizes"}
    assert "in" in records.Where.__optional_keys__
    assert records.CheckpointRecord.__required_keys__ == {"phase", "step", "model", "tables"}
