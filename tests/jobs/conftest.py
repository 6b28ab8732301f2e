"""Fixtures of the job tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray session (2 CPUs, no dashboard) shared by the Ray jobs of one test module."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
