"""``benchmarks/peer.py`` stopped by SIGTERM (``timeout``'s signal): the tables cover the runs finished."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import peer  # noqa: E402  (benchmarks/peer.py)


@pytest.fixture
def sigterm_to_peer():
    before = signal.signal(signal.SIGTERM, peer._on_sigterm)
    yield
    signal.signal(signal.SIGTERM, before)
    peer._STOPPING = False


def _args(rounds: int) -> argparse.Namespace:
    return argparse.Namespace(rounds=rounds, warmup=1, steps=2, profile=0, run_dir=Path("unused"), timeout=5.0,
                              cpu_account=False, server_nice=0, servers=2)


def test_sigterm_in_a_run_keeps_the_runs_finished_and_prints_their_table(monkeypatch, capsys, sigterm_to_peer):
    calls = []

    def run_once(setting, timeout_s, cpu_account=False, server_nice=0):
        calls.append(setting.system)
        if len(calls) == 4:   # round 2's second system: the signal arrives while it runs
            signal.raise_signal(signal.SIGTERM)
        qps = {"dmp_tw": 1000.0, "fx_prefetch_0ms": 1200.0}[setting.system]
        return {r: {"seconds": 2 * 128 * 2 / qps, "first_loss": 0.7, "last_loss": 0.69} for r in range(2)}, 1.0

    monkeypatch.setattr(peer, "run_once", run_once)
    found = peer.measure(10, 4, ["dmp_tw", "fx_prefetch_0ms"], _args(rounds=3))
    assert calls == ["dmp_tw", "fx_prefetch_0ms", "dmp_tw", "fx_prefetch_0ms"]   # no run after the signal
    assert [len(found[n]) for n in ("dmp_tw", "fx_prefetch_0ms")] == [2, 1]
    assert peer._STOPPING and not peer._MEASURING
    assert "stopped (SIGTERM)" in capsys.readouterr().err
    peer.report("10x4", found)
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("fx_prefetch_0ms"))
    assert "1.20" in row and "FAILED" not in row


def test_sigterm_outside_the_runs_only_notes_the_stop(sigterm_to_peer):
    signal.raise_signal(signal.SIGTERM)   # e.g. while a table prints: no exception there
    assert peer._STOPPING
    assert peer.measure(10, 4, ["dmp_tw"], _args(rounds=1)) == {}   # and no new size starts


def test_one_server_by_default_where_the_trainers_and_two_servers_lack_cores_of_their_own():
    assert peer.default_servers(2) == 1 and peer.default_servers(3) == 1
    assert peer.default_servers(4) == peer.default_servers(16) == 2


def test_peer_drops_the_profilers_and_tensorpipes_lines_from_stderr_and_nothing_else():
    noise = ["USDT:2026-11-27 08:08:15 27787:27787 SyncActivityProfilerHandler.cpp:52] profiler_start\n",
             "USDT:2026-11-27 08:08:15 27787:27787 SyncActivityProfilerHandler.cpp:59] profiler_stop\n",
             "[W1127 tensorpipe_agent.cpp:726] RPC agent for ps0 encountered error when reading incoming request from "
             "trainer1: EOF: end of file (this error originated at tensorpipe/transport/uv/connection_impl.cc:132)\n"]
    kept = ["RuntimeError: the server failed\n", "USDT: a line torch may print one day\n",
            "  round 1 dmp_tw   13,564 samples/s\n"]
    assert all(peer.NOISE.search(line) for line in noise)
    assert not any(peer.NOISE.search(line) for line in kept)


def test_every_pair_peer_py_compares_names_two_of_its_systems():
    names = set(peer.systems.SYSTEMS)
    assert all(system in names and other in names and system != other for _, system, other in peer.PAIRS)
    assert ("pushes as auto picks / by the main thread", "fx_prefetch_0ms", "fx_send0_prefetch_0ms") in peer.PAIRS
