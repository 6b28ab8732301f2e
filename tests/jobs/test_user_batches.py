"""Unseen models through the job: a batch of any type, a loss preflight runs backward on, and whose
errors the job retries.

A torchrec ``Batch`` (a dataclass of dense features, a KeyedJaggedTensor and labels) reaches ``train_step`` as it
was yielded, and with a loss it is split by the rule of :mod:`jobs.entry` (its fields as keywords, or the whole
batch for a one-argument ``forward`` such as torchrec's ``DLRMTrain``); a loss without gradient exits 2 before Ray
starts, and in a trainer it is recorded once as your error; an error of the Criteo readers (``recsys``) is the
project's, which Ray Train retries. No test here starts Ray: the trainer loop runs in this process.
"""

from __future__ import annotations

import inspect
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM, DLRMTrain

import jobs.trainer.evaluation
import jobs.trainer.loop
import jobs.trainer.pipeline
from jobs import user_code
from jobs.config import ConfigError, load_config
from jobs.trainer.workload import LocalTables, UserWorkload

HERE = "tests.jobs.test_user_batches"
B = 8


def _tables() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="t_cat", embedding_dim=4, num_embeddings=20, feature_names=["cat"]),
        EmbeddingBagConfig(name="t_tag", embedding_dim=4, num_embeddings=10, feature_names=["tag"])])


def dlrm_train(config) -> nn.Module:
    """torchrec's ``DLRMTrain`` (``forward(batch) -> (loss, (loss, logits, labels))``, the last two detached) over
    two tiny tables: dense ``(B, 3)``, KJT keys "cat" and "tag"."""
    return DLRMTrain(DLRM(embedding_bag_collection=_tables(), dense_in_features=3, dense_arch_layer_sizes=[4],
                          over_arch_layer_sizes=[4, 1]))


class FieldModel(nn.Module):
    """Takes a ``Batch``'s fields as keywords: ``dense_features (B, 3)``, ``sparse_features`` -> logits ``(B,)``."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc, self.dense = _tables(), nn.Linear(3, 4)
        self.top = nn.Linear(12, 1)

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(sparse_features).values()
        return self.top(torch.cat([self.dense(dense_features), pooled], dim=1)).squeeze(1)


class TwoInputs(nn.Module):
    """Takes neither a ``Batch``'s fields (other names) nor one whole batch (two parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.top = nn.Linear(3, 1)

    def forward(self, dense: torch.Tensor, ids: KeyedJaggedTensor) -> torch.Tensor:
        return self.top(dense).squeeze(1)


def field_model(config) -> nn.Module:
    return FieldModel()


def two_inputs(config) -> nn.Module:
    return TwoInputs()


def torchrec_batches(ctx) -> list[Batch]:
    """torchrec ``Batch`` es: dense ``(B, 3)``, KJT "cat" (1 or 2 ids a row) and "tag" (1 id), labels ``(B,)``."""
    gen = torch.Generator().manual_seed(100 * ctx.seed + (50 if ctx.split == "eval" else ctx.rank))
    out = []
    for _ in range(3 if ctx.split == "eval" else 5):
        b = ctx.batch_size
        cat = torch.randint(1, 3, (b,), generator=gen)
        lengths = torch.cat([cat, torch.ones(b, dtype=torch.long)])
        values = torch.cat([torch.randint(0, 20, (int(cat.sum()),), generator=gen),
                            torch.randint(0, 10, (b,), generator=gen)])
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["cat", "tag"], values=values, lengths=lengths)
        out.append(Batch(dense_features=torch.randn(b, 3, generator=gen), sparse_features=kjt,
                         labels=torch.randint(0, 2, (b,), generator=gen).float()))
    return out


def unlabelled_batches(ctx) -> list[dict]:
    """Dicts without labels (only a ``train_step`` can take them): ``x (B, 3)``, target ``y (B,)``."""
    gen = torch.Generator().manual_seed(ctx.seed)
    return [{"x": torch.randn(ctx.batch_size, 3, generator=gen), "y": torch.randn(ctx.batch_size, generator=gen)}
            for _ in range(4)]


