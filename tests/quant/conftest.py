"""Small models trained on real data, shared by the quant tests (each trained once per session, in seconds)."""

from __future__ import annotations

import warnings

import pytest
import torch

from quant.data import load_movielens


@pytest.fixture(autouse=True)
def _quiet_torch_ao():
    """torch.ao.quantization warns that it is deprecated on every call; the modules and kernels still work."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*torch.ao.quantization.*")
        yield


@pytest.fixture(scope="session")
def movielens(movielens_path):
    return load_movielens(movielens_path)


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """One intra-op thread: the CI box has 2 cores shared with other jobs; oversubscription costs 3x here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def deeprec(movielens):
    """A narrow DeepRecommender (1682-64-64-128, mirrored) trained 4 epochs on MovieLens-100K."""
    from quant.models import train_deeprec

    return train_deeprec(movielens, hidden=(64, 64, 128), epochs=4, batch_size=128, lr=3e-3)


@pytest.fixture(scope="session")
def digits():
    pytest.importorskip("sklearn", reason="the digits CNN trains on scikit-learn's digits data set")
    from quant.models import load_digits_tensors, train_digits_cnn

    return train_digits_cnn(epochs=4), load_digits_tensors()
