"""Several trainers sharing tables: the servers' step order (``scheduling.ps.ordering``) makes training the
same under every schedule and every timing.

A unit test drives :class:`StepBarrier` from threads; the end-to-end test spawns 2 parameter servers and 2
DDP trainers (gloo) and trains the same model eagerly (blocking lookups, pushes from backward hooks) and
with ``async_rpc_prefetch`` (each push carries the next step's lookup), with and without random delays
between the trainers: the losses and the final tables must be bit-identical.
"""

from __future__ import annotations

import threading
import time

import pytest

from scheduling.ps.ordering import StepBarrier
from tests.scheduling import _group


def test_step_barrier_applies_pushes_in_count_then_rank_order_and_lookups_after_them():
    barrier = StepBarrier(world_size=3)
    log: list[tuple[str, int, int]] = []

    def trainer(rank: int, delays: list[float]) -> None:
        for count in range(4):
            time.sleep(delays[count])
            barrier.lookup(rank, count, 5.0, "lookup", lambda count=count: log.append(("lookup", count, rank)), "ps0")
            time.sleep(delays[-count - 1])
            barrier.push(rank, count, 5.0, "push", lambda count=count: log.append(("push", count, rank)), "ps0")

    delays = {0: [0.01, 0.0, 0.02, 0.0], 1: [0.0, 0.015, 0.0, 0.01], 2: [0.005, 0.0, 0.0, 0.02]}
    threads = [threading.Thread(target=trainer, args=(r, d)) for r, d in delays.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    pushes = [(c, r) for kind, c, r in log if kind == "push"]
    assert pushes == sorted(pushes) and len(pushes) == 12
    for i, (kind, count, _rank) in enumerate(log):
        before = {(c, r) for k, c, r in log[:i] if k == "push"}
        if kind == "lookup":  # exactly the pushes of earlier counts, of every trainer
            assert {c for c, _ in before} == set(range(count)) and len(before) == 3 * count


def test_step_barrier_names_the_trainer_it_waits_for():
    barrier = StepBarrier(world_size=2)
    with pytest.raises(RuntimeError, match=r"push #0 of trainer\(s\) \[1\].*fewer steps"):
        barrier.push(0, 0, 0.2, "push", lambda: None, "ps0")
    with pytest.raises(RuntimeError, match=r"lookup of trainer 0 \(after 1 pushes\).*push #0 of trainer\(s\) \[0, 1\]"):
        barrier.lookup(0, 1, 0.2, "lookup", lambda: None, "ps0")


@pytest.mark.timeout(300)
def test_two_trainers_train_identically_under_every_schedule_and_timing(trained_groups):
    """The group with separate server processes (``_group.run_group(None)``, spawned once a session: its fixed-table
    runs here, its dynamic-table runs below, and test_ps_in_trainers.py's reference)."""
    world, num_servers, steps, runs = _group.WORLD, _group.NUM_SERVERS, _group.STEPS, _group.RUNS
    results = trained_groups(None)
    reference = {rank: results[rank]["eager"] for rank in range(world)}
    assert len(reference[0]["losses"]) == steps
    assert reference[0]["losses"] != reference[1]["losses"]  # the trainers saw different batches
    for name, schedule, _, _ in runs[1:]:
        for rank in range(world):
            assert results[rank][name]["losses"] == reference[rank]["losses"], (name, rank)
            if schedule == "prefetch":
                assert results[rank][name]["hits"] == num_servers * (steps - 1)
        tables = results[0][name]["tables"]
        assert tables.keys() == reference[0]["tables"].keys()
        for key, value in tables.items():
            assert value == reference[0]["tables"][key], (name, key)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("in_trainers", [None, "inline"])
def test_two_trainers_with_dynamic_tables_train_identically_under_every_schedule_and_timing(in_trainers,
                                                                                          trained_groups):
    """Dynamic tables small enough to evict (ordering rule 3): every schedule and timing gives the same losses,
    rows, id maps, last-seen steps and counters; with the servers in separate processes or in the trainers (the
    groups of ``_group.run_group``, which train the fixed-table runs too, each under its own client)."""
    world, num_servers, steps, runs = _group.WORLD, _group.NUM_SERVERS, _group.STEPS, _group.DYNAMIC_RUNS
    results = trained_groups(in_trainers)

    def tables(name: str) -> dict:  # the run's name taken out of the server-state keys
        return {k.replace(f"{name}/", ""): v for k, v in results[0][name]["tables"].items()}

    reference = tables("dyn_eager")
    stats = reference["dynamic_stats"]
    assert sorted(stats) == ["t0", "t1"] and all(s["evictions"] > 0 for s in stats.values()), stats
    assert stats["t1"]["rows"] == len(reference["t1@0.dynamic"]["map_ids"]) and len(reference) == 7
    for name, schedule, *_ in runs[1:]:
        for rank in range(world):
            assert len(results[rank][name]["losses"]) == steps
            assert results[rank][name]["losses"] == results[rank]["dyn_eager"]["losses"], (name, rank)
            if schedule == "prefetch":
                assert results[rank][name]["hits"] == num_servers * (steps - 1)
        assert tables(name) == reference, name
