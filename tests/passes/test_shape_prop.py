"""ShapeProp: same TensorMetadata as torch.fx's ShapeProp on torch.fx's trace (toy models, torchrec
DLRM, transformers BERT and ResNet), nested values, quantized tensors, and fake mode without allocation."""

from __future__ import annotations

import copy
import doctest
import resource

import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.shape_prop import ShapeProp as TorchShapeProp

import fxdist as fx
import fxdist.passes.shape_prop as shape_prop_module
from fxdist.passes.shape_prop import ShapeProp, TensorMetadata


def propagate_both(ours_gm, theirs_gm, *inputs):
    """Run both ShapeProps; assert node names and tensor_meta agree node by node; return the count."""
    ShapeProp(ours_gm).propagate(*inputs)
    TorchShapeProp(theirs_gm).propagate(*inputs)
    ours, theirs = list(ours_gm.graph.nodes), list(theirs_gm.graph.nodes)
    assert [n.name for n in ours] == [n.name for n in theirs]
    compared = 0
    for a, b in zip(ours, theirs):
        assert ("tensor_meta" in a.meta) == ("tensor_meta" in b.meta), a.name
        if "tensor_meta" in b.meta:
            assert a.meta["tensor_meta"] == b.meta["tensor_meta"], a.name
            compared += 1
        assert a.meta["type"] is b.meta["type"], a.name
    return compared


def same_as_torch_fx(model, *inputs, tracer=None):
    if tracer is None:
        return propagate_both(fx.symbolic_trace(model), torch.fx.symbolic_trace(model), *inputs)
    ours_cls, theirs_cls = tracer
    twin = copy.deepcopy(model)  # tracers may add attributes (_tensor_constant0) to the root
    ours = fx.GraphModule(model, ours_cls().trace(model))
    theirs = torch.fx.GraphModule(twin, theirs_cls().trace(twin))
    return propagate_both(ours, theirs, *inputs)


class TwoLayerNet(torch.nn.Module):
    def __init__(self, d_in: int, hidden: int, d_out: int) -> None:
        super().__init__()
        self.linear1 = torch.nn.Linear(d_in, hidden)
        self.linear2 = torch.nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.linear2(self.linear1(x).clamp(min=0))


def test_two_layer_net_like_torch_fx():
    gm = fx.symbolic_trace(TwoLayerNet(10, 6, 3))
    ShapeProp(gm).propagate(torch.randn(5, 10))
    shapes = [(n.name, tuple(n.meta["tensor_meta"].shape)) for n in gm.graph.nodes]
    assert shapes == [("x", (5, 10)), ("linear1", (5, 6)), ("clamp", (5, 6)), ("linear2", (5, 3)), ("output", (5, 3))]
    meta = gm.graph.find_nodes(op="call_module", target="linear2")[0].meta["tensor_meta"]
    assert meta == TensorMetadata(torch.Size([5, 3]), torch.float32, True, (3, 1), torch.contiguous_format, False, {})
    assert same_as_torch_fx(TwoLayerNet(10, 6, 3), torch.randn(5, 10)) == 5


def test_nested_values_and_layouts():
    def f(x, img):
        parts = torch.split(x, 2, dim=1)  # tuple of tensors
        top = x.max(dim=0)  # namedtuple (values, indices)
        d = {"a": parts[0], "n": x.shape[0]}  # dict with a non-tensor leaf
        t = x.t()  # non-contiguous
        cl = img.contiguous(memory_format=torch.channels_last)
        return parts, top, d, t, cl, [x.sum(), x.size()]

    count = same_as_torch_fx(f, torch.randn(3, 4), torch.randn(2, 3, 4, 5))
    assert count >= 8
    gm = fx.symbolic_trace(f)
    ShapeProp(gm).propagate(torch.randn(3, 4), torch.randn(2, 3, 4, 5))
    nodes = {n.name: n for n in gm.graph.nodes}
    split, t, cl = nodes["split"].meta["tensor_meta"], nodes["t"].meta["tensor_meta"], nodes["contiguous"].meta
    assert isinstance(split, tuple) and [tuple(m.shape) for m in split] == [(3, 2), (3, 2)]
    assert t.stride == (1, 4) and t.memory_format is None
    assert cl["tensor_meta"].memory_format is torch.channels_last
    out = nodes["output"].meta["tensor_meta"]
    assert out[2]["n"] == 3 and isinstance(out[2]["a"], TensorMetadata)
    assert type(out[1]).__name__ == "max"  # the namedtuple type is kept


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions.*:UserWarning")
def test_quantized_tensor_qparams():
    def f(x):
        q = torch.quantize_per_tensor(x, 0.1, 3, torch.quint8)
        return q.dequantize()

    assert same_as_torch_fx(f, torch.randn(4)) == 4
    gm = fx.symbolic_trace(f)
    ShapeProp(gm).propagate(torch.randn(4))
    meta = gm.graph.find_nodes(op="call_function", target=torch.quantize_per_tensor)[0].meta["tensor_meta"]
    assert meta.is_quantized and meta.qparams == {"qscheme": torch.per_tensor_affine, "scale": 0.1, "zero_point": 3}


def test_val_is_a_storage_less_stand_in():
    gm = fx.symbolic_trace(TwoLayerNet(4, 3, 2))
    ShapeProp(gm).propagate(torch.randn(2, 4))
    val = gm.graph.find_nodes(op="call_module", target="linear1")[0].meta["val"]
    assert val.device.type == "meta" and val.shape == (2, 3) and val.dtype == torch.float32


