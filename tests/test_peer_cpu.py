"""``benchmarks/_peer_cpu.py`` (``peer.py --cpu-account``): snapshots of /proc and their per-step differences."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _peer_cpu as cpu  # noqa: E402  (benchmarks/_peer_cpu.py)

pytestmark = pytest.mark.skipif(not Path(f"/proc/{os.getpid()}/task").is_dir() or
                                not Path(f"/proc/{os.getpid()}/schedstat").exists(),
                                reason="needs Linux /proc with schedstat")


def test_thread_groups_drop_digits_and_name_the_main_thread():
    assert cpu.thread_group("pt_autograd_0", main=False) == "pt_autograd_#"
    assert cpu.thread_group("TP_UV_loop", main=False) == "TP_UV_loop"
    assert cpu.thread_group("python3.11", main=True) == "main"


def test_a_busy_thread_shows_its_cpu_outside_the_main_group():
    me = {os.getpid(): "trainer"}
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        before = cpu.snapshot(me)
        stop.wait(0.3)
        after = cpu.snapshot(me)   # while the thread still runs (a thread gone by then is not counted)
    finally:
        stop.set()
        worker.join()
    acc = cpu.account(before, after, steps=2)
    others = sum(v["cpu_ms"] for (kind, group), v in acc["threads"].items() if group != "main")
    assert others > 10   # ms per step: it ran (it shares the GIL with the waiting main thread only)
    kind = acc["kinds"]["trainer"]
    assert kind["processes"] == 1
    assert kind["cpu_ms"] == pytest.approx(others + acc["threads"][("trainer", "main")]["cpu_ms"])
    assert kind["wait_ms"] >= 0 and kind["faults"] >= 0


def test_a_process_gone_is_left_out_and_steps_are_checked():
    gone = {2 ** 22 + 12345: "server"}    # above the default pid_max
    assert cpu.snapshot(gone) == {}
    assert cpu.account({}, {}, steps=1) == {"kinds": {}, "threads": {}}
    with pytest.raises(ValueError, match="steps must be >= 1"):
        cpu.account({}, {}, steps=0)


def test_per_step_figures_divide_the_difference_by_the_steps():
    before = {7: {"kind": "server", "process_ticks": 10, "faults": 100,
                  "threads": {7: ("main", 1_000_000, 0, 5), 8: ("TP_UV_loop", 0, 0, 0)}}}
    after = {7: {"kind": "server", "process_ticks": 30, "faults": 140,
                 "threads": {7: ("main", 5_000_000, 2_000_000, 9), 8: ("TP_UV_loop", 4_000_000, 0, 4),
                             9: ("pt_thread_pool", 2_000_000, 1_000_000, 2)}}}
    acc = cpu.account(before, after, steps=4)
    k = acc["kinds"]["server"]
    assert k["cpu_ms"] == pytest.approx((4 + 4 + 2) / 4) and k["wait_ms"] == pytest.approx(3 / 4)
    assert k["faults"] == pytest.approx(10) and k["switches"] == pytest.approx((4 + 4 + 2) / 4)
    assert k["process_cpu_ms"] == pytest.approx(20 * 1e3 / os.sysconf("SC_CLK_TCK") / 4)
    assert acc["threads"][("server", "pt_thread_pool")]["cpu_ms"] == pytest.approx(0.5)
    line = cpu.kinds_line(acc, step_ms=5.0)
    assert "server" in line and "0.50 cores" in line
    assert cpu.thread_table(acc)[0].split()[:2] == ["server", "main"]
