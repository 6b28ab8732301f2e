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


def test_locate_data_with_follow_takes_a_folder_or_glob_without_files_yet(tmp_path):
    from jobs.launcher.data import locate_data

    assert locate_data(str(tmp_path), follow=True) == tmp_path  # empty: the stream has not started
    assert locate_data(str(tmp_path / "part-*.tsv"), follow=True) == tmp_path / "part-*.tsv"
    with pytest.raises(DataError, match=r"\[data\] path = '.*missing': with \[data\] follow, path must be a folder"):
        locate_data(str(tmp_path / "missing"), follow=True)
    with pytest.raises(DataError, match="the directory holds no data file"):
        locate_data(str(tmp_path))  # without follow, an empty folder is an error
