"""torchrec's DLRM on Criteo (:mod:`quant.models.dlrm`): tables by torchrec's quantization, dense and over arches by
fxdist's static PTQ."""

from __future__ import annotations

import pytest
import torch
import torch.ao.nn.intrinsic.quantized as nniq
import torch.ao.nn.quantized as nnq
from torch import nn
from torch.ao.quantization import get_default_qconfig_mapping

import quant
from tests.quant._graphs import module_types as _types


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
