"""quant.select_int8: per-layer measured int8 selection, with injected timers (deterministic) and real ones."""

from __future__ import annotations

import pytest
import torch
import torch.ao.nn.intrinsic as nni
import torch.ao.nn.intrinsic.quantized as nniq
import torch.ao.nn.quantized as nnq
from torch import nn

import fxdist as fx
from fxdist.passes.cost_model import HardwareProfile
from quant import QuantizationError, cpu_isa, select_int8
from quant.select import MODULE, best_time, isa_from_flags

PROFILE = HardwareProfile("test", 1e10, 1e10, None, 0.0)  # no per-op overhead: shares follow FLOPs and bytes


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()


def _batches(n: int = 3, shape: tuple[int, ...] = (32, 16)) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(*shape) for _ in range(n)]


class FakeTimer:
    """Seconds from tables: per layer ``fp32``/``int8``/``q/dq``; a module costs the sum of its layers (int8
    for those in the variant's selection) plus the q/dq of each int8 layer. Runs each callable once."""

    def __init__(self, fp32: dict, int8: dict, qdq: dict, module_extra: float = 0.0) -> None:
        self.table = {"fp32": fp32, "int8": int8, "q/dq": qdq}
        self.module_extra = module_extra
        self.calls: list[tuple[str, str]] = []

    def __call__(self, subject, variant, run):
        run()  # the callables the pass builds must run
        self.calls.append((subject, variant))
        if subject != MODULE:
            return self.table[variant][subject]
        fp32 = self.table["fp32"]
        int8 = set(fp32) if variant == "int8" else set(variant[5:].split("+")) if variant.startswith("int8:") else set()
        seconds = sum(self.table["int8"][n] + self.table["q/dq"][n] if n in int8 else fp32[n] for n in fp32)
        return seconds + (self.module_extra if int8 else 0.0)


NAMES = ["_0", "_2", "_4"]  # node names of the three Linear layers of _mlp() (fused with their ReLU)


def test_node_names_of_the_candidates():
    gm = fx.symbolic_trace(_mlp())
    assert [n.name for n in gm.graph.nodes if n.op == "call_module"][::2] == NAMES


def test_quantizes_the_layers_faster_in_int8_and_keeps_the_slower_one_fp32():
    model, batches = _mlp(), _batches()
    timer = FakeTimer(dict.fromkeys(NAMES, 10.0), {"_0": 4.0, "_2": 30.0, "_4": 5.0}, dict.fromkeys(NAMES, 1.0))
    q, report = select_int8(model, batches, timer=timer, profile=PROFILE, min_share=0.0)
    assert [(x.name, x.chosen) for x in report.layers] == [("_0", True), ("_2", False), ("_4", True)]
    assert [x.op for x in report.layers] == ["LinearReLU", "LinearReLU", "Linear"]
    assert report.layers[1].reason == "slower in int8" and report.layers[0].speedup == pytest.approx(2.5)
    assert type(q.get_submodule("0")) is nniq.LinearReLU and type(q.get_submodule("4")) is nnq.Linear
    assert type(q.get_submodule("2")) is nni.LinearReLU  # fp32 between two int8 layers: dq before, q after
    node = next(n for n in q.graph.nodes if n.target == "2")
    assert node.args[0].op == "call_method" and node.args[0].target == "dequantize"
    assert next(iter(node.users)).target is torch.quantize_per_tensor
    assert not report.kept_fp32 and report.speedup == pytest.approx(30 / (4 + 1 + 10 + 5 + 1))
    assert report.all_int8_speedup == pytest.approx(30 / (4 + 30 + 5 + 3))
    assert (MODULE, "int8:_0+_4") in timer.calls and q.meta["quant_selection"] is report
    first = [c for c in timer.calls if c[0] == "_0"]  # alternating rounds (default 3), not one variant at a time
    assert first == [("_0", "fp32"), ("_0", "int8"), ("_0", "q/dq")] * 3
    with torch.no_grad():
        torch.testing.assert_close(q(batches[0]), model(batches[0]), atol=0.1, rtol=0.1)
    rows = str(report).splitlines()
    assert [r.split()[0] for r in rows[2:5]] == ["0", "2", "4"]  # layers by module path, not node name (_0...)
    assert "int8 [0, 4]" in rows[5] and rows[6] == report.reason and "int8 for 2 of 3 layers" in rows[6]


