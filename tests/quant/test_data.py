"""MovieLens-100K loader and the DeepRecommender model trained on it."""

from __future__ import annotations

import pytest
import torch

from quant.data import load_movielens
from quant.models import DeepRecommender, rmse


def test_split_is_disjoint_and_complete(movielens):
    train, test = movielens.train, movielens.test
    assert train.shape == test.shape == (943, 1682)
    assert not ((train != 0) & (test != 0)).any()
    assert int((train != 0).sum() + (test != 0).sum()) == 100_000
    assert 0.08 < float((test != 0).sum()) / 100_000 < 0.12
    assert set(torch.unique(train[train != 0]).tolist()) == {1.0, 2.0, 3.0, 4.0, 5.0}


def test_wider_item_vector_pads_with_unrated_items(movielens_path):
    wide = load_movielens(movielens_path, n_items=17768)
    assert wide.train.shape == (943, 17768)
    assert not wide.train[:, 1682:].any()
    with pytest.raises(ValueError, match="n_items=100 is smaller than the largest item id 1682"):
        load_movielens(movielens_path, n_items=100)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_movielens(tmp_path)


def test_malformed_line_is_named(tmp_path):
    (tmp_path / "u.data").write_text("1\t2\t3\t4\n1\t2\n")
    with pytest.raises(ValueError, match=r"u\.data:2: expected 4"):
        load_movielens(tmp_path)


def test_trained_model_beats_the_global_mean(movielens, deeprec):
    mean = float(movielens.train[movielens.train != 0].mean())

    class Mean(torch.nn.Module):
        def forward(self, x):
            return torch.full_like(x, mean)

    assert rmse(deeprec, movielens) < rmse(Mean(), movielens) - 0.03


def test_architecture_is_mirrored():
    model = DeepRecommender(100, (8, 8, 16))
    widths = [(m.in_features, m.out_features) for m in [*model.encoder, *model.decoder]]
    assert widths == [(100, 8), (8, 8), (8, 16), (16, 8), (8, 8), (8, 100)]
