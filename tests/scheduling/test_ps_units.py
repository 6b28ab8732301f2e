"""In-process pieces of the parameter server: shard planning, request ordering, lookup/push maths."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from scheduling.ps import server as srv
from scheduling.ps.config import TableSpec, plan_shards, table_specs
from scheduling.ps.ordering import in_order


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


def test_requests_of_a_client_run_in_issue_order():
    done: list[int] = []
    threads = [threading.Thread(target=in_order, args=(("k", seq, 5.0), "push", "ps0"),
                                kwargs={"push": lambda s=seq: done.append(s)})
               for seq in (2, 1, 0)]                      # they arrive in reverse order
    for t in threads:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join(timeout=10)
    assert done == [0, 1, 2]


def test_a_missing_request_times_out_with_a_clear_error():
    with pytest.raises(RuntimeError, match=r"server psX: lookup #1 waited 0.2 s for the client's request #0"):
        in_order(("gap", 1, 0.2), "lookup", "psX", lookup=lambda: None)



def test_a_shorter_wait_parked_after_a_longer_one_times_out_on_its_own_deadline():
    # the watchdog sleeps until the earliest deadline; a new earlier one must wake it
    slow = threading.Thread(target=lambda: pytest.raises(RuntimeError, in_order, ("gap-long", 1, 3.0), "lookup",
                                                         "psX", lookup=lambda: None), daemon=True)
    slow.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"lookup #1 waited 0.2 s"):
        in_order(("gap-short", 1, 0.2), "lookup", "psX", lookup=lambda: None)
    assert time.monotonic() - t0 < 2.0, "the short wait was failed only when the longer deadline woke the watchdog"
    slow.join(timeout=10)

def test_row_wise_shards_sum_to_the_full_lookup_and_push_touches_only_their_rows():
    spec = TableSpec("t", 6, 3, ("f",))
    weight = torch.randn(6, 3)
    full, parts = srv.PSServer("full"), [srv.PSServer(f"p{i}") for i in range(2)]
    full.configure("ns", plan_shards([spec], 1), 0, "sgd", {"lr": 1.0}, 0, {"t": weight})
    for i, p in enumerate(parts):
        p.configure("ns", plan_shards([spec], 2, "row_wise"), i, "sgd", {"lr": 1.0}, 0, {"t": weight})
    batch = (("f",), torch.tensor([0, 5, 5, 2, 3]), torch.tensor([3, 0, 2]), torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0]))
    expected = full.lookup("ns", batch)
    torch.testing.assert_close(parts[0].lookup("ns", batch) + parts[1].lookup("ns", batch), expected)
    grad = torch.ones(3, 3)
    assert full.push("ns", batch, grad) == 4
    assert [p.push("ns", batch, grad) for p in parts] == [2, 2]      # rows {0, 2} and {3, 5}
    merged = torch.cat([parts[0].shards["ns/t@0"].weight, parts[1].shards["ns/t@3"].weight])
    torch.testing.assert_close(merged, full.shards["ns/t@0"].weight)
    torch.testing.assert_close(full.shards["ns/t@0"].weight[1], weight[1])   # untouched row
