"""The stages after training take whatever training took.

A model returning a tuple or a dict, an ``nn.TransformerEncoder`` (its eval-mode fast path made nested tensors
FakeTensor cannot describe), a model that does not trace: the int8 comparison compares outputs leaf by leaf, or
skips with the reason, and never fails the job. Layers are named by module path everywhere. A binary-label model
with its own loss gets an AUC from the score ``jobs.entry.binary_score`` finds. No test here starts Ray.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from jobs import entry
from jobs.config import JobConfig
from jobs.launcher.inference import compare, max_abs_diff
from jobs.launcher.report import table, write
from jobs.stats import auc, log_loss

HERE = "tests.jobs.test_later_stages"
PATHS = ["user_tower.0", "user_tower.2", "item_tower.0", "item_tower.2"]


class TupleTwoTower(nn.Module):
    """Two towers over EmbeddingBag tables, returning a tuple as torchrec's ``DLRMTrain`` does.
    Shapes: ``users (B, 2)``, ``items (B, 2)`` int64 -> ``(logits (B,), (user vectors (B, 8), item vectors
    (B, 8)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.users, self.items = nn.EmbeddingBag(40, 8), nn.EmbeddingBag(30, 8)
        self.user_tower = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8))
        self.item_tower = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8))

    def forward(self, users: torch.Tensor, items: torch.Tensor):
        u, i = self.user_tower(self.users(users)), self.item_tower(self.items(items))
        return (u * i).sum(1), (u, i)


class Encoder(nn.Module):
    """Token ids -> an ``nn.TransformerEncoder`` with a padding mask (id 0) -> a Linear head, as a dict.
    Shapes: ``ids (B, 6)`` int64 -> ``{"logits": (B,), "hidden": (B, 6, 16)}``."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(50, 16, padding_idx=0)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2)
        self.head = nn.Linear(16, 1)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.enc(self.tokens(ids), src_key_padding_mask=ids == 0)
        return {"logits": self.head(hidden[:, 0]).squeeze(1), "hidden": hidden}


class EncoderOnly(Encoder):
    """The same without a head outside the encoder: its Linear layers are all inside ``nn.TransformerEncoder``."""

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.enc(self.tokens(ids))[:, 0, 0]}


class Branchy(TupleTwoTower):
    """Control flow on an input: does not trace."""

    def forward(self, users: torch.Tensor, items: torch.Tensor):
        if users.sum() > 0:
            return super().forward(users, items)
        return super().forward(items, users)


def tuple_two_tower() -> nn.Module:
    return TupleTwoTower()


def encoder() -> nn.Module:
    return Encoder()


def encoder_only() -> nn.Module:
    return EncoderOnly()


def branchy() -> nn.Module:
    return Branchy()


def pairs(ctx) -> list[dict]:
    gen = torch.Generator().manual_seed(ctx.seed + (1 if ctx.split == "eval" else 0))
    return [{"users": torch.randint(0, 40, (32, 2), generator=gen),
             "items": torch.randint(0, 30, (32, 2), generator=gen),
             "labels": (torch.rand(32, generator=gen) < 0.5).float()} for _ in range(3)]


def sentences(ctx) -> list[dict]:
    gen = torch.Generator().manual_seed(ctx.seed + (1 if ctx.split == "eval" else 0))
    out = []
    for _ in range(2):
        ids = torch.randint(1, 50, (8, 6), generator=gen)
        ids[:, 4:] = 0  # padding: the mask makes the encoder's fast path build nested tensors
        out.append({"ids": ids, "labels": (torch.rand(8, generator=gen) < 0.5).float()})
    return out


def first_logits_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """Your loss on a structure: BCE of its first leaf (a tuple's logits, a dict's "logits")."""
    logits = output[0] if isinstance(output, tuple) else output["logits"]
    return nn.functional.binary_cross_entropy_with_logits(logits, labels)


def first_leaf(output, labels: torch.Tensor) -> torch.Tensor:
    """Your loss when the model computes its own: the output's first leaf, a scalar."""
    return output[0]


def _config(factory: str, batches: str, loss: str = "first_logits_loss") -> JobConfig:
    return JobConfig().replace(model={"factory": f"{HERE}:{factory}"}, data={"batches": f"{HERE}:{batches}"},
                               train={"loss": f"{HERE}:{loss}"}, quant={"calibration_batches": 2})


