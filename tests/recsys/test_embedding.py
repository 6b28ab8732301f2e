"""recsys.embedding: which modules are embedding modules, and the tracer that keeps them whole.

Differential: fxdist's ``EmbeddingLeafTracer`` and a torch.fx ``Tracer`` with the same leaf rule give the same
graph (op, target, args) and the same outputs.
"""

from __future__ import annotations

import torch
import torch.fx
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection

import fxdist
from recsys.embedding import EmbeddingLeafTracer, embedding_kind, is_embedding_module


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10,
                                                                     feature_names=["f0"])])
        self.bag = nn.EmbeddingBag(10, 4, mode="sum")
        self.emb = nn.Embedding(10, 4)
        self.top = nn.Linear(12, 1)

    def forward(self, kjt: KeyedJaggedTensor, ids: torch.Tensor) -> torch.Tensor:
        parts = [self.ebc(kjt).values(), self.bag(ids), self.emb(ids[:, 0])]
        return self.top(torch.cat(parts, dim=1))


class _TorchFXLeafTracer(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return is_embedding_module(m) or super().is_leaf_module(m, qualname)


def _summary(graph) -> list[tuple]:
    def arg(a):
        return a.name if hasattr(a, "op") else (tuple(arg(x) for x in a) if isinstance(a, (tuple, list)) else a)

    return [(n.op, n.target if isinstance(n.target, str) else getattr(n.target, "__name__", n.target),
             tuple(arg(a) for a in n.args)) for n in graph.nodes]


def test_the_kinds_of_embedding_module():
    ebc = Mixed().ebc
    ec = EmbeddingCollection(tables=[EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=5, feature_names=["f"])])
    assert [embedding_kind(m) for m in (ebc, ec, nn.EmbeddingBag(3, 2), nn.Embedding(3, 2), nn.Linear(2, 2))] == [
        "ebc", "ec", "bag", "embedding", None]
    assert not is_embedding_module(nn.Linear(2, 2))


def test_a_quantized_collection_is_a_leaf_but_not_a_movable_kind():
    from torchrec.inference.modules import quantize_embeddings

    model = Mixed().eval()
    quantized = quantize_embeddings(model, dtype=torch.qint8, inplace=False)
    assert type(quantized.ebc).__module__.startswith("torchrec.quant")
    assert is_embedding_module(quantized.ebc) and embedding_kind(quantized.ebc) is None


def test_the_leaf_tracer_gives_torch_fxs_graph_and_outputs():
    torch.manual_seed(0)
    model = Mixed()
    ours = EmbeddingLeafTracer()
    graph = ours.trace(model)
    theirs = _TorchFXLeafTracer().trace(model)
    assert _summary(graph) == _summary(theirs)
    assert [n.target for n in graph.nodes if n.op == "call_module"] == ["ebc", "bag", "emb", "top"]
    kjt = KeyedJaggedTensor(keys=["f0"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
    ids = torch.tensor([[1, 2], [3, 4]])
    gm = fxdist.GraphModule(ours.root, graph)
    torch.testing.assert_close(gm(kjt, ids), torch.fx.GraphModule(model, theirs)(kjt, ids))
    torch.testing.assert_close(gm(kjt, ids), model(kjt, ids))
