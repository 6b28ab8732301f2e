"""Dynamic quantization (Linear, LSTM) and 8-bit row-wise embedding bags (:mod:`quant.dynamic`)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.ao.nn.quantized as nnq
import torch.ao.nn.quantized.dynamic as nnqd
from torch import nn
from torch.ao.quantization import float_qparams_weight_only_qconfig, get_default_qconfig_mapping

import fxdist as fx
import quant
from tests.quant._graphs import module_types as _types


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
