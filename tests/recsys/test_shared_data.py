"""recsys.shared_data: the one helper that finds ``../shared/data`` for the job, quant and the tests."""

from __future__ import annotations

from jobs.launcher import data as job_data
from quant.models import dlrm as quant_dlrm
from recsys.shared_data import SHARED_DATA, default_criteo_path, default_movielens_path, shared_data_path
from tests.conftest import SHARED_DATA as TESTS_SHARED_DATA


def test_the_shared_folder_is_beside_the_repository():
    assert SHARED_DATA == TESTS_SHARED_DATA
    assert shared_data_path("criteo", "x.txt") == TESTS_SHARED_DATA / "criteo" / "x.txt"
    assert default_criteo_path() == TESTS_SHARED_DATA / "criteo" / "train_examples.txt"
    assert default_movielens_path() == TESTS_SHARED_DATA / "movielens-100k" / "u.data"


def test_the_job_and_quant_use_the_one_helper():
    assert job_data.default_criteo_path is quant_dlrm.default_criteo_path is default_criteo_path


def test_the_default_files_are_there_in_ci(criteo_path, movielens_path):
    assert default_criteo_path() == criteo_path and default_movielens_path() == movielens_path / "u.data"
