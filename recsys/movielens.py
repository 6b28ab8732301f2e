"""MovieLens-100K's ratings file, read once for every layer (the job's matrix-factorization example and the
quantization study's rating matrices).

``u.data`` holds 100,000 ratings 1-5 of 943 users on 1682 movies, one per line: ``user item rating timestamp``,
tab-separated, ids 1-based, in no particular order.

Source: Harper and Konstan, "The MovieLens Datasets: History and Context", ACM TiiS 2015.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from recsys.criteo_format import DataError
from recsys.shared_data import default_movielens_path

__all__ = ["NUM_USERS", "NUM_ITEMS", "MEAN_RATING", "ratings_file", "load_ratings"]

NUM_USERS = 943
NUM_ITEMS = 1682
MEAN_RATING = 3.53
"""The mean rating of MovieLens-100K (3.5299)."""


def ratings_file(path: str | Path | None = None) -> Path:
    """The ``u.data`` file of ``path``: the file itself, or ``u.data`` in a ``movielens-100k`` folder; the shared
    copy (:func:`recsys.shared_data.default_movielens_path`) when ``path`` is None or empty. Not checked."""
    if not path:
        return default_movielens_path()
    path = Path(path).expanduser()
    return path / "u.data" if path.is_dir() else path


@functools.lru_cache(maxsize=2)
def load_ratings(path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(users, items, ratings)`` of a ``u.data`` file, as in the file (1-based ids): int64, int64 and float32,
    each ``(N,)``, in file order. Cached (the two most recent paths); do not modify the tensors.

    Raises:
        DataError: (a ``ValueError``) the file is missing or unreadable, has no rating, or a line is not 4
            tab-separated integers; the message names the file and the line number (``u.data:2: ...``).
    """
    users, items, ratings = [], [], []
    try:
        with open(path) as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    u, i, r, _ = (int(x) for x in line.split("\t"))
                except ValueError:
                    raise DataError(f"{path}:{lineno}: expected 4 tab-separated integers "
                                    f"(user, item, rating, timestamp), got {line[:60]!r}") from None
                users.append(u)
                items.append(i)
                ratings.append(float(r))
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or e}); MovieLens-100K's u.data is expected "
                        f"(the shared copy: {default_movielens_path()})") from None
    if not ratings:
        raise DataError(f"{path}: no rating")
    return torch.tensor(users), torch.tensor(items), torch.tensor(ratings)
