"""Shared pytest fixtures, and the suite's two lanes.

Real inputs live in ``../shared/data`` beside the repository (never copied into it). Tests that read them
use the ``shared_data`` fixture, which skips with a clear reason where that folder is absent.

Lanes: ``make test`` (scripts/test.sh) runs the tests that start Ray or a job (``-m ray``) in one pytest process
and the others (``-m "not ray"``) in a second one beside it, so a job's idle moments do the other tests' work and
two Ray sessions never run at once. A test is in the Ray lane when it carries the ``ray`` marker or uses a Ray
fixture (:data:`RAY_FIXTURES`, which marks it here); a test outside it that calls ``ray.init`` fails and names
the marker (:func:`_ray_needs_its_marker`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# CI (CI=true) replays the same examples every run and never fails a property test for being slow on a
# loaded 2-core machine; locally, hypothesis explores new examples each run.
settings.register_profile("ci", derandomize=True, database=None, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
if os.environ.get("CI"):
    settings.load_profile("ci")

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
RAY_FIXTURES = frozenset({"ray_session", "local_ray", "one_server_run", "_ray_package"})
"""Fixtures that start Ray: a test using one (directly or through another fixture) is in the Ray lane."""


def _uses_ray(item: pytest.Item) -> bool:
    """Whether ``item`` starts Ray: the ``ray`` marker, a fixture of :data:`RAY_FIXTURES`, or a parameter
    ``"ray"`` (the scheduling tests that run each transport)."""
    if item.get_closest_marker("ray") is not None or RAY_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and "ray" in [v for v in callspec.params.values() if isinstance(v, str)]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ray: the test starts Ray or a job; runs in the Ray lane, one at a time")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the Ray tests (``ray``) before ``-m`` selects a lane (tryfirst: before pytest's own hook)."""
    for item in items:
        if _uses_ray(item) and item.get_closest_marker("ray") is None:
            item.add_marker(pytest.mark.ray)


@pytest.fixture(autouse=True)
def _ray_needs_its_marker(request: pytest.FixtureRequest):
    """A test outside the Ray lane must not start Ray (it would run beside the lane's session): ``ray.init``
    fails there when Ray is imported already, and a session that the test left running fails it; both name the
    marker to add. (A session an earlier test left running, as tests/jobs' shared one, is not this test's.)"""
    ray = sys.modules.get("ray")
    if request.node.get_closest_marker("ray") is not None or (ray is not None and ray.is_initialized()):
        yield
        return
    message = f"{request.node.nodeid} starts Ray: mark it with @pytest.mark.ray (tests/conftest.py)"

    def refuse(*args, **kwargs):
        raise RuntimeError(message)

    with pytest.MonkeyPatch.context() as patch:
        if ray is not None:
            patch.setattr(ray, "init", refuse)
        yield
    if (ray := sys.modules.get("ray")) is not None and ray.is_initialized():
        pytest.fail(message)



@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Path of ``../shared/data``; skips the test when it is absent (e.g. outside CI)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not available: {SHARED_DATA} does not exist (it sits beside the repo in CI)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def criteo_path(shared_data: Path) -> Path:
    """The Criteo Kaggle DAC sample: 10,000 TSV rows of label, I1..I13, C1..C26."""
    path = shared_data / "criteo" / "train_examples.txt"
    if not path.is_file():
        pytest.skip(f"Criteo sample missing at {path}")
    return path


@pytest.fixture(scope="session")
def movielens_path(shared_data: Path) -> Path:
    """The MovieLens-100K folder (u.data: user, item, rating, timestamp; tab-separated)."""
    path = shared_data / "movielens-100k"
    if not (path / "u.data").is_file():
        pytest.skip(f"MovieLens-100K missing at {path}")
    return path


@pytest.fixture(scope="session")
def layouts(tmp_path_factory):
    """Synthetic Criteo data in three layouts: one plain file, three gzip files (a folder) and a glob of them."""
    from recsys.criteo_synth import SynthSpec, write_synthetic

    root = tmp_path_factory.mktemp("layouts")
    spec = SynthSpec(seed=7, max_cardinality=300)
    (one,) = write_synthetic(root / "one", 3000, spec=spec)
    gz = write_synthetic(root / "gz", 3000, files=3, gzip_output=True, spec=spec)
    return {"one": one, "gz": gz[0].parent, "glob": str(root / "gz" / "train_*.tsv.gz")}
