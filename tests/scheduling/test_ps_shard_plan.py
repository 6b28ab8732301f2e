"""Table declarations and shard planning (:mod:`scheduling.ps.shard_plan`), in process."""

from __future__ import annotations

import pytest

from scheduling.ps.shard_plan import TableSpec, plan_shards, table_specs


def _specs():
    return [TableSpec("a", 10, 4, ("fa",)), TableSpec("b", 7, 2, ("fb", "fc")), TableSpec("c", 3, 8, ("fd",))]


def test_row_wise_plan_covers_every_row_once():
    shards = plan_shards(_specs(), 3, "row_wise")
    for spec in _specs():
        mine = sorted((s.row_start, s.row_end) for s in shards if s.table == spec)
        covered = [r for lo, hi in mine for r in range(lo, hi)]
        assert covered == list(range(spec.num_embeddings))
    assert [(s.server, s.row_start, s.row_end) for s in shards if s.table.name == "c"] == [(0, 0, 1), (1, 1, 2),
                                                                                           (2, 2, 3)]


def test_table_wise_plan_balances_and_mixed_plans():
    shards = plan_shards(_specs(), 2, "table_wise")
    assert [(s.table.name, s.server) for s in shards] == [("a", 0), ("b", 1), ("c", 1)]
    mixed = plan_shards(_specs(), 2, {"a": "row_wise"})
    assert [(s.table.name, s.server) for s in mixed] == [("a", 0), ("a", 1), ("b", 0), ("c", 1)]


def test_bad_declarations_are_named():
    with pytest.raises(ValueError, match="feature 'fa' is looked up in two tables"):
        table_specs([TableSpec("a", 3, 2, ("fa",)), TableSpec("b", 3, 2, ("fa",))])
    with pytest.raises(ValueError, match="unknown sharding 'diagonal'"):
        plan_shards(_specs(), 2, "diagonal")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one server"):
        plan_shards(_specs(), 0)
