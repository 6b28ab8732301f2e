"""Where the real data sets lie: ``../shared/data/`` beside the repository (never copied into it).

One helper for every layer that reads them (the job's default data, the quantization studies, the benchmarks):
:func:`shared_data_path`, with the two data sets' default files named here. The folder may be absent (outside
CI); callers check and say so.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SHARED_DATA", "shared_data_path", "default_criteo_path", "default_movielens_path"]

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
"""``<repo>/../shared/data``."""


def shared_data_path(*parts: str) -> Path:
    """``<repo>/../shared/data/<parts...>``, e.g. ``shared_data_path("criteo", "train_examples.txt")``; it may not
    exist."""
    return SHARED_DATA.joinpath(*parts)


def default_criteo_path() -> Path:
    """The Criteo sample: ``<repo>/../shared/data/criteo/train_examples.txt`` (see its SOURCE.md)."""
    return shared_data_path("criteo", "train_examples.txt")


def default_movielens_path() -> Path:
    """MovieLens-100K's ratings: ``<repo>/../shared/data/movielens-100k/u.data``."""
    return shared_data_path("movielens-100k", "u.data")
