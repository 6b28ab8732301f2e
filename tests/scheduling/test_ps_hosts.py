"""scheduling.ps.hosts: where servers run; every kill goes through a host."""

from __future__ import annotations

import multiprocessing as mp
import time

from scheduling.ps.hosts import ProcessHost


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_process_host_kills_one_then_all():
    host = ProcessHost()
    host.start(mp.get_context("spawn"), _sleep, [(60.0,), (60.0,)], ["ps0", "ps1"])
    assert host.alive() == [True, True]
    host.kill(0)
    assert host.alive() == [False, True]
    host.kill_all()
    assert host.alive() == [False, False]
