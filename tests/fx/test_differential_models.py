"""Differential tests on real models nobody here wrote: torchrec DLRM, transformers ResNet-50 and BERT.

Both tracers get the SAME leaves and wrappers, because torch.fx cannot trace these models as they are
(/work/shared/FACTS.md):

* DLRM: ``EmbeddingBagCollection`` is a leaf (its KeyedJaggedTensor handling is data-dependent); the
  ``KeyedJaggedTensor`` argument flows in as a Proxy.
* ResNet-50: ``ResNetEmbeddings`` is a leaf (its channel check is dynamic control flow) and a wrapper
  fixes ``output_hidden_states=False, return_dict=False``.
* BERT (2 layers, hidden 64): ``BertEmbeddings`` and ``BertSelfAttention`` are leaves, and a wrapper
  calls ``BertModel(input_ids=..., return_dict=False)`` (its ``forward`` is wrapped in ``*args,
  **kwargs`` decorators; without an attention mask its mask helpers stay static).
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import fxdist as fx
from tests._differential import assert_same_as_torch_fx, make_tracers

torchrec = pytest.importorskip("torchrec")
transformers = pytest.importorskip("transformers")

from torchrec.models.dlrm import DLRM  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402
from transformers import BertConfig, BertModel, ResNetConfig, ResNetModel  # noqa: E402
from transformers.models.bert.modeling_bert import BertEmbeddings, BertSelfAttention  # noqa: E402
from transformers.models.resnet.modeling_resnet import ResNetEmbeddings  # noqa: E402


def small_dlrm() -> tuple[nn.Module, tuple[torch.Tensor, KeyedJaggedTensor]]:
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=50, feature_names=[f"f{i}"])
              for i in range(3)]
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables), dense_in_features=4,
                 dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1]).eval()
    lengths = torch.tensor([1, 2, 0, 1, 2, 1, 1, 0, 1, 1, 1, 1])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2"], values=torch.randint(0, 50, (int(lengths.sum()),)), lengths=lengths)
    return model, (torch.rand(4, 4), kjt)


class ResNetNoHidden(nn.Module):
    """transformers' ResNetModel with the output options fixed (static for both tracers)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.resnet = model

    def forward(self, pixel_values):
        return self.resnet(pixel_values, output_hidden_states=False, return_dict=False)


class BertIds(nn.Module):
    """transformers' BertModel called with input ids only."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.bert = model

    def forward(self, input_ids):
        return self.bert(input_ids=input_ids, return_dict=False)


def test_torchrec_dlrm_with_ebc_leaf():
    model, (dense, kjt) = small_dlrm()
    ours, _ = assert_same_as_torch_fx(model, dense, kjt, leaf_modules=(EmbeddingBagCollection,))
    nodes = {n.name: n for n in ours.graph.nodes}
    assert nodes["sparse_features"].type is KeyedJaggedTensor  # the KJT argument flowed as a Proxy
    assert nodes["sparse_arch_embedding_bag_collection"].op == "call_module"
    assert (nodes["to_dict"].op, nodes["to_dict"].target) == ("call_method", "to_dict")
    assert ours.graph.find_nodes(op="get_attr")  # triu_indices slices stored as _tensor_constant*


class KJTUser(nn.Module):
    """KeyedJaggedTensor methods on a Proxy are recorded as call_method."""

    def forward(self, kjt: KeyedJaggedTensor):
        return kjt.values().float().sum() + kjt.lengths().float().mean() + kjt.offsets()[-1]


def test_keyed_jagged_tensor_methods_recorded_as_call_method():
    _, (_, kjt) = small_dlrm()
    ours, _ = assert_same_as_torch_fx(KJTUser(), kjt)
    methods = [n.target for n in ours.graph.nodes if n.op == "call_method"]
    assert methods[:3] == ["values", "float", "sum"] and "lengths" in methods and "offsets" in methods


class KJTToDictLoop(nn.Module):
    def forward(self, kjt: KeyedJaggedTensor):
        return [jt.values() for jt in kjt.to_dict().values()]


def test_looping_over_kjt_to_dict_is_a_trace_error_like_torch_fx():
    with pytest.raises(fx.TraceError, match="cannot be iterated") as ei:
        fx.symbolic_trace(KJTToDictLoop())
    assert "test_differential_models.py" in ei.value.__notes__[0]
    with pytest.raises(torch.fx.proxy.TraceError, match="cannot be iterated"):
        torch.fx.symbolic_trace(KJTToDictLoop())


def test_resnet50_with_embeddings_leaf():
    torch.manual_seed(0)
    model = ResNetNoHidden(ResNetModel(ResNetConfig()).eval())
    ours, _ = assert_same_as_torch_fx(model, torch.randn(1, 3, 64, 64), leaf_modules=(ResNetEmbeddings,),
                                      copy_model=False)  # stores no constants
    assert len(ours.graph.nodes) == 200
    assert [n.op for n in ours.graph.nodes].count("call_module") == 182


def test_bert_two_layers_with_embeddings_and_self_attention_leaves():
    torch.manual_seed(0)
    config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                        vocab_size=1000, max_position_embeddings=64)
    model = BertIds(BertModel(config).eval())
    ids = torch.randint(0, 1000, (2, 16))
    ours, _ = assert_same_as_torch_fx(model, ids, leaf_modules=(BertEmbeddings, BertSelfAttention),
                                      copy_model=False)  # stores no constants
    leaves = [n.target for n in ours.graph.nodes if n.op == "call_module"]
    assert "bert.embeddings" in leaves and "bert.encoder.layer.1.attention.self" in leaves


def test_bert_without_self_attention_leaf_fails_in_both_tracers_at_the_same_line():
    """FACTS.md: BertSelfAttention needs to be a leaf. Both tracers raise the same TraceError;
    fxdist also names the transformers source line (``(*input_shape, -1, ...)`` iterates a Proxy)."""
    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                        vocab_size=100, max_position_embeddings=32)
    model = BertIds(BertModel(config).eval())
    ours_cls, theirs_cls = make_tracers((BertEmbeddings,))
    with pytest.raises(torch.fx.proxy.TraceError) as theirs:
        theirs_cls().trace(model)
    with pytest.raises(fx.TraceError) as ours:
        ours_cls().trace(model)
    assert ours.value.args == theirs.value.args
    assert re.search(r"at transformers/models/bert/modeling_bert\.py:\d+ in forward: `hidden_shape = \(\*input_shape",
                     ours.value.__notes__[0])