def linear(config) -> nn.Module:
    return nn.Linear(3, 1)


SEEN: list = []
"""The batches ``recording_step`` got, in order."""


def recording_step(model, batch) -> torch.Tensor:
    SEEN.append(batch)
    return model(batch)[0]                          # DLRMTrain's own loss


def dict_step(model, batch: dict) -> torch.Tensor:
    SEEN.append(batch)
    return nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["y"])


def dlrm_loss(output, labels: torch.Tensor) -> torch.Tensor:
    return output[0]                                # DLRMTrain's loss, with its gradient


def _config(factory: str, batches: str = "torchrec_batches", steps: int = 4, **train):
    return load_config().replace(
        job={"steps": steps, "batch_size": B}, model={"factory": f"{HERE}:{factory}"},
        data={"batches": f"{HERE}:{batches}"}, train=train, cluster={"parameter_servers": 0},
        phases={"passes": ["dce"]})


def _train(config, phase: str = "baseline"):
    workload = UserWorkload(config, 0, 1)
    model = workload.build(LocalTables())
    with warnings.catch_warnings():  # dce may find nothing to remove (NoOpPassWarning)
        warnings.simplefilter("ignore")
        run, _, _ = jobs.trainer.pipeline.run_phase(phase, model, LocalTables(), workload, config)
    return run, model, workload


def _same_batch(got: Batch, want: Batch) -> bool:
    return (type(got) is Batch and torch.equal(got.dense_features, want.dense_features)
            and torch.equal(got.labels, want.labels) and got.sparse_features.keys() == want.sparse_features.keys()
            and torch.equal(got.sparse_features.values(), want.sparse_features.values())
            and torch.equal(got.sparse_features.lengths(), want.sparse_features.lengths()))


def test_a_dataclass_batch_reaches_train_step_as_it_was_yielded():
    """torchrec's ``Batch`` with ``train_step``: preflight runs it (no split, no binding to forward), and each
    trainer step gets a ``Batch`` equal to the one yielded, in order (the epoch of 5 batches starts again)."""
    config = _config("dlrm_train", train_step=f"{HERE}:recording_step", steps=7)
    SEEN.clear()
    assert "DLRMTrain" in user_code.check(config)
    assert len(SEEN) == 1 and _same_batch(SEEN[0], torchrec_batches(UserWorkload(config, 0, 1)._train)[0])
    SEEN.clear()
    run, _, _ = _train(config)
    yielded = torchrec_batches(UserWorkload(config, 0, 1)._train)
    assert len(SEEN) == 7 and all(_same_batch(got, yielded[i % 5]) for i, got in enumerate(SEEN))
    assert run.steps == 7 and run.samples == 7 * B


def test_a_batch_without_labels_reaches_train_step_and_counts_its_rows():
    """A dict without ``labels`` is no batch for a loss, but ``train_step`` takes it; its rows are the first
    tensor's first dimension."""
    config = _config("linear", "unlabelled_batches", steps=3, train_step=f"{HERE}:dict_step", loss="mse")
    SEEN.clear()
    user_code.check(config)
    run, _, workload = _train(config)
    assert workload.rows == 4 * B and run.samples == 3 * B
    assert [sorted(b) for b in SEEN] == [["x", "y"]] * 4
    with pytest.raises(ConfigError, match=r"default.toml: \[data\] batches = '.*:unlabelled_batches': first batch: a "
                                          r"dict batch needs a 'labels' entry \(has \['x', 'y'\]\)"):
        user_code.check(config.replace(train={"train_step": ""}))


