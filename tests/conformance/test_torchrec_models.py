"""Stock torchrec models trace with fxdist exactly as with torch.fx, with no leaves or wrappers added.

torchrec registers its helpers with ``torch.fx.wrap`` (e.g. ``reorder_inverse_indices`` and
``process_pooled_embeddings`` in ``torchrec/modules/embedding_modules.py``) and builds ``KeyedTensor`` /
``JaggedTensor`` through ``torch.fx.ProxyableClassMeta``; fxdist's tracer honours both
(``fxdist.interop.enter_torch_fx_trace``). Each test compares (op, target, args, kwargs, name) node by
node against torch.fx and the outputs of both GraphModules against eager on a real KeyedJaggedTensor.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx
from torch import nn

import fxdist as fx
from tests._differential import assert_outputs_close, assert_same_as_torch_fx, compare_graphs

torchrec = pytest.importorskip("torchrec")

from torchrec.datasets.utils import Batch  # noqa: E402
from torchrec.distributed.test_utils.test_model import ModelInput  # noqa: E402
from torchrec.models.deepfm import SimpleDeepFMNN, SimpleDeepFMNNWrapper  # noqa: E402
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRM_Projection, DLRMTrain, DLRMWrapper  # noqa: E402
from torchrec.models.experimental.transformerdlrm import DLRM_Transformer  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig  # noqa: E402
from torchrec.modules.embedding_modules import (  # noqa: E402
    EmbeddingBagCollection,
    EmbeddingCollection,
    process_pooled_embeddings,
    reorder_inverse_indices,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor  # noqa: E402

FEATURES = ["f0", "f1", "f2"]


def _ebc() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=50, feature_names=[f])
        for i, f in enumerate(FEATURES)])


def _inputs(batch: int = 4) -> tuple[torch.Tensor, KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 3, (len(FEATURES) * batch,), generator=gen)
    values = torch.randint(0, 50, (int(lengths.sum()),), generator=gen)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=values, lengths=lengths)
    return torch.rand(batch, 4, generator=gen), kjt


MODELS = {
    "DLRM": lambda: DLRM(_ebc(), 4, [16, 8], [16, 1]),
    "DLRM_DCN": lambda: DLRM_DCN(_ebc(), 4, [16, 8], [16, 1], dcn_num_layers=2, dcn_low_rank_dim=4),
    "DLRM_Projection": lambda: DLRM_Projection(_ebc(), 4, [16, 8], [16, 1], [12, 16], [12, 16]),
    "DLRM_Transformer": lambda: DLRM_Transformer(_ebc(), 4, [16, 8], [16, 1], nhead=2, ntransformer_layers=1),
    "SimpleDeepFMNN": lambda: SimpleDeepFMNN(4, _ebc(), 16, 8),
}


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("name", sorted(MODELS))
def test_stock_torchrec_model_traces_like_torch_fx(name):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    ours, _ = assert_same_as_torch_fx(model, *_inputs())
    wrapped = [n.target for n in ours.graph.nodes if n.meta.get("is_wrapped")]
    # the torch.fx.wrap-registered helpers are leaves, not traced through
    assert reorder_inverse_indices in wrapped and process_pooled_embeddings in wrapped
    assert KeyedTensor in [n.target for n in ours.graph.nodes]  # ProxyableClassMeta construction


def test_symbolic_trace_entry_points_agree_on_dlrm():
    torch.manual_seed(0)
    model = MODELS["DLRM"]().eval()
    ours = fx.symbolic_trace(copy.deepcopy(model))
    theirs = torch.fx.symbolic_trace(copy.deepcopy(model))
    compare_graphs(ours.graph, theirs.graph)
    dense, kjt = _inputs(batch=6)  # another batch size than traced with: nothing was specialized
    with torch.no_grad():
        assert_outputs_close(ours(dense, kjt), model(dense, kjt), 1e-6, 1e-6, "fxdist DLRM vs eager")


def test_dlrm_train_with_a_torchrec_batch_argument():
    torch.manual_seed(0)
    dense, kjt = _inputs()
    model = DLRMTrain(MODELS["DLRM"]()).eval()
    ours, _ = assert_same_as_torch_fx(model, Batch(dense, kjt, torch.ones(4)))
    loss = [n for n in ours.graph.nodes if n.op == "call_module" and n.target == "loss_fn"]
    assert len(loss) == 1


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("make", [lambda: DLRMWrapper(_ebc(), 4, [16, 8], [16, 1]),
                                  lambda: SimpleDeepFMNNWrapper(4, _ebc(), 16, 8)], ids=["DLRMWrapper", "DeepFMWrapper"])
def test_model_input_wrappers(make, training):
    torch.manual_seed(0)
    dense, kjt = _inputs()
    model = make().train(training)
    batch = ModelInput(float_features=dense, idlist_features=kjt, idscore_features=None, label=torch.rand(4))
    ours, _ = assert_same_as_torch_fx(model, batch)
    losses = [n for n in ours.graph.nodes if n.target is torch.nn.functional.binary_cross_entropy_with_logits]
    assert len(losses) == (1 if training else 0)  # self.training is static while tracing


class BagsAndSequences(nn.Module):
    """A user module holding an EmbeddingBagCollection and an EmbeddingCollection (traced through)."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name="bags", embedding_dim=4, num_embeddings=50, feature_names=["f0", "f1"])])
        self.ec = EmbeddingCollection(tables=[
            EmbeddingConfig(name="seq", embedding_dim=4, num_embeddings=50, feature_names=["f2"])])

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(kjt).to_dict()
        sequences = self.ec(kjt)
        return pooled["f0"] * pooled["f1"] + sequences["f2"].to_padded_dense(1).sum(1)


def test_module_with_embedding_bag_and_embedding_collections():
    torch.manual_seed(0)
    ours, _ = assert_same_as_torch_fx(BagsAndSequences(), _inputs()[1])
    targets = [n.target for n in ours.graph.nodes]
    assert KeyedTensor in targets and JaggedTensor in targets
    assert {"ebc.embedding_bags.bags", "ec.embeddings.seq"} <= set(targets)
