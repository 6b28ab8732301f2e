"""Fixtures of the scheduling tests."""

from __future__ import annotations

import pytest

from tests.scheduling._graphs import offline_client


@pytest.fixture()
def client():
    """An offline ``PSClient`` named ``graph_ps`` (nothing sent) for the passes' hand-built graphs; a test module
    may define its own ``client`` (pytest uses the closest)."""
    c = offline_client("graph_ps")
    yield c
    c.close(flush=False)


@pytest.fixture(params=["torch", "native"])
def dynamic_backend(request, monkeypatch):
    """Both backends of dynamic tables' index (``FXDIST_NATIVE``, read when a group is made): the torch
    ``SlotIndex`` (the reference) and the compiled kernels, skipped when they cannot be built here."""
    from scheduling.ps.dynamic_native import native_available

    monkeypatch.setenv("FXDIST_NATIVE", "1" if request.param == "native" else "0")
    if request.param == "native" and not native_available():
        pytest.skip("compiled dynamic-table kernels unavailable (no C++ compiler, or the build failed)")
    return request.param


@pytest.fixture(scope="session")
def trained_groups():
    """``trained_groups(in_trainers)``: the results of ``_group.run_group(in_trainers)`` (None: separate server
    processes; ``"inline"`` / ``"thread"``: servers in the trainers), each group spawned once a session and shared by
    test_ps_group.py and test_ps_in_trainers.py."""
    from tests.scheduling import _group

    cache: dict = {}

    def get(in_trainers):
        if in_trainers not in cache:
            cache[in_trainers] = _group.run_group(in_trainers)
        return cache[in_trainers]

    return get


@pytest.fixture()
def local_ray():
    """A local Ray (2 CPUs, no dashboard) for the test, started unless one runs already (and then shut down
    after it); the ``ray`` module. Skips without Ray."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()