def test_a_dataclass_batch_with_a_loss_trains_whole_or_by_fields():
    """With a loss, a ``Batch`` goes whole to ``DLRMTrain.forward(batch)`` (one parameter) and trains exactly as
    the ``train_step`` calling it; to a forward taking its fields it goes as keywords, and is evaluated so."""
    whole = _config("dlrm_train", loss=f"{HERE}:dlrm_loss")
    assert "DLRMTrain" in user_code.check(whole)
    run, _, _ = _train(whole)
    stepped, _, _ = _train(_config("dlrm_train", train_step=f"{HERE}:recording_step", loss=f"{HERE}:dlrm_loss"))
    assert run.steps == 4 and run.samples == 4 * B and run.losses == stepped.losses
    fields = _config("field_model", loss="bce_with_logits", steps=5)
    assert "FieldModel" in user_code.check(fields)
    runs = {phase: _train(fields, phase) for phase in ("baseline", "optimized")}
    assert runs["baseline"][0].losses == pytest.approx(runs["optimized"][0].losses, rel=1e-6)
    run, model, workload = runs["baseline"]
    quality = jobs.trainer.evaluation.evaluate(model, workload, LocalTables())
    assert quality["rows"] == 3 * B


def test_a_dataclass_batch_that_fits_no_form_of_forward_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as info:
        user_code.check(_config("two_inputs", loss="bce_with_logits"))
    assert str(info.value) == (
        f"{load_config().source}: [data] batches = '{HERE}:torchrec_batches': first batch: a Batch (dataclass) batch "
        f"goes to forward{inspect.signature(TwoInputs().forward)} either as its fields other than 'labels' as "
        "keyword arguments (dense_features, sparse_features) or whole, as "
        "forward's one argument; this forward takes neither. Rename forward's parameters after the fields, give it "
        "one parameter for the batch, or set [train] train_step to call the model yourself")


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
    from jobs.user_code import user_error_frame
    from recsys.criteo_stream import SharedBatches

    def reader_bug(spec):
        shared = SharedBatches(iter([]), readers=1)
        shared.reader()
        shared.reader()                            # one reader too many: recsys raises RuntimeError

    monkeypatch.setattr(jobs.trainer.loop, "_train_loop", reader_bug)
    state = _State()
    with pytest.raises(RuntimeError, match="SharedBatches: only 1 readers were planned") as info:
        jobs.trainer.loop.train_loop({"spec": SimpleNamespace(state=state, config=None)})
    assert state.error is None
    assert user_error_frame(info.value) is None


def test_a_batch_moves_keeping_its_type_and_with_servers_its_kjt_stays():
    """``move_batch`` to the ``meta`` device (any device but the CPU shows the move): a ``Batch`` by its own
    ``.to``; with parameter servers (``own_to=False``) field by field, the KJT the same object on the CPU;
    named tuples, lists and dicts rebuilt around their moved items; a batch already there is the same object."""
    from collections import namedtuple

    from jobs.entry import move_batch

    batch = torchrec_batches(SimpleNamespace(seed=0, rank=0, split="train", batch_size=4))[0]
    moved = move_batch(batch, "meta")
    assert type(moved) is Batch and moved.dense_features.is_meta and moved.sparse_features.values().is_meta
    kept = move_batch(batch, "meta", own_to=False)
    assert type(kept) is Batch and kept.labels.is_meta and kept.sparse_features is batch.sparse_features
    assert move_batch(batch, "cpu", own_to=False) is batch
    Pair = namedtuple("Pair", "x y")
    nested = move_batch({"pair": Pair(torch.zeros(2), [torch.ones(1), "tag"])}, "meta")
    assert type(nested["pair"]) is Pair and nested["pair"].x.is_meta and nested["pair"].y[0].is_meta
    assert nested["pair"].y[1] == "tag"


def detached_loss(output, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(output[1][1], labels)   # DLRMTrain's detached logits


def detached_step(model, batch: Batch) -> torch.Tensor:
    return detached_loss(model(batch), batch.labels)


class DetachedModel(FieldModel):
    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        return super().forward(dense_features, sparse_features).detach()


def detached_model(config) -> nn.Module:
    return DetachedModel()


def _def_line(fn) -> str:
    return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]} in {fn.__name__}"