def _state(model: nn.Module) -> dict:
    return {"model": model.state_dict(), "tables": {}}


def _int8_faster(subject, variant, run):
    return 1e-3 if variant.startswith("int8") else 2e-3


def _expected_quality(model: nn.Module, config: JobConfig) -> dict[str, float]:
    """AUC / log loss of the logits of ``model`` on the eval split, computed here without jobs.entry."""
    held_out = pairs(entry.data_context(config, "eval"))
    with torch.no_grad():
        logits = torch.cat([model(b["users"], b["items"])[0] for b in held_out]).double()
    y = torch.cat([b["labels"] for b in held_out])
    return {"auc": auc(torch.sigmoid(logits), y), "log_loss": log_loss(torch.sigmoid(logits), y)}


def test_a_tuple_output_gets_the_int8_comparison_leaf_by_leaf(monkeypatch):
    import jobs.launcher.inference as inference

    config = _config("tuple_two_tower", "pairs")
    monkeypatch.setattr(inference, "_best_qps", lambda models, inputs, rows, **kw: {"fp32": 1000.0, "int8": 2000.0})
    torch.manual_seed(0)
    model = TupleTwoTower().eval()
    r = compare(config, _state(model), timer=_int8_faster)
    assert "skipped" not in r, r.get("skipped")
    assert [x["name"] for x in r["layers"]] == PATHS and [x["target"] for x in r["layers"]] == PATHS
    assert [x["node"] for x in r["layers"]] == ["user_tower_0", "user_tower_2", "item_tower_0", "item_tower_2"]
    assert not r["kept_fp32"] and r["quantized_modules"] == 4 and r["speedup"] == 2.0 and r["rows"] == 96
    expected = _expected_quality(model, config)
    assert r["fp32"]["auc"] == pytest.approx(expected["auc"], abs=1e-12)
    assert r["fp32"]["log_loss"] == pytest.approx(expected["log_loss"], abs=1e-9)
    assert r["fp32"]["score"] == "output leaf 0 of tuple (pytree order)" and r["int8"]["rows"] == 96
    assert r["output_max_abs_diff"] < 0.5 and abs(r["int8"]["auc"] - r["fp32"]["auc"]) < 0.1
    text = table({"job": "t", "config": {}, "phases": {}, "inference": r})
    assert f"int8 outputs differ from fp32 by at most {r['output_max_abs_diff']:.3g} (every output leaf)" in text


def test_torchrecs_dlrm_train_tuple_goes_through_quantize_and_the_comparison():
    """torchrec's ``DLRMTrain`` returns ``(loss, (loss.detach(), logits.detach(), labels))``: the job crashed on
    ``.detach()`` of that tuple after both phases had trained."""
    from torchrec.datasets.utils import Batch
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from jobs.launcher.inference import _run, quantize

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=20,
                                                     feature_names=[f"f{i}"]) for i in range(2)])
    model = DLRMTrain(DLRM(ebc, dense_in_features=4, dense_arch_layer_sizes=[16, 8],
                           over_arch_layer_sizes=[16, 1])).eval()
    batches = [(Batch(torch.randn(8, 4), KeyedJaggedTensor.from_lengths_sync(
        ["f0", "f1"], torch.randint(0, 20, (16,)), torch.ones(16, dtype=torch.int32)),
        (torch.rand(8) < 0.5).float()),) for _ in range(3)]
    with torch.no_grad():
        int8, info = quantize(model, batches[:2], timer=_int8_faster)
        fp32_out, int8_out = _run(model, batches), _run(int8, batches)
    assert [x["name"] for x in info["layers"]] == ["model.dense_arch.model._mlp.0._linear",
                                                   "model.dense_arch.model._mlp.1._linear",
                                                   "model.over_arch.model.0._mlp.0._linear", "model.over_arch.model.1"]
    assert info["quantized_modules"] == 4 and info["note"] == "int8 for 4 of 4 layers: 2.00x the fp32 module"
    loss, (loss_copy, logits, labels) = fp32_out[0]
    assert loss.shape == () and logits.shape == (8,) and torch.equal(labels, batches[0][0].labels)
    assert max_abs_diff(int8_out, fp32_out) < 0.05  # loss and logits leaves, int8 vs fp32
    scores, where = entry.binary_score(fp32_out, [b[0].labels for b in batches])
    assert where == "output leaf 2 of tuple (pytree order)"
    assert torch.equal(scores, torch.cat([out[1][1] for out in fp32_out]).double())


