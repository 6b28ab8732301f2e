"""Cost model vs reality: predicted and measured per-node time on three real models.

For each model (transformers' ResNet-50 and a BERT encoder built from configs, torchrec's DLRM), the graph
is traced with fxdist, the roofline model predicts each node's time on this CPU's measured profile, and a
timing Interpreter measures each node (median of REPS runs). Prints both per node (the slowest ones), and
the Pearson correlation of log times and the Spearman rank correlation over all compute nodes.

Run: .venv/bin/python benchmarks/cost_model.py   (re-executes itself with MALLOC_MMAP_THRESHOLD_ fixed)
"""

from __future__ import annotations

import os

import _bench  # noqa: E402  (this folder is sys.path[0])

_bench.reexec_with_fixed_allocator()

import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import fxdist as fx  # noqa: E402
from fxdist.passes.cost_model import estimate, measure_cpu_profile  # noqa: E402

REPS = 15


class NodeTimer(fx.Interpreter):
    """Runs the graph and records each node's wall time (seconds) in ``self.times[name]``."""

    def __init__(self, gm):
        super().__init__(gm)
        self.times: dict[str, list[float]] = {}

    def run_node(self, n):
        start = time.perf_counter()
        result = super().run_node(n)
        self.times.setdefault(n.name, []).append(time.perf_counter() - start)
        return result


def _ranks(values: list[float]) -> torch.Tensor:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = torch.empty(len(values))
    for rank, index in enumerate(order):
        ranks[index] = rank
    return ranks


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def resnet50():
    import transformers

    model = transformers.ResNetModel(transformers.ResNetConfig()).eval()
    leaf = transformers.models.resnet.modeling_resnet.ResNetEmbeddings

    class Tracer(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, leaf) or super().is_leaf_module(m, qualname)

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, pixel_values):
            return self.model(pixel_values).last_hidden_state

    wrapped = Wrapped()
    return "ResNet-50 (1x3x112x112)", fx.GraphModule(wrapped, Tracer().trace(wrapped)), (torch.randn(1, 3, 112, 112),)


def bert():
    import transformers

    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=4,
                                     intermediate_size=1024)
    model = transformers.BertModel(config).eval()
    leaves = (transformers.models.bert.modeling_bert.BertEmbeddings,
              transformers.models.bert.modeling_bert.BertSelfAttention)

    class Tracer(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, leaves) or super().is_leaf_module(m, qualname)

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = model

        def forward(self, input_ids):
            return self.bert(input_ids=input_ids).last_hidden_state

    enc = Encoder()
    ids = torch.randint(0, config.vocab_size, (8, 128))
    return "BERT 2-layer (8x128)", fx.GraphModule(enc, Tracer().trace(enc)), (ids,)


def dlrm():
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=64, num_embeddings=10_000, feature_names=[f"f{i}"])
              for i in range(4)]
    model = DLRM(EmbeddingBagCollection(tables=tables), dense_in_features=13, dense_arch_layer_sizes=[256, 64],
                 over_arch_layer_sizes=[256, 128, 1]).eval()

    class Tracer(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, EmbeddingBagCollection) or super().is_leaf_module(m, qualname)

    batch = 512
    lengths = torch.ones(4 * batch, dtype=torch.int32)
    kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(4)], values=torch.randint(0, 10_000, (4 * batch,)),
                            lengths=lengths)
    return "torchrec DLRM (batch 512)", fx.GraphModule(model, Tracer().trace(model)), (torch.randn(batch, 13), kjt)


def main() -> None:
    torch.set_num_threads(1)
    profile = measure_cpu_profile(1)
    print(f"profile {profile.name}: {profile.peak_flops / 1e9:.1f} GFLOP/s, "
          f"{profile.memory_bandwidth / 1e9:.1f} GB/s, {profile.op_overhead_seconds * 1e6:.1f} µs/op; "
          f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}, threads=1, reps={REPS}")
    for build in (resnet50, bert, dlrm):
        name, gm, inputs = build()
        report = estimate(gm, *inputs, profile=profile)
        timer = NodeTimer(gm)
        with torch.no_grad():
            for _ in range(REPS):
                timer.run(*inputs)
        rows = [(c, statistics.median(timer.times[c.name])) for c in report.nodes
                if c.op in ("call_function", "call_method", "call_module")]
        predicted = torch.tensor([c.seconds for c, _ in rows])
        measured = torch.tensor([m for _, m in rows])
        spearman = _pearson(_ranks(predicted.tolist()), _ranks(measured.tolist()))
        log_pearson = _pearson(predicted.clamp_min(1e-9).log(), measured.clamp_min(1e-9).log())
        print(f"\n== {name}: {len(rows)} compute nodes; predicted total {predicted.sum() * 1e3:.2f} ms, "
              f"measured total {measured.sum() * 1e3:.2f} ms (ratio {float(predicted.sum() / measured.sum()):.2f})")
        print(f"   Spearman rank correlation {spearman:.3f}, Pearson on log time {log_pearson:.3f}")
        print(f"   {'node':<40}{'predicted µs':>14}{'measured µs':>14}  bound")
        for c, m in sorted(rows, key=lambda r: -r[1])[:8]:
            print(f"   {c.name[:39]:<40}{c.seconds * 1e6:>14.1f}{m * 1e6:>14.1f}  {c.bound}")


if __name__ == "__main__":
    main()
