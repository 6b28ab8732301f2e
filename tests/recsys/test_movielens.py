"""recsys.movielens: the one reader of MovieLens-100K's u.data, shared by the job's example and quant's study."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from jobs import movielens as job_movielens
from quant.data import load_movielens
from recsys.criteo_format import DataError
from recsys.movielens import MEAN_RATING, NUM_ITEMS, NUM_USERS, load_ratings, ratings_file


def test_the_shared_file_has_100k_ratings_of_943_users_on_1682_items(movielens_path):
    users, items, ratings = load_ratings(str(ratings_file(movielens_path)))
    assert users.dtype == items.dtype == torch.int64 and ratings.dtype == torch.float32
    assert users.shape == items.shape == ratings.shape == (100_000,)
    assert (int(users.min()), int(users.max()), int(items.min()), int(items.max())) == (1, NUM_USERS, 1, NUM_ITEMS)
    assert set(ratings.unique().tolist()) == {1.0, 2.0, 3.0, 4.0, 5.0}
    assert round(float(ratings.mean()), 2) == MEAN_RATING
    first = ratings_file(movielens_path).read_text().split("\n", 1)[0].split("\t")
    assert (int(users[0]), int(items[0]), float(ratings[0])) == (int(first[0]), int(first[1]), float(first[2]))


def test_the_job_and_the_quantization_study_read_the_same_ratings(movielens_path):
    users, items, ratings = load_ratings(str(ratings_file(movielens_path)))
    ctx = SimpleNamespace(path=str(movielens_path / "u.data"), split="train", rank=0, world_size=1,
                          batch_size=100_000, eval_fraction=0.0)
    (job_users, job_items, job_ratings), = job_movielens.batches(ctx)
    assert torch.equal(job_users, users) and torch.equal(job_items, items) and torch.equal(job_ratings, ratings)
    matrix = load_movielens(movielens_path)
    dense = matrix.train + matrix.test
    assert torch.equal(dense[users - 1, items - 1], ratings)


def test_a_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "u.data"
    path.write_text("1\t2\t3\t4\n\n1\t2\tx\t4\n")
    with pytest.raises(DataError, match=r"u\.data:3: expected 4 tab-separated integers .*'1\\t2\\tx\\t4"):
        load_ratings(str(path))
    with pytest.raises(DataError, match=r"u\.data:3: expected 4"):   # quant's reader is the same one
        load_movielens(tmp_path)


def test_a_missing_or_empty_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match=r"absent: cannot be read \(No such file or directory\)"):
        load_ratings(str(tmp_path / "absent"))
    (tmp_path / "u.data").write_text("\n")
    with pytest.raises(DataError, match=r"u\.data: no rating"):
        load_ratings(str(tmp_path / "u.data"))
    ctx = SimpleNamespace(path=str(tmp_path / "absent"), split="train", rank=0, world_size=1, batch_size=8,
                          eval_fraction=0.1)
    with pytest.raises(DataError, match=r"^\[data\] path = '.*absent': .*absent: cannot be read"):
        job_movielens.batches(ctx)


def test_ratings_file_takes_a_folder_a_file_or_nothing(tmp_path):
    assert ratings_file(tmp_path) == tmp_path / "u.data"
    assert ratings_file(tmp_path / "ratings.tsv") == tmp_path / "ratings.tsv"
    assert ratings_file(None) == ratings_file("") and ratings_file(None).parts[-2:] == ("movielens-100k", "u.data")
