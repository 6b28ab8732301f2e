"""Your model in the job: any output structure, a forward run once in preflight, your optimizers as keys.

The bugs this guards against: a model returning a tuple trained both phases, then crashed at evaluation; a shape error showed only
inside the trainers. Preflight now runs the first batch (exit 2 with your file and line), built-in losses state
their rule for non-tensor outputs, evaluation keeps any output structure, and ``[train] optimizer`` /
``table_optimizer`` / ``[cluster] server_threads`` / ``[model] plan`` are config keys. No test here starts Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from jobs import user_code
from jobs.config import ConfigError, parse_config
from jobs.launcher.cli import main

HERE = "tests.jobs.test_user_outputs"


class TwoHeads(nn.Module):
    """Returns ``(click logits (B,), rating (B,))``."""

    def __init__(self) -> None:
        super().__init__()
        self.items = nn.EmbeddingBag(30, 4, mode="sum")
        self.click, self.rating = nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, items: torch.Tensor):
        h = self.items(items)
        return self.click(h).squeeze(1), self.rating(h).squeeze(1)


class ShapeBug(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.items = nn.EmbeddingBag(30, 4, mode="sum")
        self.top = nn.Linear(5, 1)                  # wrong width: the bag gives 4 columns

    def forward(self, items: torch.Tensor) -> torch.Tensor:
        return self.top(self.items(items)).squeeze(1)   # SHAPE-BUG-LINE


@dataclass
class Scores:
    logits: torch.Tensor


def two_heads(config) -> nn.Module:
    return TwoHeads()


def shape_bug(config) -> nn.Module:
    return ShapeBug()


def batches(ctx) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(ctx.seed + ctx.rank)
    return [(torch.randint(0, 30, (ctx.batch_size, 3), generator=gen), torch.rand(ctx.batch_size, generator=gen).round())
            for _ in range(4)]


def two_head_loss(output, labels: torch.Tensor) -> torch.Tensor:
    click, rating = output
    return nn.functional.binary_cross_entropy_with_logits(click, labels) + ((rating - labels) ** 2).mean()


def sgd_factory(params, lr: float, momentum: float = 0.0) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def not_an_optimizer(params, lr: float) -> str:
    return "sgd"


def _config(**train):
    return parse_config({"model": {"factory": f"{HERE}:two_heads"}, "data": {"batches": f"{HERE}:batches"},
                         "train": train, "job": {"batch_size": 8}}, source="test.toml")


def test_a_tuple_output_with_a_builtin_loss_exits_2_with_the_rule(tmp_path, capsys):
    rc = main(["launch", "--quiet", "--run-dir", str(tmp_path / "run"), "--set", "metrics.enabled=false",
               "--set", f'model.factory="{HERE}:two_heads"', "--set", f'data.batches="{HERE}:batches"'])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "[train] loss = 'bce_with_logits' needs forward to return one value per label" in err
    assert "got tuple; name a loss entry point 'package.module:function'" in err
    assert not (tmp_path / "run").exists()


def test_a_tuple_output_with_your_loss_passes_preflight():
    note = user_code.check(_config(loss=f"{HERE}:two_head_loss"))
    assert "TwoHeads" in note


def test_a_shape_error_in_forward_exits_2_with_your_file_and_line(tmp_path, capsys):
    rc = main(["launch", "--quiet", "--run-dir", str(tmp_path / "run"), "--set", "metrics.enabled=false",
               "--set", f'model.factory="{HERE}:shape_bug"', "--set", f'data.batches="{HERE}:batches"'])
    err = capsys.readouterr().err
    assert rc == 2, err
    line = next(i for i, text in enumerate(open(__file__), 1) if "# SHAPE-BUG-LINE" in text)
    assert "the first batch fails: RuntimeError: mat1 and mat2 shapes cannot be multiplied" in err
    assert f"test_user_outputs.py:{line} in forward" in err


def test_evaluation_keeps_any_output_structure():
    from jobs.trainer.evaluation import evaluate

    class Workload:
        def eval_batches(self):
            return [0, 1]

        def inputs(self, batch, tables, device):
            return (torch.full((2, 3), batch),), {}, torch.ones(2)

        def quality(self, outputs, labels):
            return {"outputs": outputs}

    class DictModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return {"scores": Scores(x.sum(1) * self.w), "pair": (x[:, 0] * self.w, None)}

    outputs = evaluate(DictModel(), Workload(), None)["outputs"]
    assert len(outputs) == 2 and not outputs[1]["pair"][0].requires_grad
    assert torch.equal(outputs[1]["pair"][0], torch.ones(2))
    assert isinstance(outputs[0]["scores"], Scores)


def test_dense_optimizer_from_a_class_or_a_factory():
    from jobs.optimizers import dense_optimizer

    params = [nn.Parameter(torch.zeros(2))]
    adam = dense_optimizer(_config(optimizer="Adam", optimizer_kwargs={"weight_decay": 0.1}), params)
    assert isinstance(adam, torch.optim.Adam) and adam.defaults["lr"] == 0.01 and adam.defaults["weight_decay"] == 0.1
    sgd = dense_optimizer(_config(optimizer=f"{HERE}:sgd_factory", optimizer_kwargs={"momentum": 0.5}), params)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.5
    with pytest.raises(ConfigError, match=r"\[train\] optimizer = 'Adam' with \[train\] optimizer_kwargs = .*momentum"):
        dense_optimizer(_config(optimizer="Adam", optimizer_kwargs={"momentum": 0.5}), params)
    with pytest.raises(ConfigError, match=r"returned str, not a torch.optim.Optimizer"):
        dense_optimizer(_config(optimizer=f"{HERE}:not_an_optimizer"), params)


@pytest.mark.parametrize("raw, message", [
    ({"train": {"optimizer": "Adamm"}}, r"\[train\] optimizer = 'Adamm': not a torch.optim class"),
    ({"train": {"table_optimizer": "adam"}},
     r'\[train\] table_optimizer = \'adam\': must be "rowwise_adagrad", "adagrad" or "sgd"'),
    ({"train": {"table_grad_reduction": "avg"}}, r'\[train\] table_grad_reduction = \'avg\': must be "mean" or "sum"'),
    ({"model": {"plan": {"t_C1": "column_wise"}}}, r'\[model\] plan: t_C1 = \'column_wise\': must be "table_wise"'),
    ({"cluster": {"server_threads": 0}}, r"\[cluster\] server_threads = 0"),
])
def test_bad_optimizer_and_plan_keys_are_refused(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def test_the_table_keys_reach_the_parameter_servers_pass():
    from jobs.optimizers import table_optimizer_args

    config = parse_config({"train": {"table_optimizer": "sgd", "table_lr": 0.5, "table_grad_reduction": "sum"},
                           "model": {"plan": {"t_C1": "row_wise"}, "local_below_rows": 0}})
    assert table_optimizer_args(config) == {"optimizer": "sgd", "lr": 0.5, "grad_reduction": "sum",
                                            "plan": {"t_C1": "row_wise"}, "local_below_rows": 0}
    defaults = table_optimizer_args(parse_config({}))
    assert defaults == {"optimizer": "rowwise_adagrad", "lr": 0.01, "grad_reduction": "mean", "plan": None,
                        "local_below_rows": 32}


def recall_at_2(outputs, labels) -> dict[str, float]:
    """Share of positive rows whose click score is among the 2 highest of its batch (a retrieval-style metric
    over tuple outputs)."""
    hits = positives = 0
    for (click, _), y in zip(outputs, labels):
        top = set(torch.topk(click, k=min(2, click.numel())).indices.tolist())
        positives += int(y.sum())
        hits += sum(1 for i in top if y[i] > 0)
    return {"recall@2": hits / max(positives, 1)}


def broken_metric(outputs, labels):
    return 0.5


def test_your_metric_is_reported_beside_the_builtin_quality():
    from jobs import entry
    from jobs.launcher.report import _quality_notes

    config = _config(loss=f"{HERE}:two_head_loss", metric=f"{HERE}:recall_at_2")
    user_code.check(config)                                  # resolves and runs it on the first batch
    click = torch.tensor([0.9, 0.1, 0.8, 0.2])
    outputs, labels = [(click, click)], [torch.tensor([1.0, 1.0, 0.0, 0.0])]
    quality = entry.quality(config, outputs, labels)
    assert quality["metric"] == {"recall@2": 0.5} and "eval_loss" in quality
    notes = _quality_notes({"phases": {"baseline": {"quality_step": 4, "quality": quality}}}, 4, ("eval_loss",))
    assert "  [train] metric, baseline: recall@2 0.5000" in notes


def test_a_metric_that_returns_no_dict_exits_2_before_ray(tmp_path, capsys):
    rc = main(["launch", "--quiet", "--run-dir", str(tmp_path / "run"), "--set", "metrics.enabled=false",
               "--set", f'model.factory="{HERE}:two_heads"', "--set", f'data.batches="{HERE}:batches"',
               "--set", f'train.loss="{HERE}:two_head_loss"', "--set", f'train.metric="{HERE}:broken_metric"'])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "[train] metric = 'tests.jobs.test_user_outputs:broken_metric' returned float 0.5, expected a dict" in err


def test_a_metric_needs_your_model():
    with pytest.raises(ConfigError, match=r"\[train\] metric = 'x:y' is set but \[model\] factory is not"):
        parse_config({"train": {"metric": "x:y"}})


def _user_bug(batch):
    return batch["missing"]                         # USER-BUG-LINE


def test_an_error_of_your_code_in_a_trainer_is_recorded_once_and_not_retried(monkeypatch):
    """``train_loop`` records an exception raised in your file (type, message, file:line) on the job state, so
    the launcher reports it and Ray Train's later attempts return at once; a connection error is re-raised for
    Ray Train to retry."""
    import jobs.trainer.loop
    from jobs.user_code import user_error_frame

    class State:
        def __init__(self):
            self.error = None
            self.failure = type("M", (), {"remote": lambda _: self.error})()
            self.fail = type("M", (), {"remote": lambda _, *a: setattr(self, "error", a)})()

    monkeypatch.setattr("ray.get", lambda value: value)
    monkeypatch.setattr("ray.train.get_context",
                        lambda: type("C", (), {"get_world_rank": lambda _: 0, "get_world_size": lambda _: 1})())
    monkeypatch.setattr(jobs.trainer.loop, "_train_loop", lambda config: _user_bug({}))
    state = State()
    jobs.trainer.loop.train_loop({"spec": SimpleNamespace(state=state, config=None)})
    line = next(i for i, text in enumerate(open(__file__), 1) if "# USER-BUG-LINE" in text)
    kind, name, message, rank = state.error
    assert (kind, name, rank) == ("job", "KeyError", 0)
    assert message == f"'missing' (raised by your code at {__file__}:{line} in _user_bug; not retried)"
    assert user_error_frame(ConnectionResetError("reset")) is None

    def torch_error(config):
        torch.zeros(2) @ torch.zeros(3)             # raised inside torch, called from this file: still yours

    monkeypatch.setattr(jobs.trainer.loop, "_train_loop", torch_error)
    state = State()
    jobs.trainer.loop.train_loop({"spec": SimpleNamespace(state=state, config=None)})
    assert state.error[1] == "RuntimeError" and "in torch_error; not retried" in state.error[2]


def test_an_op_error_in_generated_code_counts_as_your_forward_and_a_library_error_does_not(capsys):
    import fxdist
    from jobs.user_code import user_error_frame

    gm = fxdist.symbolic_trace(ShapeBug())           # the leaf nn.Linear raises: the traced line is named
    with pytest.raises(RuntimeError) as info:
        gm(torch.zeros(2, 3, dtype=torch.long))
    import inspect

    line = inspect.getsourcelines(ShapeBug.forward)[1]  # the generated code names the traced forward's def line
    assert user_error_frame(info.value) == f"{__file__}:{line} in forward"

    class MatMul(nn.Module):
        def forward(self, x):
            return x @ torch.zeros(3)

    with pytest.raises(RuntimeError) as info:       # an op of the generated code raises: frames are dropped
        fxdist.symbolic_trace(MatMul())(torch.zeros(2))
    assert user_error_frame(info.value).startswith("your model's forward (traced by fxdist")
    capsys.readouterr()
    with pytest.raises(ValueError) as info:
        parse_config({"model": {"server_storage": "int4"}})       # raised by jobs.config: not yours
    assert user_error_frame(info.value) is None


def test_an_entry_point_package_not_on_the_path_says_how_to_put_it_there(tmp_path, monkeypatch):
    from jobs.entry import resolve

    with pytest.raises(ConfigError, match=r"No module named 'mypkg' \(Python finds 'mypkg' only on sys.path: run "
                                          r"fxdist from the folder that holds it with PYTHONPATH=\$PWD"):
        resolve("mypkg.models:make_model", "[model] factory")
    # the package is found but imports a missing module: that is its own error, with no hint about the path
    (tmp_path / "mypkg_hint").mkdir()
    (tmp_path / "mypkg_hint" / "models.py").write_text("import no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        resolve("mypkg_hint.models:make_model", "[model] factory")
    assert "No module named 'no_such_dependency'" in str(info.value) and "PYTHONPATH" not in str(info.value)