def test_retries_with_the_layers_that_pay_their_boundaries():
    # _4 is faster alone (5 < 10) but not with its quantize/dequantize (5 + 11 > 10): the first try is slower
    timer = FakeTimer(dict.fromkeys(NAMES, 10.0), {"_0": 4.0, "_2": 30.0, "_4": 5.0}, {"_0": 1.0, "_2": 1.0, "_4": 11.0})
    q, report = select_int8(_mlp(), _batches(), timer=timer, profile=PROFILE, min_share=0.0)
    assert [names for names, _ in report.tries] == [("_0", "_4"), ("_0",)]
    assert report.chosen == ["_0"] and "faster alone" in report.layers[2].reason
    assert type(q.get_submodule("4")) is nn.Linear and type(q.get_submodule("0")) is nniq.LinearReLU


def test_keeps_fp32_when_the_whole_module_is_not_faster():
    model, batches = _mlp(), _batches()
    timer = FakeTimer(dict.fromkeys(NAMES, 10.0), {"_0": 4.0, "_2": 30.0, "_4": 5.0}, dict.fromkeys(NAMES, 1.0),
                      module_extra=50.0)  # boundaries outside the layers (e.g. an int8 cat's requantize)
    q, report = select_int8(model, batches, timer=timer, profile=PROFILE, min_share=0.0)
    assert report.kept_fp32 and report.speedup == 1.0 and report.int8_us is None
    assert report.reason.startswith("kept fp32: the layers faster in int8 alone (0, 4) do not make the whole module "
                                    "faster") and not report.chosen
    assert not any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in q.modules())
    with torch.no_grad():
        assert torch.equal(q(batches[0]), model(batches[0]))


def test_keeps_fp32_and_says_so_when_no_layer_is_faster():
    timer = FakeTimer(dict.fromkeys(NAMES, 10.0), dict.fromkeys(NAMES, 12.0), dict.fromkeys(NAMES, 1.0))
    q, report = select_int8(_mlp(), _batches(), timer=timer, profile=PROFILE, min_share=0.0)
    assert report.reason == f"kept fp32: no layer is faster in int8 on this CPU ({cpu_isa()})"
    assert report.kept_fp32 and not any(v.startswith("int8:") for _, v in timer.calls)
    assert [x.reason for x in report.layers] == ["slower in int8"] * 3
    assert report.as_dict()["layers"][0]["speedup"] == pytest.approx(10 / 12)


def test_cost_model_skips_negligible_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)).eval()
    names = ["_0", "_2"]
    timer = FakeTimer(dict.fromkeys(names, 10.0), dict.fromkeys(names, 5.0), dict.fromkeys(names, 1.0))
    # predicted: _0 2*64*256*256 FLOP = 839 µs at 1e10 FLOP/s; _2 about 7 µs (memory): under 1 %
    q, report = select_int8(model, _batches(2, (64, 256)), timer=timer, profile=PROFILE, min_share=0.01)
    assert {s for s, _ in timer.calls} == {"_0", MODULE}
    skipped = report.layers[1]
    assert skipped.fp32_us is None and not skipped.chosen and skipped.reason.startswith("not measured")
    assert report.layers[0].predicted_us == pytest.approx(839, rel=0.01) and skipped.predicted_us < 10
    assert report.chosen == ["_0"] and type(q.get_submodule("2")) is nn.Linear


