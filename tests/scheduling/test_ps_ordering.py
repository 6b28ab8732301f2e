"""The order in which a parameter server serves a client's requests (:mod:`scheduling.ps.ordering`), in process."""

from __future__ import annotations

import threading
import time

import pytest

from scheduling.ps.ordering import in_order


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


def test_step_barrier_serves_indexed_lookups_in_count_index_rank_order():
    import random

    from scheduling.ps.ordering import StepBarrier

    barrier, log = StepBarrier(world_size=3), []

    def trainer(rank: int) -> None:
        rng = random.Random(rank)
        for count in range(3):
            for index in range(2):
                time.sleep(rng.random() * 0.01)
                barrier.lookup(rank, count, 5.0, "lookup", lambda c=count, i=index: log.append((c, i, rank)), "ps0",
                               index=index)
            barrier.push(rank, count, 5.0, "push", lambda: None, "ps0")

    threads = [threading.Thread(target=trainer, args=(r,)) for r in (2, 1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert log == sorted(log) and len(log) == 18


def test_a_higher_ranks_earlier_lookup_is_named_when_it_never_comes():
    from scheduling.ps.ordering import StepBarrier

    barrier = StepBarrier(world_size=2)
    barrier.lookup(0, 0, 5.0, "lookup", lambda: None, "ps0", index=0)
    with pytest.raises(RuntimeError, match=r"lookup \(count 0, index 1\) of rank 0 waited 0.2 s for rank 1's lookup "
                                           r"\(count 0, index 0\)"):
        barrier.lookup(0, 0, 0.2, "lookup", lambda: None, "ps0", index=1)


def test_waits_that_ended_leave_no_deadline_behind():
    """A parked request's deadline entry goes once its wait is over, not after its timeout_s: the heap holds about
    the requests waiting now (each stale entry was a watchdog wake-up and an object for the collector)."""
    from scheduling.ps import ordering

    answers: list[tuple] = []
    for count in range(50):  # two trainers' pushes: rank 0's waits at the barrier for rank 1's
        for rank in (0, 1):
            order = (f"stale-{rank}", count, 60.0, ("stale-group", rank, 2, count))
            ordering.submit(order, "push", "ps0", lambda v, e: answers.append((v, e)), push=lambda: 1)
    assert answers == [(1, None)] * 100
    with ordering._LOCK:
        live = [entry for entry in ordering._DEADLINES if entry[2].deadline == entry[0]]
        assert not live and len(ordering._DEADLINES) <= 1, len(ordering._DEADLINES)
