"""The job's data: the configured path, the shared sample, else synthetic data in the run folder."""

from __future__ import annotations

import pytest

from jobs.launcher.data import resolve_data_path
from recsys.criteo_format import DataError


def test_resolve_data_path(tmp_path, monkeypatch):
    import jobs.launcher.data

    monkeypatch.setattr(jobs.launcher.data, "default_criteo_path", lambda: tmp_path / "absent.txt")
    path, note = resolve_data_path("", tmp_path, 50)
    assert path == tmp_path / "synthetic_criteo.tsv" and path.is_file()
    assert "no Criteo data found" in note and "generated 50 rows" in note
    with pytest.raises(DataError, match=r"\[data\] path = '.*missing.tsv': no such file"):
        resolve_data_path(str(tmp_path / "missing.tsv"), tmp_path, 50)