def test_cost_model_counts_a_fused_linear_relu_like_its_linear():
    import quant
    from fxdist.passes.cost_model import estimate

    model, x = _mlp(), _batches(1)[0]
    fused = quant.fuse(fx.symbolic_trace(model), patterns=True)
    assert type(fused.get_submodule("0")) is nni.LinearReLU
    plain = {n.name: n for n in estimate(fx.symbolic_trace(model), x, profile=PROFILE).nodes}
    costs = {n.name: n for n in estimate(fused, x, profile=PROFILE).nodes}
    assert costs["_0"].flops == plain["_0"].flops == 2 * 32 * 16 * 64 and costs["_2"].flops == plain["_2"].flops


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(16, 4)

    def forward(self, x):
        return self.out(torch.cat([self.a(x), self.b(x)], dim=1))


@pytest.mark.parametrize("b_int8", [True, False])
def test_a_function_op_stays_int8_only_when_its_inputs_arrive_in_int8(b_int8):
    torch.manual_seed(0)
    model, names = TwoHeads().eval(), ["a", "b", "out"]
    int8 = {"a": 1.0, "b": 1.0 if b_int8 else 20.0, "out": 1.0}
    timer = FakeTimer(dict.fromkeys(names, 10.0), int8, dict.fromkeys(names, 0.5))
    xs = _batches(3, (16, 8))
    q, report = select_int8(model, xs, timer=timer, profile=PROFILE, min_share=0.0)
    assert report.chosen == (names if b_int8 else ["a", "out"])
    cat = next(n for n in q.graph.nodes if n.name == "cat")
    assert cat.target is torch.cat  # int8 cat of inputs at a shared scale, or a float cat
    kinds = [a.op == "call_method" and a.target == "dequantize" for a in cat.args[0]]
    assert kinds == ([False, False] if b_int8 else [True, False])
    with torch.no_grad():
        torch.testing.assert_close(q(xs[0]), model(xs[0]), atol=0.1, rtol=0.1)


def test_real_measurement_invariants():
    model, batches = _mlp(), _batches(2, (64, 16))
    q, report = select_int8(model, batches, timer=best_time(2, 0.0005, 0.0), min_share=0.0)
    assert [x.name for x in report.layers] == NAMES and report.isa == cpu_isa()
    for layer in report.layers:
        assert layer.fp32_us > 0 and layer.int8_us > 0 and layer.boundary_us > 0 and layer.input_shape[0] == 64
        quantized = type(q.get_submodule(layer.target)).__module__.startswith("torch.ao.nn.intrinsic.quantized") or \
            type(q.get_submodule(layer.target)).__module__.startswith("torch.ao.nn.quantized")
        assert quantized == layer.chosen
    assert report.speedup >= 1.0 and (report.kept_fp32 or report.int8_us < report.fp32_us)
    with torch.no_grad():
        ref, out = model(batches[0]), q(batches[0])
    assert (out - ref).norm() / ref.norm() < (0.0 if report.kept_fp32 else 0.1) + 1e-12
    text = str(report)
    assert report.isa in text and [r.split()[0] for r in text.splitlines()[2:5]] == ["0", "2", "4"]


def test_real_measurement_falls_back_to_fp32_when_the_whole_module_is_slower():
    real = best_time(2, 0.0005, 0.0)

    def timer(subject, variant, run):  # real numbers, skewed: each layer looks 10x faster in int8 alone,
        seconds = real(subject, variant, run)  # any int8 selection of the whole module 100x slower
        if subject == MODULE:
            return seconds * 100 if variant.startswith("int8:") else seconds
        return seconds / 10 if variant == "int8" else seconds

    model, batches = _mlp(), _batches(2, (64, 16))
    q, report = select_int8(model, batches, timer=timer, min_share=0.0)
    assert report.tries and report.tries[0][0] == tuple(NAMES)  # a real int8 selection was built and measured
    assert report.kept_fp32 and report.speedup == 1.0 and not report.chosen
    assert "do not make the whole module faster" in report.reason
    with torch.no_grad():
        assert torch.equal(q(batches[0]), model(batches[0]))


def test_isa_and_errors():
    assert isa_from_flags(["avx2", "avx512vnni"]) == "AVX-512 VNNI"
    assert cpu_isa("/nonexistent/cpuinfo").endswith("(VNNI unknown)")
    with pytest.raises(QuantizationError, match="calibration is empty"):
        select_int8(_mlp(), [])
    with pytest.raises(ValueError, match="min_share"):
        select_int8(_mlp(), _batches(), min_share=1.5)


