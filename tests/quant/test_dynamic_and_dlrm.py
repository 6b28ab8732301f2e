"""Dynamic quantization (Linear, LSTM), 8-bit row-wise embedding bags, and a torchrec-arch DLRM on Criteo."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.ao.nn.intrinsic.quantized as nniq
import torch.ao.nn.quantized as nnq
import torch.ao.nn.quantized.dynamic as nnqd
from torch import nn
from torch.ao.quantization import float_qparams_weight_only_qconfig, get_default_qconfig_mapping

import fxdist as fx
import quant


def _types(gm) -> list[type]:
    return [type(gm.get_submodule(n.target)) for n in gm.graph.nodes if n.op == "call_module"]


def test_dynamic_linear_matches_torch_ao(deeprec, movielens):
    q = quant.quantize_dynamic(fx.symbolic_trace(deeprec), {nn.Linear})
    assert _types(q).count(nnqd.Linear) == 6 and nn.Linear not in _types(q)
    ref = torch.ao.quantization.quantize_dynamic(
        copy.deepcopy(deeprec), {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}
    )
    x = movielens.train[:64]
    with torch.no_grad():
        torch.testing.assert_close(q(x), ref(x))
        rel = (q(x) - deeprec(x)).norm() / deeprec(x).norm()
    assert rel < 0.05  # FACTS.md: dynamic relative error about 0.03
    assert isinstance(deeprec.encoder[0], nn.Linear)  # the caller's model is untouched


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def test_dynamic_lstm():
    torch.manual_seed(0)
    model = Tagger().eval()
    q = quant.quantize_dynamic(model, {nn.LSTM, nn.Linear})
    assert nnqd.LSTM in _types(q) and nnqd.Linear in _types(q)
    x = torch.randn(4, 10, 8)
    with torch.no_grad():
        torch.testing.assert_close(q(x), model(x), atol=0.02, rtol=0.05)
    with pytest.raises(ValueError, match="no dynamic quantized module for .*Conv2d"):
        quant.quantize_dynamic(model, {nn.Conv2d})


def test_dynamic_exclusion_by_name(deeprec):
    q = quant.quantize_dynamic(deeprec, {nn.Linear}, exclude_names=["encoder.0"])
    assert type(q.get_submodule("encoder.0")) is nn.Linear and type(q.get_submodule("encoder.1")) is nnqd.Linear


@pytest.fixture(scope="module")
def criteo(criteo_path):
    pytest.importorskip("torchrec")
    from quant.models.dlrm import load_criteo, train_dlrm

    dense, sparse, labels = load_criteo(criteo_path, table_size=500)
    n = 6000
    model = train_dlrm(dense[:n], sparse[:n], labels[:n], epochs=1, batch_size=256, table_size=500)
    return model, (dense[:n], sparse[:n]), (dense[n:], sparse[n:], labels[n:])


def _logloss(model, dense, sparse, labels) -> float:
    with torch.no_grad():
        return float(nn.functional.binary_cross_entropy_with_logits(model(dense, sparse), labels))


def test_dlrm_embedding_bags_row_wise_int8(criteo):
    model, _, (dense, sparse, labels) = criteo
    q = quant.quantize_dynamic(model, {nn.EmbeddingBag})
    assert _types(q).count(nnq.EmbeddingBag) == 26
    table = q.get_submodule("tables.0")
    assert table.weight().dtype == torch.quint8 and table.weight().qscheme() == torch.per_channel_affine_float_qparams
    assert abs(_logloss(q, dense, sparse, labels) - _logloss(model, dense, sparse, labels)) < 0.005


def test_dlrm_static_dense_and_over_arch_with_quantized_embedding_bags(criteo):
    model, (train_dense, train_sparse), (dense, sparse, labels) = criteo
    mapping = get_default_qconfig_mapping("x86").set_object_type(nn.EmbeddingBag, float_qparams_weight_only_qconfig)
    prepared = quant.prepare(model, mapping, (train_dense[:8], train_sparse[:8]))
    batches = list(zip(train_dense.split(512), train_sparse.split(512)))
    quant.calibrate(prepared, batches, progress=False)
    q = quant.convert(prepared)
    types = _types(q)
    assert types.count(nnq.EmbeddingBag) == 26
    assert types.count(nniq.LinearReLU) >= 4 and nn.Linear not in types  # torchrec Perceptrons: Linear + ReLU
    assert abs(_logloss(q, dense, sparse, labels) - _logloss(model, dense, sparse, labels)) < 0.01
    report = quant.sqnr_report(prepared, q, (dense[:512], sparse[:512]))
    names = {e.name for e in report}
    assert "tables_0" in names and "dense_arch_model__mlp_0__linear" in names
    assert all(e.sqnr_db > 15 for e in report)


def test_criteo_loader_names_bad_lines(tmp_path):
    from quant.models.dlrm import load_criteo

    bad = tmp_path / "bad.txt"
    bad.write_text("1\t2\n")
    with pytest.raises(ValueError, match=r"bad\.txt:1: expected 40"):
        load_criteo(bad)
