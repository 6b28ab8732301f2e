"""Fixtures of the recsys tests."""

from __future__ import annotations

import pytest

from recsys.criteo_synth import SynthSpec, write_synthetic


@pytest.fixture(scope="session")
def layouts(tmp_path_factory):
    """Synthetic Criteo data in three layouts: one plain file, three gzip files (a folder) and a glob of them."""
    root = tmp_path_factory.mktemp("layouts")
    spec = SynthSpec(seed=7, max_cardinality=300)
    (one,) = write_synthetic(root / "one", 3000, spec=spec)
    gz = write_synthetic(root / "gz", 3000, files=3, gzip_output=True, spec=spec)
    return {"one": one, "gz": gz[0].parent, "glob": str(root / "gz" / "train_*.tsv.gz")}
