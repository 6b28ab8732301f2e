"""Roofline cost model: FLOPs agree with torch.utils.flop_counter, bytes are exact, profiles and errors."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import fxdist as fx
from fxdist.passes.cost_model import PROFILES, HardwareProfile, estimate, measure_cpu_profile

# Ops that torch.utils.flop_counter counts; it counts nothing for elementwise ops, so those are left out.
_COUNTED = ("linear", "conv", "matmul", "mm", "bmm", "addmm", "baddbmm")


def _counted_flops(report, gm) -> int:
    modules = dict(gm.named_modules())

    def counted(cost) -> bool:
        if cost.op == "call_module":
            return isinstance(modules[cost.target], (torch.nn.Linear, torch.nn.modules.conv._ConvNd))
        return cost.target in _COUNTED

    return sum(n.flops for n in report.nodes if counted(n))


def _reference_flops(model, *inputs) -> int:
    with FlopCounterMode(display=False) as counter:
        model(*inputs)
    return counter.get_total_flops()


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1, groups=1)
        self.dw = torch.nn.Conv2d(8, 8, 3, stride=2, groups=8)
        self.up = torch.nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.fc = torch.nn.Linear(4 * 14 * 14, 10)

    def forward(self, x):
        y = self.up(torch.relu(self.dw(torch.relu(self.conv(x)))))
        return self.fc(y.flatten(1)) @ torch.ones(10, 5)


def test_linear_and_conv_flops_match_torch_flop_counter() -> None:
    model, x = ConvNet().eval(), torch.randn(2, 3, 16, 16)
    gm = fx.symbolic_trace(model)
    report = estimate(gm, x, profile="nvidia-a100-sxm4-80gb")
    assert _counted_flops(report, gm) == _reference_flops(model, x) > 0


def test_functional_matmuls_match_torch_flop_counter() -> None:
    def f(a, b, c, w):
        return torch.bmm(a, b).sum() + torch.matmul(c, w).sum() + torch.nn.functional.linear(c, w.t()).sum()

    args = (torch.randn(3, 4, 5), torch.randn(3, 5, 6), torch.randn(7, 8), torch.randn(8, 2))
    gm = fx.symbolic_trace(f)
    report = estimate(gm, *args, profile="nvidia-h100-sxm5")
    assert _counted_flops(report, gm) == _reference_flops(f, *args) > 0


def test_bytes_read_and_written_are_exact_for_a_linear() -> None:
    gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 8)))
    report = estimate(gm, torch.randn(2, 4), profile="nvidia-v100-sxm2")
    (linear,) = [n for n in report.nodes if n.op == "call_module"]
    assert linear.param_bytes == (4 * 8 + 8) * 4
    assert linear.bytes_read == 2 * 4 * 4 + linear.param_bytes
    assert linear.bytes_written == 2 * 8 * 4
    assert linear.flops == 2 * 2 * 4 * 8
    assert gm.graph.find_nodes(op="call_module")[0].meta["cost"] is linear


def test_roofline_picks_the_slower_of_compute_and_memory() -> None:
    gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(256, 256)))
    x = torch.randn(64, 256)
    compute_bound = estimate(gm, x, profile=HardwareProfile("slow-alu", 1e6, 1e15))
    node = [n for n in compute_bound.nodes if n.op == "call_module"][0]
    assert node.bound == "compute" and node.seconds == pytest.approx(node.flops / 1e6)
    memory_bound = estimate(gm, x, profile=HardwareProfile("slow-mem", 1e15, 1e6, op_overhead_seconds=1e-3))
    node = [n for n in memory_bound.nodes if n.op == "call_module"][0]
    assert node.bound == "memory"
    assert node.seconds == pytest.approx((node.bytes_read + node.bytes_written) / 1e6 + 1e-3)
    assert memory_bound.total_seconds == pytest.approx(sum(n.seconds for n in memory_bound.nodes))
    assert "total" in memory_bound.table() and "slow-mem" in memory_bound.table()


def test_half_precision_uses_the_tensor_core_peak() -> None:
    profile = PROFILES["nvidia-a100-sxm4-80gb"]
    assert profile.flops_for(torch.bfloat16) == 312e12
    assert profile.flops_for(torch.float32) == 19.5e12


def test_cpu_profile_is_measured_once_and_plausible() -> None:
    profile = measure_cpu_profile(1)
    assert profile is measure_cpu_profile(1)
    assert 1e8 < profile.peak_flops < 1e13
    assert 1e8 < profile.memory_bandwidth < 1e12
    assert 0 < profile.op_overhead_seconds < 1e-3


def test_errors_name_what_is_missing() -> None:
    gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU()))
    with pytest.raises(ValueError, match="pass example inputs"):
        estimate(gm, profile="nvidia-v100-sxm2")
    with pytest.raises(ValueError, match="unknown hardware profile 'tpu'"):
        estimate(gm, torch.randn(2), profile="tpu")


def test_transformers_resnet_conv_flops_match_torch_flop_counter() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                       layer_type="bottleneck")
    model = transformers.ResNetModel(config).eval()

    class Tracer(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, transformers.models.resnet.modeling_resnet.ResNetEmbeddings) or \
                super().is_leaf_module(m, qualname)

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, pixel_values):
            return self.model(pixel_values).last_hidden_state

    wrapped = Wrapped()
    gm = fx.GraphModule(wrapped, Tracer().trace(wrapped))
    x = torch.randn(1, 3, 32, 32)
    report = estimate(gm, x, profile="nvidia-a100-sxm4-80gb")
    embedder_flops = _reference_flops(model.embedder, x)
    leaf = [n for n in report.nodes if n.target == "model.embedder"]
    assert len(leaf) == 1
    assert _counted_flops(report, gm) + embedder_flops == _reference_flops(wrapped, x)


def test_torchrec_dlrm_matmul_flops_match_and_embedding_reads_are_counted() -> None:
    torchrec = pytest.importorskip("torchrec")
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100, feature_names=[f"f{i}"])
              for i in range(3)]
    ebc = torchrec.EmbeddingBagCollection(tables=tables)
    model = DLRM(ebc, dense_in_features=13, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1]).eval()

    class Tracer(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, torchrec.EmbeddingBagCollection) or super().is_leaf_module(m, qualname)

    gm = fx.GraphModule(model, Tracer().trace(model))
    batch = 4
    kjt = torchrec.KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.randint(0, 100, (3 * batch,)),
                                     lengths=torch.ones(3 * batch, dtype=torch.int32))
    dense = torch.randn(batch, 13)
    report = estimate(gm, dense, kjt, profile="nvidia-a100-sxm4-80gb")
    assert _counted_flops(report, gm) == _reference_flops(model, dense, kjt) > 0
    (ebc_cost,) = [c for c in report.nodes if c.target == "sparse_arch.embedding_bag_collection"]
    assert ebc_cost.param_bytes == 3 * 100 * 8 * 4
    # ShapeProp leaves torchrec's KeyedJaggedTensor/KeyedTensor opaque (as torch.fx does), so the EBC's
    # traffic is its tables; the dense side is sized exactly: (B, 13) float32 into the first linear.
    assert ebc_cost.bytes_read == ebc_cost.param_bytes
    first = report.nodes[[c.name for c in report.nodes].index("dense_arch_model__mlp_0__linear")]
    assert first.bytes_read == batch * 13 * 4 + (13 * 16 + 16) * 4
