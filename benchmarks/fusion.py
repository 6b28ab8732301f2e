"""ResNet-50 eval latency before and after conv-bn fusion: fxdist's ``quant.fuse`` vs torch.fx's
``torch.fx.experimental.optimization.fuse``, in one run. Reproduces torch.fx paper §6.2.2 (CPU: 40% lower
latency multi-threaded, 18% single-threaded).

The model is transformers' ``ResNetForImageClassification(ResNetConfig())`` (ResNet-50, random weights,
non-trivial BatchNorm statistics), 224x224 inputs. Variants, timed in interleaved rounds (each round runs every variant back to back for ``--budget`` seconds; other jobs
share these cores, so latency reductions are medians of per-round paired ratios, and latencies medians of rounds):

* ``eager``: the unfused model, eager;
* ``fxdist``: the fxdist trace, unfused (isolates codegen overhead from fusion);
* ``fxdist fused``: ``quant.fuse`` (+ the stem conv-bn inside the leaf embeddings module);
* ``torch.fx fused``: the same model traced by torch.fx and fused by ``optimization.fuse``;
* ``fxdist+oneDNN``: ``quant.fuse(gm, onednn_inputs=...)``: the fold, then Conv2d + residual add + ReLU as one
  oneDNN kernel with a prepacked weight (:mod:`quant.fuse_onednn`).

Each row prints "lower latency" = 1 - fused / eager for both fusers, and torch.fx fused / fxdist fused (> 1:
fxdist is faster). Outputs of all variants are checked against eager first (max abs diff printed).

Allocator: re-executes itself with MALLOC_MMAP_THRESHOLD_=33554432 (glibc's defaults added
11-14 % to eager batch-8 latency in page faults) and prints it.

Run: .venv/bin/python benchmarks/fusion.py [--rounds 7] [--threads 1,2] [--batches 1,8] [--json PATH]
(``--json``: the run's record, ``benchmarks/_bench.py``'s ``Record``)
"""

from __future__ import annotations

import os
import sys

import _bench  # noqa: E402  (this folder is sys.path[0])

_bench.reexec_with_fixed_allocator()

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.fx  # noqa: E402
from torch.fx.experimental.optimization import fuse as torch_fx_fuse  # noqa: E402

import quant  # noqa: E402
from quant.models.resnet import fold_leaf_stem, resnet50, trace_resnet  # noqa: E402

warnings.filterwarnings("ignore")