def test_fake_mode_on_a_real_module_leaves_it_real():
    model = TwoLayerNet(4, 3, 2)
    gm = fx.symbolic_trace(model)
    weight = gm.linear1.weight
    out = ShapeProp(gm, fake_mode=FakeTensorMode()).propagate(torch.randn(7, 4))
    assert isinstance(out, FakeTensor) and out.shape == (7, 2)
    assert gm.linear1.weight is weight and not isinstance(weight, FakeTensor)
    assert isinstance(gm.graph.find_nodes(op="output")[0].meta["val"], FakeTensor)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_fake_mode_40_gb_linear_allocates_nothing():
    n = 100_000  # Linear(n, n) in fp32: 40 GB of weights, more than this machine has
    mode = FakeTensorMode()
    with mode:
        model = torch.nn.Sequential(torch.nn.Linear(n, n), torch.nn.ReLU())
    gm = fx.symbolic_trace(model)
    peak_before = _peak_rss_bytes()
    out = ShapeProp(gm, fake_mode=mode).propagate(torch.randn(2, n))
    assert _peak_rss_bytes() - peak_before < 512 * 2**20
    assert isinstance(out, FakeTensor) and out.shape == (2, n)
    assert [tuple(nd.meta["tensor_meta"].shape) for nd in gm.graph.nodes] == [(2, n)] * 4


def test_meta_device_model_needs_no_fake_mode():
    model = torch.nn.Linear(100_000, 100_000, device="meta")
    gm = fx.symbolic_trace(model)
    out = ShapeProp(gm).propagate(torch.empty(3, 100_000, device="meta"))
    assert out.device.type == "meta"
    assert gm.graph.find_nodes(op="output")[0].meta["tensor_meta"].shape == (3, 100_000)


def test_error_names_the_node():
    gm = fx.symbolic_trace(TwoLayerNet(4, 3, 2))
    with pytest.raises(RuntimeError) as info:
        ShapeProp(gm).propagate(torch.randn(2, 5))
    assert any("While executing %linear1" in note for note in info.value.__notes__)


# ---- real models --------------------------------------------------------------------------------


def test_torchrec_dlrm_like_torch_fx():
    pytest.importorskip("torchrec")
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=50, feature_names=[f"f{i}"]) for i in range(3)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=13, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1])

    def with_ebc_leaf(base):
        class EbcLeaf(base):
            def is_leaf_module(self, m, qualname):
                return isinstance(m, EmbeddingBagCollection) or super().is_leaf_module(m, qualname)

        return EbcLeaf

    batch = 4
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2"], values=torch.randint(0, 50, (3 * batch,)), lengths=torch.ones(3 * batch, dtype=torch.int32)
    )
    dense = torch.randn(batch, 13)
    compared = same_as_torch_fx(model, dense, kjt, tracer=(with_ebc_leaf(fx.Tracer), with_ebc_leaf(torch.fx.Tracer)))
    assert compared >= 20


def _transformers():
    return pytest.importorskip("transformers")


def test_bert_like_torch_fx():
    transformers = _transformers()
    from transformers.models.bert.modeling_bert import BertEmbeddings, BertSelfAttention

    config = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()

    def leaves(base):
        class BertTracer(base):
            def is_leaf_module(self, m, qualname):
                return isinstance(m, (BertEmbeddings, BertSelfAttention)) or super().is_leaf_module(m, qualname)

        return BertTracer

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = model

        def forward(self, input_ids):  # an attention_mask would make the mask code branch on a Proxy
            return self.bert(input_ids=input_ids).last_hidden_state

    ids = torch.randint(0, 100, (2, 7))
    compared = same_as_torch_fx(Wrapper(), ids, tracer=(leaves(fx.Tracer), leaves(torch.fx.Tracer)))
    assert compared >= 20


def test_resnet_like_torch_fx():
    transformers = _transformers()
    from transformers.models.resnet.modeling_resnet import ResNetEmbeddings

    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    torch.manual_seed(0)
    model = transformers.ResNetModel(config).eval()

    def leaves(base):
        class ResNetTracer(base):
            def is_leaf_module(self, m, qualname):
                return isinstance(m, ResNetEmbeddings) or super().is_leaf_module(m, qualname)

        return ResNetTracer

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.resnet = model

        def forward(self, pixel_values):
            return self.resnet(pixel_values, output_hidden_states=False, return_dict=False)[0]

    compared = same_as_torch_fx(Wrapper(), torch.randn(2, 3, 32, 32), tracer=(leaves(fx.Tracer), leaves(torch.fx.Tracer)))
    assert compared >= 10


def test_docstring_example():
    result = doctest.testmod(shape_prop_module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_fake_mode_converts_nested_inputs():
    def f(pair, d):
        return pair[0] @ pair[1] + d["bias"]

    gm = fx.symbolic_trace(f)
    out = ShapeProp(gm, fake_mode=FakeTensorMode()).propagate((torch.randn(2, 3), torch.randn(3, 5)), {"bias": torch.randn(5)})
    assert isinstance(out, FakeTensor) and out.shape == (2, 5)
    assert gm.graph.find_nodes(op="output")[0].meta["tensor_meta"].shape == (2, 5)