def test_max_abs_diff_flattens_any_structure_and_refuses_a_different_one():
    a = [{"p": torch.tensor([1.0, 2.0]), "pair": (torch.tensor([3.0]), None, torch.tensor([1, 2]))}]
    b = [{"p": torch.tensor([1.5, 2.0]), "pair": (torch.tensor([0.0]), None, torch.tensor([9, 9]))}]
    assert max_abs_diff(a, b) == 3.0  # the int leaf is not compared
    assert max_abs_diff([(None, 1)], [(None, 1)]) is None
    with pytest.raises(ValueError, match="held-out batch 0: the outputs differ in structure"):
        max_abs_diff([(torch.ones(1),)], [[torch.ones(1)]])
    with pytest.raises(ValueError, match=r"held-out batch 0, output leaf 0: shapes \(1,\) vs \(2,\)"):
        max_abs_diff([torch.ones(1)], [torch.ones(2)])


def test_layers_are_module_paths_in_the_note_and_the_selection():
    """The bug this guards against: the "kept fp32" note named node names (``over_arch_model_0__mlp_0__linear``) while the
    layer list above it gave module paths."""

    def faster_alone(subject, variant, run):  # each layer faster in int8, the module with them not
        if subject == "<module>":
            return 2e-3 if variant.startswith("int8") else 1e-3
        return {"fp32": 2e-3, "int8": 1e-3, "q/dq": 0.5e-3}[variant]

    config = _config("tuple_two_tower", "pairs")
    torch.manual_seed(0)
    r = compare(config, _state(TupleTwoTower().eval()), timer=faster_alone)
    assert r["kept_fp32"] and r["speedup"] == 1.0
    assert r["note"].startswith("kept fp32: the layers faster in int8 alone (user_tower.0, user_tower.2, "
                                "item_tower.0, item_tower.2) do not make the whole module faster")
    rows = r["selection"].splitlines()
    assert [row.split()[0] for row in rows[2:6]] == PATHS
    assert "user_tower_0" not in r["selection"] and "user_tower_0" not in r["note"]
    text = table({"job": "t", "config": {}, "phases": {}, "inference": r})
    assert "user_tower.0 2000.0 / 1000.0 -> fp32" in text and "user_tower_0" not in text


def test_a_transformer_encoder_returning_a_dict_gets_its_head_in_int8(monkeypatch):
    import jobs.launcher.inference as inference

    config = _config("encoder", "sentences")
    monkeypatch.setattr(inference, "_best_qps", lambda models, inputs, rows, **kw: {"fp32": 1000.0, "int8": 1500.0})
    torch.manual_seed(0)
    model = Encoder().eval()
    fastpath = torch.backends.mha.get_fastpath_enabled()
    r = compare(config, _state(model), timer=_int8_faster)
    assert "skipped" not in r, r.get("skipped")
    layers = [(x["name"], x["op"], x["input_shape"], x["chosen"]) for x in r["layers"]]
    assert layers == [("head", "Linear", [8, 16], True)]
    assert r["speedup"] == 1.5 and r["rows"] == 16 and r["fp32"]["score"] == "output leaf 0 of dict (pytree order)"
    assert torch.backends.mha.get_fastpath_enabled() == fastpath
    held_out = sentences(entry.data_context(config, "eval"))
    with torch.no_grad():
        logits = torch.cat([model(b["ids"])["logits"] for b in held_out])
    assert r["fp32"]["auc"] == pytest.approx(auc(torch.sigmoid(logits), torch.cat([b["labels"] for b in held_out])),
                                             abs=1e-12)


def test_a_model_whose_linear_layers_are_all_inside_the_encoder_is_skipped_with_the_reason():
    torch.manual_seed(0)
    r = compare(_config("encoder_only", "sentences"), _state(EncoderOnly().eval()), timer=_int8_faster)
    assert r.to_json() == {"skipped": "EncoderOnly's nn.Linear / nn.Conv layers are all inside modules traced whole "
                            "(TransformerEncoder), which stay fp32"}