def _median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def build() -> dict:
    model = resnet50()
    t0 = time.perf_counter()
    gm = trace_resnet(model)
    fused = quant.fuse(gm)
    stems = fold_leaf_stem(fused)
    ours_s = time.perf_counter() - t0
    onednn = quant.fuse(gm, onednn_inputs=(torch.randn(1, 3, 224, 224),))
    fold_leaf_stem(onednn)
    t0 = time.perf_counter()
    ref = torch_fx_fuse(trace_resnet(model, fx=torch.fx), no_trace=True)
    ref_s = time.perf_counter() - t0
    pass_record = fused.meta["fxdist"]["passes"][0]
    print(
        f"ResNet-50: {len(gm.graph.nodes)} nodes traced; fxdist fuse erased {pass_record['nodes_erased']} BN nodes "
        f"(+{stems} in the leaf stem) in {ours_s:.2f}s (trace+fuse); torch.fx trace+fuse {ref_s:.2f}s",
        flush=True,
    )
    return {"eager": model, "fxdist": gm, "fxdist fused": fused, "torch.fx fused": ref, "fxdist+oneDNN": onednn}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--budget", type=float, default=0.1, help="seconds per variant per round")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the record (benchmarks/_bench.py)")
    args = parser.parse_args()
    record = _bench.Record("fusion", "ResNet-50 (224x224) eval latency after conv-bn fusion",
                           {"rounds": args.rounds, "budget_s": args.budget,
                            "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_")})
    record.group("vs_fx", "fxdist quant.fuse vs torch.fx optimization.fuse", "torch.fx fused", "ms")
    record.group("vs_eager", "fxdist quant.fuse vs the unfused model", "eager", "ms")
    record.group("onednn", "fxdist fold + oneDNN post-ops vs the unfused model", "eager", "ms")
    print(f"torch {torch.__version__}, MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_')}, "
          f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.1f} (shared cores: expect noise)")
    torch.set_num_threads(1)
    variants = build()
    torch.manual_seed(0)
    with torch.no_grad():
        x = torch.randn(2, 3, 224, 224)
        ref = variants["eager"](x)
        diffs = {k: float((m(x) - ref).abs().max()) for k, m in variants.items() if k != "eager"}
    print("max |output - eager| (logits ~1e2): " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    record.note("max |output - eager| (logits ~1e2): " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    record.note("torch.fx paper §6.2.2: 18 % lower latency single-threaded, 40 % multi-threaded (their CPU)")
    results = []
    for threads in [int(v) for v in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for batch in [int(v) for v in args.batches.split(",")]:
            x = torch.randn(batch, 3, 224, 224)
            samples: dict[str, list[float]] = {k: [] for k in variants}
            with torch.no_grad():
                for m in variants.values():
                    m(x)
                for _ in range(args.rounds):
                    for name, m in variants.items():
                        samples[name].append(_bench.median_ms(m, x, args.budget))
            med = {k: statistics.median(v) for k, v in samples.items()}
            # paired per-round ratios: each round times every variant back to back, so slow drifts in the
            # other jobs' load cancel out; the median of the ratios is the estimate
            ours = 1 - _median_ratio(samples["fxdist fused"], samples["eager"])
            theirs = 1 - _median_ratio(samples["torch.fx fused"], samples["eager"])
            vs = _median_ratio(samples["torch.fx fused"], samples["fxdist fused"])
            post = 1 - _median_ratio(samples["fxdist+oneDNN"], samples["eager"])
            results.append((threads, batch, ours, theirs, med, post))
            label = f"{threads} thread{'s' if threads > 1 else ''}, batch {batch}"
            record.row("vs_fx", label, med["fxdist fused"], med["torch.fx fused"],
                       _median_ratio(samples["fxdist fused"], samples["torch.fx fused"]),
                       _bench.paired(samples["fxdist fused"], samples["torch.fx fused"]))
            record.row("vs_eager", label, med["fxdist fused"], med["eager"], 1 - ours,
                       _bench.paired(samples["fxdist fused"], samples["eager"]))
            record.row("onednn", label, med["fxdist+oneDNN"], med["eager"], 1 - post,
                       _bench.paired(samples["fxdist+oneDNN"], samples["eager"]))
            print(
                f"threads {threads}  batch {batch}  eager {med['eager']:8.1f} ms  fxdist {med['fxdist']:8.1f} ms  "
                f"fxdist fused {med['fxdist fused']:8.1f} ms  torch.fx fused {med['torch.fx fused']:8.1f} ms  "
                f"fxdist+oneDNN {med['fxdist+oneDNN']:8.1f} ms  lower latency vs eager: fxdist fold {ours:6.1%}  "
                f"torch.fx fold {theirs:6.1%}  fxdist fold+oneDNN post-ops {post:6.1%}  "
                f"torch.fx fused/fxdist fused {vs:.3f}",
                flush=True,
            )
    single = [(r[2], r[5]) for r in results if r[0] == 1]
    print("single-threaded latency reduction vs eager (paper: 18%): conv-bn fold "
          + ", ".join(f"{a:.1%}" for a, _ in single) + "; fold + oneDNN post-ops "
          + ", ".join(f"{b:.1%}" for _, b in single) + f"; load average at the end {os.getloadavg()[0]:.1f}")
    record.write(args.json)


if __name__ == "__main__":
    main()
