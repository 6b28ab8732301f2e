"""MovieLens-100K as per-user rating vectors, for DeepRecommender.

The data set (GroupLens, ``u.data``: ``user item rating timestamp``, tab-separated, 1-based ids) lives in
``../shared/data/movielens-100k`` beside the repository and is never copied into it.

Shapes: a :class:`RatingMatrix` holds ``train`` and ``test`` as dense float tensors ``(U, I)`` where ``U`` is the
number of users (943) and ``I`` the width of the item vector (1682 by default; a larger ``n_items`` pads with
never-rated items, e.g. 17768 to mimic the Netflix-prize width used in the DeepRecommender paper). A zero entry
means "not rated"; ratings are 1..5.

Source: Kuchaiev & Ginsburg, "Training Deep AutoEncoders for Collaborative Filtering" (2017), §3 (data layout);
torch.fx paper §6.2.1 (the quantization case study).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from recsys.movielens import load_ratings, ratings_file
from recsys.shared_data import default_movielens_path

__all__ = ["RatingMatrix", "load_movielens", "default_movielens_path"]


@dataclass(frozen=True)
class RatingMatrix:
    """Dense user-by-item rating vectors, split into train and held-out test ratings."""

    train: torch.Tensor
    """(U, I) float32, the ratings the model sees as input; 0 = not rated."""
    test: torch.Tensor
    """(U, I) float32, held-out ratings (disjoint from ``train``); 0 = not held out."""

    @property
    def n_users(self) -> int:
        return self.train.shape[0]

    @property
    def n_items(self) -> int:
        return self.train.shape[1]


def load_movielens(
    path: str | Path | None = None, *, n_items: int | None = None, test_fraction: float = 0.1, seed: int = 0
) -> RatingMatrix:
    """Read ``u.data`` and split each rating into train or test at random (seeded).

    Args:
        path: the ``movielens-100k`` folder (or ``u.data`` itself); defaults to the shared copy
            (:func:`recsys.shared_data.default_movielens_path`). Read by :func:`recsys.movielens.load_ratings`.
        n_items: width of the item vector; defaults to the largest item id. Must be >= the largest item id.
        test_fraction: fraction of ratings held out, in (0, 1).
        seed: seed of the split.

    Returns:
        A :class:`RatingMatrix` with ``train``/``test`` of shape ``(n_users, n_items)``.

    Raises:
        FileNotFoundError: ``u.data`` is not there.
        ValueError: ``n_items`` too small or ``test_fraction`` out of range; ``recsys.criteo_format.DataError``
            (a ValueError) for a malformed line, naming the file and line.
    """
    data_file = ratings_file(path)
    if not data_file.is_file():
        raise FileNotFoundError(f"MovieLens ratings not found at {data_file} (expected the ml-100k u.data file)")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    user_ids, item_ids, ratings = load_ratings(str(data_file))
    users, items = user_ids - 1, item_ids - 1
    width = int(items.max()) + 1
    if n_items is None:
        n_items = width
    elif n_items < width:
        raise ValueError(f"n_items={n_items} is smaller than the largest item id {width} in {data_file}")
    is_test = torch.rand(ratings.numel(), generator=torch.Generator().manual_seed(seed)) < test_fraction
    n_users = int(users.max()) + 1
    train = torch.zeros(n_users, n_items)
    test = torch.zeros(n_users, n_items)
    train[users[~is_test], items[~is_test]] = ratings[~is_test]
    test[users[is_test], items[is_test]] = ratings[is_test]
    return RatingMatrix(train=train, test=test)
