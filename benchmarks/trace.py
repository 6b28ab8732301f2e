"""Capture cost and GraphModule call overhead: fxdist vs torch.fx, measured in the same run.

For each model (torchrec DLRM, transformers ResNet-50 and 2-layer BERT, a 200-layer MLP):

* capture: ``Tracer().trace(model)`` + ``GraphModule(root, graph)`` (what ``symbolic_trace`` does), and
  ``gm.recompile()`` alone; median of ``--repeats`` runs, fxdist and torch.fx alternating;
* node counts of both graphs;
* forward overhead on a tiny input: eager, torch.fx GraphModule, fxdist GraphModule, median of
  ``--repeats`` blocks of ``--calls`` calls each, alternating, one thread.

Prints times and the fxdist/torch.fx and GM/eager ratios. Goals: capture <= 1.0x torch.fx; fxdist
forward no slower than eager. Same leaves and wrappers as tests/fx/test_differential_models.py.

Run: ``.venv/bin/python benchmarks/trace.py [--repeats 11] [--calls 200] [--json PATH]`` (``--json``: the run's
record, ``benchmarks/_bench.py``'s ``Record``)
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench  # noqa: E402  (this folder is sys.path[0])

import fxdist as fx  # noqa: E402
from tests._differential import make_tracers  # noqa: E402


def _models() -> list[tuple[str, nn.Module, tuple[Any, ...], tuple[type, ...]]]:
    """(name, model, tiny inputs, leaf module types)."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from transformers import BertConfig, BertModel, ResNetConfig, ResNetModel

    from tests.fx.test_differential_models import (
        BertEmbeddings,
        BertIds,
        BertSelfAttention,
        ResNetEmbeddings,
        ResNetNoHidden,
        small_dlrm,
    )

    torch.manual_seed(0)
    dlrm, dlrm_inputs = small_dlrm()
    resnet = ResNetNoHidden(ResNetModel(ResNetConfig()).eval())
    bert = BertIds(BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=128, vocab_size=1000,
                                        max_position_embeddings=64)).eval())
    mlp = nn.Sequential(*[m for _ in range(100) for m in (nn.Linear(16, 16), nn.ReLU())]).eval()
    return [
        ("dlrm", dlrm, dlrm_inputs, (EmbeddingBagCollection,)),
        ("resnet50", resnet, (torch.randn(1, 3, 16, 16),), (ResNetEmbeddings,)),
        ("bert2", bert, (torch.randint(0, 1000, (1, 8)),), (BertEmbeddings, BertSelfAttention)),
        ("mlp200", mlp, (torch.randn(1, 16),), ()),
    ]


def _drop_constants(root: nn.Module) -> None:
    """Remove the ``_tensor_constant*`` attributes a trace stored, so every run starts equal."""
    for name in [k for k in vars(root) if k.startswith("_tensor_constant")]:
        delattr(root, name)


def _capture(tracer_cls: type, gm_cls: type, model: nn.Module) -> tuple[Any, float, float]:
    gc.collect()
    t0 = time.perf_counter()
    tracer = tracer_cls()
    graph = tracer.trace(model)
    gm = gm_cls(tracer.root, graph, type(model).__name__)
    t1 = time.perf_counter()
    gm.recompile()
    t2 = time.perf_counter()
    _drop_constants(model)
    return gm, t1 - t0, t2 - t1


def _per_call_us(fn: Callable[..., Any], inputs: tuple[Any, ...], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*inputs)
    return (time.perf_counter() - t0) / calls * 1e6


