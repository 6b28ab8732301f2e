"""Unseen models through the job (issue 30): a batch of any type, a loss preflight runs backward on, and whose
errors the job retries.

A torchrec ``Batch`` (a dataclass of dense features, a KeyedJaggedTensor and labels) reaches ``train_step`` as it
was yielded, and with a loss it is split by the rule of :mod:`jobs.entry` (its fields as keywords, or the whole
batch for a one-argument ``forward`` such as torchrec's ``DLRMTrain``); a loss without gradient exits 2 before Ray
starts, and in a trainer it is recorded once as your error; an error of the Criteo readers (``recsys``) is the
project's, which Ray Train retries. No test here starts Ray: the trainer loop runs in this process.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import jobs.worker


class _State:
    """The JobState actor as ``train_loop`` uses it (``ray.get`` is patched to return its argument)."""

    def __init__(self) -> None:
        self.error = None
        self.failure = SimpleNamespace(remote=lambda: self.error)
        self.fail = SimpleNamespace(remote=lambda *a: setattr(self, "error", a))


@pytest.fixture
def one_trainer(monkeypatch):
    monkeypatch.setattr("ray.get", lambda value: value)
    monkeypatch.setattr("ray.train.get_context",
                        lambda: SimpleNamespace(get_world_rank=lambda: 0, get_world_size=lambda: 1))


def test_an_error_of_the_criteo_reader_is_the_projects_and_is_retried(monkeypatch, one_trainer):
    """``recsys`` is this repository's code: an error raised there is re-raised for Ray Train to retry, and
    nothing is recorded as the user's."""
    from recsys.criteo_stream import SharedBatches
    from jobs.user_code import user_error_frame

    def reader_bug(spec):
        shared = SharedBatches(iter([]), readers=1)
        shared.reader()
        shared.reader()                            # one reader too many: recsys raises RuntimeError

    monkeypatch.setattr(jobs.worker, "_train_loop", reader_bug)
    state = _State()
    with pytest.raises(RuntimeError, match="SharedBatches: only 1 readers were planned") as info:
        jobs.worker.train_loop({"spec": SimpleNamespace(state=state, config=None)})
    assert state.error is None
    assert user_error_frame(info.value) is None
