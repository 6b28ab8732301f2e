"""Dynamic quantization (Linear, LSTM), 8-bit row-wise embedding bags, and torchrec's DLRM on Criteo (tables by
torchrec's quantization, dense and over arches by fxdist's static PTQ)."""

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


class Bags(nn.Module):
    """Two ``nn.EmbeddingBag`` tables (2-D ids, sum) and a Linear head: fxdist's own weight-only path."""

    def __init__(self) -> None:
        super().__init__()
        self.user = nn.EmbeddingBag(50, 8, mode="sum")
        self.item = nn.EmbeddingBag(40, 8, mode="sum")
        self.head = nn.Linear(16, 1)

    def forward(self, users, items):
        return self.head(torch.cat([self.user(users), self.item(items)], dim=1))


def test_embedding_bags_row_wise_int8_dynamic_and_static():
    torch.manual_seed(0)
    model = Bags().eval()
    users, items = torch.randint(0, 50, (64, 3)), torch.randint(0, 40, (64, 2))
    dyn = quant.quantize_dynamic(model, {nn.EmbeddingBag})
    assert _types(dyn).count(nnq.EmbeddingBag) == 2
    table = dyn.get_submodule("user")
    assert table.weight().dtype == torch.quint8 and table.weight().qscheme() == torch.per_channel_affine_float_qparams
    mapping = get_default_qconfig_mapping("x86").set_object_type(nn.EmbeddingBag, float_qparams_weight_only_qconfig)
    prepared = quant.prepare(model, mapping, (users, items))
    quant.calibrate(prepared, [(users, items)], progress=False)
    static = quant.convert(prepared)
    assert _types(static).count(nnq.EmbeddingBag) == 2 and nnq.Linear in _types(static)
    with torch.no_grad():
        ref = model(users, items)
        for q in (dyn, static):
            assert (q(users, items) - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.fixture(scope="module")
def criteo(criteo_path):
    pytest.importorskip("torchrec")
    from quant.models.dlrm import load_criteo, train_dlrm

    dense, sparse, labels = load_criteo(criteo_path, table_size=500)
    n = 6000
    model = train_dlrm(dense[:n], sparse[:n], labels[:n], epochs=1, batch_size=256, table_size=500)
    return model, (dense[:n], sparse[:n]), (dense[n:], sparse[n:], labels[n:])


def _logloss(model, dense, sparse, labels) -> float:
    from quant.models.dlrm import criteo_kjt

    with torch.no_grad():
        logits = model(dense, criteo_kjt(sparse)).squeeze(1)
        return float(nn.functional.binary_cross_entropy_with_logits(logits, labels))


def test_torchrec_dlrm_tables_int8_by_torchrec(criteo):
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC

    from quant.models.dlrm import quantize_tables

    model, _, (dense, sparse, labels) = criteo
    q = quantize_tables(model)
    ebc = q.sparse_arch.embedding_bag_collection
    assert isinstance(ebc, QuantEBC) and not isinstance(model.sparse_arch.embedding_bag_collection, QuantEBC)
    weights = {k: v for k, v in ebc.state_dict().items() if k.endswith(".weight")}
    assert len(weights) == 26 and {v.dtype for v in weights.values()} == {torch.uint8}
    assert all(v.shape[0] == 500 for v in weights.values())      # int8 rows (+ per-row scale and bias)
    fp32, int8 = _logloss(model, dense, sparse, labels), _logloss(q, dense, sparse, labels)
    assert fp32 != int8 and abs(int8 - fp32) < 0.005


def test_torchrec_dlrm_static_dense_and_over_arch_with_int8_tables(criteo):
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC

    from quant.models.dlrm import criteo_kjt, quantize_tables, trace_dlrm

    model, (train_dense, train_sparse), (dense, sparse, labels) = criteo
    gm = trace_dlrm(quantize_tables(model))
    assert [type(gm.get_submodule(n.target)) for n in gm.graph.nodes if n.op == "call_module"].count(QuantEBC) == 1
    prepared = quant.prepare(gm, get_default_qconfig_mapping("x86"), (train_dense[:8], criteo_kjt(train_sparse[:8])))
    batches = [(d, criteo_kjt(s)) for d, s in zip(train_dense.split(512), train_sparse.split(512))]
    quant.calibrate(prepared, batches, progress=False)
    q = quant.convert(prepared)
    types = _types(q)
    assert types.count(QuantEBC) == 1
    # torchrec Perceptrons: Linear + ReLU; the over arch's last layer is a plain Linear
    assert types.count(nniq.LinearReLU) == 4 and nnq.Linear in types and nn.Linear not in types
    assert abs(_logloss(q, dense, sparse, labels) - _logloss(model, dense, sparse, labels)) < 0.01
    report = quant.sqnr_report(prepared, q, (dense[:512], criteo_kjt(sparse[:512])))
    names = {e.name for e in report}
    assert "dense_arch_model__mlp_0__linear" in names and "over_arch_model_0__mlp_0__linear" in names
    assert all(e.sqnr_db > 15 for e in report)


def test_criteo_loader_names_bad_lines(tmp_path):
    from quant.models.dlrm import load_criteo

    bad = tmp_path / "bad.txt"
    bad.write_text("1\t2\n")
    with pytest.raises(ValueError, match=r"bad\.txt:1: expected 40"):
        load_criteo(bad)