def bench_model(name: str, model: nn.Module, inputs: tuple[Any, ...], leaves: tuple[type, ...],
                repeats: int, calls: int, record: _bench.Record | None = None) -> dict[str, float]:
    ours_cls, theirs_cls = make_tracers(leaves)
    times: dict[str, list[float]] = {k: [] for k in ("ours", "theirs", "ours_rc", "theirs_rc")}
    for i in range(repeats + 1):  # first round is warm-up
        order = [(ours_cls, fx.GraphModule, "ours"), (theirs_cls, torch.fx.GraphModule, "theirs")]
        for tracer_cls, gm_cls, key in order if i % 2 == 0 else order[::-1]:
            gm, capture_s, recompile_s = _capture(tracer_cls, gm_cls, model)
            if i:
                times[key].append(capture_s)
                times[f"{key}_rc"].append(recompile_s)
            if key == "ours":
                ours_gm = gm
            else:
                theirs_gm = gm
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    n_ours, n_theirs = len(ours_gm.graph.nodes), len(theirs_gm.graph.nodes)

    fwd: dict[str, list[float]] = {"eager": [], "torch.fx": [], "fxdist": []}
    runners = [("eager", model), ("torch.fx", theirs_gm), ("fxdist", ours_gm)]
    with torch.no_grad():
        for fn_name, fn in runners:  # warm-up
            _per_call_us(fn, inputs, 3)
        # at most ``calls`` calls and about 50 ms per timed block
        calls = max(3, min(calls, int(50e3 / _per_call_us(model, inputs, 3))))
        for i in range(repeats):
            for fn_name, fn in runners if i % 2 == 0 else runners[::-1]:
                fwd[fn_name].append(_per_call_us(fn, inputs, calls))
    fmed = {k: statistics.median(v) for k, v in fwd.items()}

    print(f"\n== {name}: {n_ours} nodes (torch.fx {n_theirs})")
    print(f"  capture   fxdist {med['ours']:8.2f} ms  torch.fx {med['theirs']:8.2f} ms  "
          f"ratio {med['ours'] / med['theirs']:.2f}x")
    print(f"  recompile fxdist {med['ours_rc']:8.2f} ms  torch.fx {med['theirs_rc']:8.2f} ms  "
          f"ratio {med['ours_rc'] / med['theirs_rc']:.2f}x")
    print(f"  forward   ({calls} calls x {repeats} blocks)")
    print(f"            eager {fmed['eager']:9.1f} us  torch.fx {fmed['torch.fx']:9.1f} us  "
          f"fxdist {fmed['fxdist']:9.1f} us")
    print(f"            torch.fx/eager {fmed['torch.fx'] / fmed['eager']:.3f}x  "
          f"fxdist/eager {fmed['fxdist'] / fmed['eager']:.3f}x  "
          f"fxdist/torch.fx {fmed['fxdist'] / fmed['torch.fx']:.3f}x")
    if record is not None:
        label = f"{name} ({n_ours} nodes)"
        record.row("capture", label, med["ours"], med["theirs"], spread=_bench.paired(times["ours"], times["theirs"]))
        record.row("recompile", label, med["ours_rc"], med["theirs_rc"],
                   spread=_bench.paired(times["ours_rc"], times["theirs_rc"]))
        record.row("forward_eager", label, fmed["fxdist"], fmed["eager"],
                   spread=_bench.paired(fwd["fxdist"], fwd["eager"]))
        record.row("forward_fx", label, fmed["fxdist"], fmed["torch.fx"],
                   spread=_bench.paired(fwd["fxdist"], fwd["torch.fx"]))
    return {"capture_ratio": med["ours"] / med["theirs"], "recompile_ratio": med["ours_rc"] / med["theirs_rc"],
            "forward_vs_eager": fmed["fxdist"] / fmed["eager"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=11, help="timed rounds per measurement (median)")
    parser.add_argument("--calls", type=int, default=200, help="forward calls per timed round")
    parser.add_argument("--models", default="dlrm,resnet50,bert2,mlp200")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the record (benchmarks/_bench.py)")
    args = parser.parse_args()
    record = _bench.Record("trace", "FX capture and GraphModule call overhead: fxdist vs torch.fx and eager",
                           {"repeats": args.repeats, "calls": args.calls, "threads": 1,
                            "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", "unset")})
    record.group("capture", "symbolic_trace + GraphModule", "torch.fx", "ms")
    record.group("recompile", "GraphModule.recompile", "torch.fx", "ms")
    record.group("forward_eager", "forward on a tiny input, fxdist GraphModule vs eager", "eager", "µs")
    record.group("forward_fx", "forward on a tiny input, fxdist vs torch.fx GraphModule", "torch.fx", "µs")
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, MALLOC_MMAP_THRESHOLD_="
          f"{os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}, repeats={args.repeats}, calls={args.calls}")
    wanted = set(args.models.split(","))
    results = {}
    for name, model, inputs, leaves in _models():
        if name in wanted:
            results[name] = bench_model(name, model, inputs, leaves, args.repeats, args.calls, record)
    print("\nsummary (fxdist / torch.fx for capture and recompile; fxdist GM / eager for forward):")
    for name, r in results.items():
        print(f"  {name:9s} capture {r['capture_ratio']:.2f}x  recompile {r['recompile_ratio']:.2f}x  "
              f"forward {r['forward_vs_eager']:.3f}x eager")
    record.write(args.json)


if __name__ == "__main__":
    main()