def test_a_model_that_does_not_trace_is_skipped_with_the_exception(tmp_path):
    torch.manual_seed(0)
    r = compare(_config("branchy", "pairs"), _state(Branchy().eval()), timer=_int8_faster)
    assert r["skipped"].startswith("quantization cannot run on Branchy: TraceError: symbolically traced variables "
                                   "cannot be used as inputs to control flow")
    assert "\n" not in r["skipped"]
    results = {"job": "t", "config": {}, "phases": {}, "inference": r}
    assert f"int8 comparison: {r['skipped']}" in table(results).splitlines()
    write(results, tmp_path)
    assert json.loads((tmp_path / "results.json").read_text())["inference"] == r.to_json()


def test_any_error_of_the_stage_is_a_skip_reason_not_a_failure():
    threads = torch.get_num_threads()
    r = compare(_config("tuple_two_tower", "pairs"), {"tables": {}}, timer=_int8_faster)  # no dense weights
    assert r.to_json() == {"skipped": "failed: KeyError: 'model'"} and torch.get_num_threads() == threads


# ---- AUC of a binary-label model with its own loss ------------------------------------------------------------

def test_your_loss_on_binary_labels_gets_the_auc_of_the_first_leaf_with_one_value_per_label():
    config = _config("tuple_two_tower", "pairs")
    labels = [torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0.0, 1.0, 1.0, 0.0])]
    logits = [torch.tensor([2.0, -1.0, 0.5, 1.0]), torch.tensor([-2.0, 3.0, -0.5, -1.0])]
    # as DLRMTrain: (loss, (loss, logits, labels)); the scalar losses are skipped, the logits are leaf 2
    outputs = [(torch.tensor(0.3), (torch.tensor(0.3), x, y)) for x, y in zip(logits, labels)]
    q = entry.quality(config, [(x, None) for x in logits], labels)
    p, y = torch.sigmoid(torch.cat(logits)), torch.cat(labels)
    assert q["auc"] == auc(p, y) == pytest.approx(7 / 8) and q["log_loss"] == pytest.approx(log_loss(p, y))
    assert q["positives"] == 4 and q["rows"] == 8 and q["score"] == "output leaf 0 of tuple (pytree order)"
    scores, where = entry.binary_score(outputs, labels)
    assert where == "output leaf 2 of tuple (pytree order)" and torch.equal(scores, torch.cat(logits).double())
    probs = [torch.sigmoid(x) for x in logits]  # values in [0, 1]: taken as probabilities, no second sigmoid
    q = entry.quality(config, [{"logits": x} for x in probs], labels)
    assert q["log_loss"] == pytest.approx(log_loss(p, y)) and q["score"] == "output leaf 0 of dict (pytree order)"


def test_no_score_or_no_binary_labels_says_so():
    config = _config("tuple_two_tower", "pairs", loss="first_leaf")
    labels = [torch.tensor([1.0, 0.0, 1.0])]
    q = entry.quality(config, [(torch.tensor(0.1), torch.zeros(3, dtype=torch.long))], labels)
    assert q["eval_loss"] == pytest.approx(0.1)
    assert "auc" not in q and q["score_note"] == (
        "no AUC: no output leaf is a floating tensor with one value per label in every batch (the model returns a "
        "tuple; rule: jobs.entry.binary_score)")
    ratings = [torch.tensor([4.0, 1.0, 3.0])]
    q = entry.quality(_config("tuple_two_tower", "pairs"), [(torch.tensor([3.5, 1.5, 3.0]),)], ratings)
    assert "auc" not in q and "score_note" not in q and set(q) == {"eval_loss", "eval_loss_se", "rows"}


def test_the_table_shows_the_eval_loss_the_auc_and_where_the_score_came_from():
    config = _config("tuple_two_tower", "pairs")
    labels = [torch.tensor([1.0, 0.0, 1.0, 0.0])]
    q = entry.quality(config, [(torch.tensor([2.0, -1.0, 0.5, 1.0]), None)], labels)
    phase = {"qps": 10.0, "loss": 0.5, "quality": q, "quality_step": 4}
    text = table({"job": "t", "config": {"job": {"steps": 4}}, "phases": {"baseline": phase}})
    head = next(line for line in text.splitlines() if line.startswith("phase"))
    assert head.split()[-4:] == ["eval", "loss", "AUC", "logloss"]
    row = next(line for line in text.splitlines() if line.startswith("baseline"))
    assert row.split()[-3:] == [f"{q['eval_loss']:.4f}", "0.7500", f"{q['log_loss']:.4f}"]
    assert "  AUC, logloss: the score is output leaf 0 of tuple (pytree order)" in text.splitlines()