@pytest.mark.parametrize("sets, entry, fn", [
    ((f'model.factory="{HERE}:dlrm_train"', f'train.loss="{HERE}:detached_loss"'),
     f"[train] loss = '{HERE}:detached_loss'", detached_loss),
    ((f'model.factory="{HERE}:dlrm_train"', f'train.train_step="{HERE}:detached_step"'),
     f"[train] train_step = '{HERE}:detached_step'", detached_step),
    ((f'model.factory="{HERE}:detached_model"',), f"[model] factory = '{HERE}:detached_model'", DetachedModel.forward),
])
def test_a_loss_without_gradient_exits_2_before_ray_naming_its_entry_point(tmp_path, capsys, monkeypatch, sets, entry,
                                                                            fn):
    """Preflight runs ``loss.backward()``: a loss computed from detached outputs (your loss, your ``train_step``,
    or a built-in loss of a detached forward) exits 2 naming the entry point and the line of its ``def``.

    "Before Ray": the launcher never reaches ``_join_ray``, and Ray's state is as it was (the job modules' shared
    session may be running, tests/jobs/conftest.py)."""
    import ray

    import jobs.launcher.launch
    from jobs.launcher.cli import main

    def refuse(*args, **kwargs):
        raise AssertionError("the launcher reached Ray although preflight should have refused the loss")

    monkeypatch.setattr(jobs.launcher.launch, "_join_ray", refuse)
    ray_before = ray.is_initialized()

    args = ["launch", "--quiet", "--run-dir", str(tmp_path / "run"), "--set", "metrics.enabled=false",
            "--set", f'data.batches="{HERE}:torchrec_batches"']
    rc = main(args + [a for s in sets for a in ("--set", s)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert (f"{entry} (at {_def_line(fn)}): the first batch's loss has no gradient (requires_grad is False), so "
            "loss.backward() would fail in every trainer; compute it from the model's output without detach()") in err
    assert not (tmp_path / "run").exists() and ray.is_initialized() == ray_before


SHARED: list[nn.Module] = []


def shared_model(config) -> nn.Module:
    """The same module on every call (a factory that caches): preflight must leave it as it found it."""
    if not SHARED:
        SHARED.append(FieldModel())
    return SHARED[0]


def test_preflight_runs_backward_once_and_changes_no_weight_and_no_gradient():
    model = shared_model(None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    backwards = []
    model.top.weight.register_hook(lambda grad: backwards.append(grad.shape))
    user_code.check(_config("shared_model", loss="bce_with_logits"))
    assert backwards == [torch.Size([1, 12])]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [p.grad for p in model.parameters()] == [None] * len(list(model.parameters()))


def test_a_loss_without_gradient_in_a_trainer_is_your_error_recorded_once_and_not_retried(monkeypatch, one_trainer):
    """Past preflight (e.g. the eval-time model differs), the trainer's ``loss.backward()`` raises autograd's
    RuntimeError: ``train_loop`` records it once as your error at the loss's entry point, and the next attempt
    returns at once without training."""
    from jobs.user_code import user_error_frame

    config = _config("dlrm_train", loss=f"{HERE}:detached_loss")
    runs = []

    def trainer_loop(spec):                         # the trainer's loop on this process, no Ray
        runs.append(spec)
        _train(spec.config)

    monkeypatch.setattr(jobs.trainer.loop, "_train_loop", trainer_loop)
    state = _State()
    jobs.trainer.loop.train_loop({"spec": SimpleNamespace(state=state, config=config)})
    assert state.error == (
        "job", "RuntimeError", "element 0 of tensors does not require grad and does not have a grad_fn (raised by "
        f"your code at {_def_line(detached_loss)} ([train] loss = '{HERE}:detached_loss', whose loss has no "
        "gradient); not retried)", 0)
    jobs.trainer.loop.train_loop({"spec": SimpleNamespace(state=state, config=config)})
    assert len(runs) == 1
    with pytest.raises(RuntimeError) as info:
        _train(config)
    assert user_error_frame(info.value, config) == (f"{_def_line(detached_loss)} ([train] loss = "
                                                    f"'{HERE}:detached_loss', whose loss has no gradient)")
    assert user_error_frame(info.value) == "your [train] loss, train_step or model's forward (the loss has no gradient)"
