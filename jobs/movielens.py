"""The second built-in example: matrix factorization of MovieLens-100K ratings, tables on parameter servers.

``fxdist launch jobs/movielens.toml`` trains :class:`MatrixFactorization` on ``u.data`` (100,000 ratings
1-5 of 943 users on 1682 movies; tab-separated ``user item rating timestamp``) through the job's
entry points (:mod:`jobs.entry`): ``[model] factory = "jobs.movielens:model"``, ``[data] batches =
"jobs.movielens:batches"``, ``[train] loss = "mse"``. With ``[cluster] parameter_servers > 0`` its four
tables (user and item vectors, user and item biases: ``nn.Embedding`` s) move to the servers through the
``scheduling.parameter_servers`` pass, like any model's; the job reports the held-out RMSE.

Data: ``[data] path``, else ``../shared/data/movielens-100k/u.data`` next to the repository, read by
:func:`recsys.movielens.load_ratings`. Every k-th
rating (k = round(1 / ``[data] eval_fraction``)) is held out; the others are dealt round-robin to the
trainers, in file order (the file is not sorted by user or time).

Shapes: ``model(user_ids (B,), item_ids (B,)) -> predicted ratings (B,)``; a batch is
``(user_ids, item_ids, ratings)`` (int64, int64, float32).

Source: Koren, Bell and Volinsky, "Matrix Factorization Techniques for Recommender Systems", IEEE Computer
2009 (biased MF: r = mu + b_u + b_i + p_u . q_i); Harper and Konstan, "The MovieLens Datasets", ACM TiiS 2015.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from recsys.criteo_format import DataError
from recsys.movielens import MEAN_RATING, NUM_ITEMS, NUM_USERS, load_ratings, ratings_file

__all__ = ["MatrixFactorization", "model", "batches"]



class MatrixFactorization(nn.Module):
    """Biased matrix factorization: ``mu + b_u + b_i + <p_u, q_i>``.

    Args:
        num_users, num_items: table rows (ids are 1-based in MovieLens; row 0 stays unused).
        dim: D, the width of the user and item vectors.
    """

    def __init__(self, num_users: int = NUM_USERS + 1, num_items: int = NUM_ITEMS + 1, dim: int = 16) -> None:
        super().__init__()
        self.user = nn.Embedding(num_users, dim)
        self.item = nn.Embedding(num_items, dim)
        self.user_bias = nn.Embedding(num_users, 1)
        self.item_bias = nn.Embedding(num_items, 1)
        for table in (self.user, self.item):
            nn.init.normal_(table.weight, std=0.1)
        for table in (self.user_bias, self.item_bias):
            nn.init.zeros_(table.weight)
        self.mean = nn.Parameter(torch.tensor(MEAN_RATING))

    def forward(self, user_ids: torch.Tensor, item_ids: torch.Tensor) -> torch.Tensor:
        p, q = self.user(user_ids), self.item(item_ids)
        bias = self.user_bias(user_ids).squeeze(1) + self.item_bias(item_ids).squeeze(1)
        return self.mean + bias + (p * q).sum(dim=1)


def model(config: Any) -> MatrixFactorization:
    """``[model] factory`` of the example: ``dim = [model] embedding_dim``; ``[model] options`` may set
    ``num_users`` / ``num_items`` (ids must be smaller; MovieLens-100K's :data:`recsys.movielens.NUM_USERS` and
    ``NUM_ITEMS`` by default)."""
    options = config.model.options
    return MatrixFactorization(int(options.get("num_users", NUM_USERS + 1)),
                               int(options.get("num_items", NUM_ITEMS + 1)), config.model.embedding_dim)


def batches(ctx: Any) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``[data] batches`` of the example: ``ctx.split``'s ratings in batches of ``ctx.batch_size``
    (:class:`jobs.entry.DataContext`); every k-th rating is held out (k = round(1 / ctx.eval_fraction)).

    Raises:
        DataError: ``[data] path`` cannot be read as MovieLens ratings (:func:`recsys.movielens.load_ratings`).
    """
    try:
        users, items, ratings = load_ratings(str(ratings_file(ctx.path)))
    except DataError as e:
        raise DataError(f"[data] path = {ctx.path!r}: {e}") from None
    index = torch.arange(ratings.numel())
    every = round(1 / ctx.eval_fraction) if ctx.eval_fraction > 0 else 0
    held_out = (index % every == every - 1) if every else torch.zeros_like(index, dtype=torch.bool)
    if ctx.split == "eval":
        rows = index[held_out]
    else:
        train = index[~held_out]
        rows = train[torch.arange(train.numel()) % ctx.world_size == ctx.rank]
    size = ctx.batch_size
    return [(users[rows[i:i + size]], items[rows[i:i + size]], ratings[rows[i:i + size]])
            for i in range(0, rows.numel(), size)]
