"""Shared pytest fixtures.

Real inputs live in ``../shared/data`` beside the repository (never copied into it). Tests that read them
use the ``shared_data`` fixture, which skips with a clear reason where that folder is absent.
"""

from __future__ import annotations

import os
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
