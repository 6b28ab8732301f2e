"""The launcher's one progress display of a job's phases (``[job] progress``), fed by JobState snapshots.

The phases train block by block on the same trainers (:func:`jobs.trainer.phases.block_ends`), so one display counts the
steps of all of them: on a terminal, one tqdm bar over every phase's steps (each phase's count after it); otherwise
(a pipe, a file, CI) plain lines, one every ``interval_s`` seconds and one when a phase finishes, without
escape codes::

    [fxdist] progress: baseline 60/200, optimized 55/200 steps (29 %), 19.9 steps/s, elapsed 0:06

The rate is steps (of all phases, as the trainers report them; steps done before the display started, e.g.
by a resumed run, not counted) per second of wall time since the display started.

With ``[data] follow``, a trainer that has read all the data there is waits for more; the display then says so in
one line (not one per poll; again only after ``wait_interval_s`` seconds, when data trickles in)::

    [fxdist] waiting for data: rank 0: stream/ has no more complete line for this trainer (polling every 1.0 s)

Source: tqdm (the terminal bar).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO, cast

__all__ = ["Progress"]


def _clock_text(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """One progress display for the phases of a job.

    Args:
        stream: Where it writes (default ``sys.stderr``).
        tty: Draw a bar (True) or write plain lines (False); None: whether ``stream`` is a terminal.
        interval_s: Seconds between two plain lines (a phase finishing writes one at once).
        clock: Seconds, monotonic (tests inject one).
        wait_interval_s: Seconds before a new wait for data is shown again.
    """

    def __init__(self, stream: TextIO | None = None, *, tty: bool | None = None, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, wait_interval_s: float = 60.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty and isatty())
        self.tty, self.interval_s, self.clock = tty, interval_s, clock
        self._bar: Any = None
        self._start: tuple[float, int] | None = None  # (time, steps done) when steps were first seen
        self._last_line: float | None = None
        self._finished: set[str] = set()
        self._shown = ""  # the counts of the last plain line
        self._last: tuple[Mapping[str, int], dict[str, int], float] | None = None
        self.wait_interval_s = wait_interval_s
        self._waiting = False  # a wait for data was seen in the last snapshot
        self._wait_shown: float | None = None  # when the last wait line was written

    def update(self, snap: Mapping[str, Any]) -> None:
        """Show ``snap`` (:meth:`jobs.launcher.state.JobState.snapshot`: ``totals`` and ``progress`` per phase, phase
        name -> steps; ``results`` has the finished phases; ``waiting``: rank -> what it waits for)."""
        self._show_wait(snap.get("waiting") or {})
        totals: Mapping[str, int] = snap.get("totals", {})
        if not totals:
            return
        done = {p: min(int(snap.get("progress", {}).get(p, 0)), t) for p, t in totals.items()}
        now, steps = self.clock(), sum(done.values())
        if self._start is None:
            self._start = (now, steps)
        finished = set(snap.get("results", {})) & set(totals)
        self._last = (totals, done, now)
        if self.tty:
            self._draw(totals, done, steps, now)
        elif self._counts(totals, done) != self._shown and (finished - self._finished or self._last_line is None
                                                            or now - self._last_line >= self.interval_s):
            self._line(totals, done, now)
        self._finished |= finished

    def _show_wait(self, waiting: Mapping[int, str]) -> None:
        """One line when trainers start waiting for data (not again within ``wait_interval_s``)."""
        now = self.clock()
        if waiting and not self._waiting and (self._wait_shown is None
                                              or now - self._wait_shown >= self.wait_interval_s):
            text = "[fxdist] waiting for data: " + "; ".join(f"rank {r}: {w}" for r, w in sorted(waiting.items()))
            if self._bar is not None:
                self._bar.write(text, file=self.stream)
            else:
                print(text, file=self.stream, flush=True)
            self._wait_shown = now
        self._waiting = bool(waiting)

    def close(self) -> None:
        """Finish the display (the bar stays on screen; a last plain line if the counts changed since the last)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._last is not None and self._counts(*self._last[:2]) != self._shown:
            self._line(*self._last)

    def rate(self, steps: int, now: float) -> float | None:
        """Steps per second since the display started (None before any time has passed)."""
        if self._start is None or now <= self._start[0]:
            return None
        return (steps - self._start[1]) / (now - self._start[0])

    def _counts(self, totals: Mapping[str, int], done: Mapping[str, int]) -> str:
        return ", ".join(f"{p} {done[p]}/{t}" for p, t in totals.items())

    def _line(self, totals: Mapping[str, int], done: Mapping[str, int], now: float) -> None:
        steps, total = sum(done.values()), sum(totals.values())
        rate = self.rate(steps, now)
        counts = self._counts(totals, done)
        start = cast("tuple[float, int]", self._start)  # set by the update that came first
        text = (f"{counts} steps ({100 * steps / max(total, 1):.0f} %)"
                + (f", {rate:.1f} steps/s" if rate is not None else "")
                + f", elapsed {_clock_text(now - start[0])}")
        self._last_line, self._shown = now, counts
        print(f"[fxdist] progress: {text}", file=self.stream, flush=True)

    def _draw(self, totals: Mapping[str, int], done: Mapping[str, int], steps: int, now: float) -> None:
        from tqdm import tqdm

        total = sum(totals.values())
        if self._bar is None:
            # tqdm's own rate is a moving average of (steps added) / (seconds between two updates): one poll that
            # finds many steps done a moment after the last read "1310720.00step/s"; ours is steps / wall time
            self._bar = tqdm(total=total, initial=steps, desc="training", unit="step", file=self.stream,
                             dynamic_ncols=True, leave=True,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
        if self._bar.total != total:
            self._bar.total = total
        rate = self.rate(steps, now)
        self._bar.set_postfix_str((f"{rate:.1f} steps/s, " if rate is not None else "") + self._counts(totals, done),
                                  refresh=False)
        self._bar.update(steps - self._bar.n)