class _Encoder(nn.Module):
    """An ``nn.TransformerEncoder`` (a torch.nn leaf: it stays fp32) with a padding mask and a Linear head.
    Shapes: ``x (B, S, 16)``, ``pad (B, S)`` bool -> ``(B, 1)``."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2)  # enable_nested_tensor: eval + mask -> nested tensors
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x, src_key_padding_mask=pad)[:, 0])


def _encoder_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(2)
    pad = torch.zeros(4, 6, dtype=torch.bool)
    pad[:, 4:] = True
    return [(torch.randn(4, 6, 16), pad) for _ in range(2)]


def test_the_cost_model_runs_on_a_transformer_encoder_with_a_padding_mask():
    """The bug this guards against: eval mode + a padding mask took TransformerEncoder's fast path (nested tensors), which
    FakeTensor cannot describe: ShapeProp now runs with ``torch.backends.mha`` fast path off."""
    torch.manual_seed(0)
    model = _Encoder().eval()
    timer = FakeTimer({"head": 10.0}, {"head": 4.0}, {"head": 1.0})
    with torch.no_grad():
        q, report = select_int8(model, _encoder_batches(), timer=timer, profile=PROFILE, min_share=0.0)
    assert [(x.target, x.op, x.input_shape, x.chosen) for x in report.layers] == [("head", "Linear", (4, 16), True)]
    # bytes-bound at 1e10 B/s: input (4, 16), weight (1, 16) and bias read, output (4, 1) written, fp32
    assert report.layers[0].predicted_us == pytest.approx((4 * 16 + 16 + 1 + 4) * 4 / 1e10 * 1e6, rel=1e-6)
    assert type(q.get_submodule("head")) is nnq.Linear and type(q.get_submodule("enc")) is nn.TransformerEncoder
    assert torch.backends.mha.get_fastpath_enabled()  # restored


def test_fake_tensor_shapes_of_a_transformer_encoder_need_the_fast_path_off():
    from fxdist.passes.cost_model import estimate
    from quant.select import _mha_fastpath_disabled

    torch.manual_seed(0)
    model, batch = _Encoder().eval(), _encoder_batches()[0]
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="NestedTensorImpl doesn't support sizes"):
            estimate(fx.symbolic_trace(model), *batch, profile=PROFILE)  # FakeTensor, fast path on: the bug
        with _mha_fastpath_disabled():
            gm = fx.symbolic_trace(model)
            estimate(gm, *batch, profile=PROFILE)  # FakeTensor still: no real fallback here
    shapes = {n.name: tuple(n.meta["tensor_meta"].shape) for n in gm.graph.nodes if n.op == "call_module"}
    assert shapes == {"enc": (4, 6, 16), "head": (4, 1)}


def test_the_cost_model_falls_back_to_real_tensors_when_fake_tensors_fail(monkeypatch):
    import fxdist.passes.cost_model as cost_model

    def refuses(gm, example_inputs):  # what FakeTensor does with an op it has no fake kernel for
        raise RuntimeError("no fake impl for mylib::op")

    monkeypatch.setattr(cost_model, "_propagate_shapes", refuses)
    timer = FakeTimer(dict.fromkeys(NAMES, 10.0), {"_0": 4.0, "_2": 30.0, "_4": 5.0}, dict.fromkeys(NAMES, 1.0))
    q, report = select_int8(_mlp(), _batches(), timer=timer, profile=PROFILE, min_share=0.0)
    # the shapes came from the real batch: _0 is 2*32*16*64 FLOP = 6.6 µs at 1e10 FLOP/s, or its bytes
    flops_us = 2 * 32 * 16 * 64 / 1e10 * 1e6
    bytes_us = (32 * 16 + 16 * 64 + 64 + 32 * 64) * 4 / 1e10 * 1e6
    assert report.layers[0].predicted_us == pytest.approx(max(flops_us, bytes_us), rel=1e-6)
    assert report.chosen == ["_0", "_4"]
