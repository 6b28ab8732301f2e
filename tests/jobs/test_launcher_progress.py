"""jobs.launcher.progress: one display of all phases' steps; plain lines without escape codes when not on a terminal."""

from __future__ import annotations

import io
import re

from jobs.launcher.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _snap(baseline: int, optimized: int, finished: tuple[str, ...] = ()) -> dict:
    return {"totals": {"baseline": 200, "optimized": 200}, "progress": {"baseline": baseline, "optimized": optimized},
            "results": {p: {} for p in finished}}


def test_plain_lines_when_not_a_terminal_with_a_rate_of_real_steps():
    out, clock = io.StringIO(), Clock()
    progress = Progress(out, interval_s=5.0, clock=clock)
    assert not progress.tty  # a StringIO is no terminal
    progress.update({})  # no totals yet: nothing
    progress.update(_snap(0, 0))
    for step in range(1, 11):  # 20 steps/s over both phases, polled every 0.5 s
        clock.now += 0.5
        progress.update(_snap(5 * step, 5 * step))
    clock.now += 5.0
    progress.update(_snap(200, 200, finished=("baseline", "optimized")))
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines == [
        "[fxdist] progress: baseline 0/200, optimized 0/200 steps (0 %), elapsed 0:00",
        "[fxdist] progress: baseline 50/200, optimized 50/200 steps (25 %), 20.0 steps/s, elapsed 0:05",
        "[fxdist] progress: baseline 200/200, optimized 200/200 steps (100 %), 40.0 steps/s, elapsed 0:10",
    ]
    assert "\x1b" not in out.getvalue() and "\r" not in out.getvalue()


def test_a_resumed_run_counts_only_the_steps_it_sees_done():
    out, clock = io.StringIO(), Clock()
    progress = Progress(out, interval_s=1.0, clock=clock)
    progress.update(_snap(150, 150))  # restored from a checkpoint: not done in this run's time
    clock.now += 2.0
    progress.update(_snap(160, 160))
    assert out.getvalue().splitlines()[-1].endswith("steps (80 %), 10.0 steps/s, elapsed 0:02")


def test_a_finished_phase_writes_a_line_at_once_and_close_writes_the_last_counts():
    out, clock = io.StringIO(), Clock()
    progress = Progress(out, interval_s=60.0, clock=clock)
    progress.update(_snap(0, 0))
    clock.now += 1.0
    progress.update(_snap(200, 190, finished=("baseline",)))
    clock.now += 1.0
    progress.update(_snap(200, 200))
    progress.close()
    lines = out.getvalue().splitlines()
    assert [re.sub(r",.*", "", line.split(": ", 1)[1]) for line in lines] == ["baseline 0/200"] + ["baseline 200/200"] * 2
    assert "optimized 200/200" in lines[-1]


def test_one_bar_on_a_terminal_with_a_sane_rate():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out, clock = Terminal(), Clock()
    progress = Progress(out, clock=clock)
    assert progress.tty
    progress.update(_snap(0, 0))
    clock.now += 10.0
    progress.update(_snap(100, 100))  # at once for tqdm: its own rate would read millions of steps/s
    progress.close()
    text = out.getvalue()
    frames = [f for f in re.split(r"[\r\n]", text) if f.strip()]
    assert all("training:" in f for f in frames)  # one bar, no per-phase bars
    assert "200/400" in frames[-1] and "baseline 100/200, optimized 100/200" in frames[-1]
    assert re.findall(r"([\d.]+) ?steps?/s", text) == ["20.0"]  # 200 steps in 10 s


def test_the_same_counts_are_not_printed_twice_when_the_last_phase_reports_late():
    """The job's two phases end together; their results reach the state actor one after the other, and the
    second report used to print the 100 % line again."""
    out, clock = io.StringIO(), Clock()
    progress = Progress(out, interval_s=60.0, clock=clock)
    progress.update(_snap(0, 0))
    clock.now += 10.0
    progress.update(_snap(200, 200, finished=("baseline",)))
    clock.now += 0.5
    progress.update(_snap(200, 200, finished=("baseline", "optimized")))
    progress.close()
    assert out.getvalue().splitlines() == [
        "[fxdist] progress: baseline 0/200, optimized 0/200 steps (0 %), elapsed 0:00",
        "[fxdist] progress: baseline 200/200, optimized 200/200 steps (100 %), 40.0 steps/s, elapsed 0:10",
    ]


def test_a_wait_for_data_is_one_line_not_one_per_poll():
    out, clock = io.StringIO(), Clock()
    progress = Progress(out, interval_s=5.0, clock=clock, wait_interval_s=60.0)
    waiting = {"waiting": {1: "d/ has no more line", 0: "d/ has no more line"}}
    progress.update(waiting)  # before the phases start (the first batch is read then)
    for _ in range(30):  # polled every 0.5 s while it waits
        clock.now += 0.5
        progress.update({**_snap(0, 0), **waiting})
    progress.update(_snap(1, 1))  # data came
    clock.now += 10.0
    progress.update({**_snap(1, 1), **waiting})  # a new wait soon after: not shown again
    clock.now += 60.0
    progress.update(_snap(2, 2))
    progress.update({**_snap(2, 2), **waiting})  # a minute later: shown
    lines = [line for line in out.getvalue().splitlines() if "waiting" in line]
    assert lines == ["[fxdist] waiting for data: rank 0: d/ has no more line; rank 1: d/ has no more line"] * 2
