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
