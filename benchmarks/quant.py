"""DeepRecommender on MovieLens-100K: fp32 vs fxdist int8 (quant.prepare/calibrate/convert) vs torch.ao's
``quantize_fx`` int8, in one run. Reproduces torch.fx paper §6.2.1 ("up to 3.3x CPU speedup").

For n_items in {1682, 17768} (MovieLens' width, and the Netflix-prize width of the DeepRecommender paper, padded
with never-rated items), a DeepRecommender (n_items-512-512-1024, mirrored, SELU) is trained on MovieLens-100K
(fp32, ``--epochs`` epochs; a third of them for the wide model), then quantized both ways with the same calibration batches (the x86/FBGEMM default
QConfigMapping). Accuracy: test RMSE (rating units) and the relative output error ||y_int8 - y_fp32|| / ||y_fp32||.
Latency: batch 1, 32 and 256 at 1 and 2 intra-op threads; the three variants are timed in interleaved rounds and
the median per-call time (ms) over rounds is reported. Other engineers' jobs share these 2 cores, so the
speedups are medians of per-round paired ratios (all variants timed back to back in each round). Each row prints speedup = fp32 / fxdist int8 and ratio = torch.ao /
fxdist int8 (> 1: fxdist is faster).

Per-layer selection: int8 pays on CPUs with AVX-512 VNNI, far less on AVX2-only ones. The script
prints the ISA seen (:func:`quant.cpu_isa`) and, per model, :func:`quant.select_int8`'s per-layer choice (fp32 and
int8 µs per call on the calibration batch of 64 rows, speed-up, chosen), and times the selected module as a fourth
variant ("selected": fp32 where no layer pays); selected = fp32 / selected latency.

Allocator: the script re-executes itself with MALLOC_MMAP_THRESHOLD_=33554432 (glibc's default returns
large blocks to the OS and page-faults on every batch) and prints it.

Run: .venv/bin/python benchmarks/quant.py [--epochs 8] [--rounds 7] [--items 1682,17768] [--json PATH]
(``--json``: the run's record, ``benchmarks/_bench.py``'s ``Record``)
"""

from __future__ import annotations

import os
import sys

import _bench  # noqa: E402  (this folder is sys.path[0])

_bench.reexec_with_fixed_allocator()

import argparse  # noqa: E402
import copy  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.ao.quantization import get_default_qconfig_mapping  # noqa: E402
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx  # noqa: E402

import fxdist as fx  # noqa: E402
import quant  # noqa: E402
from quant.data import load_movielens  # noqa: E402
from quant.models import rmse, train_deeprec  # noqa: E402

warnings.filterwarnings("ignore")


def _relative_error(model, ref_model, x) -> float:
    with torch.no_grad():
        ref = ref_model(x)
        return float((model(x) - ref).norm() / ref.norm())


def _median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def build(n_items: int, epochs: int, data_path: Path | None, record: _bench.Record) -> dict:
    torch.set_num_threads(1)  # training and calibration: one thread is faster on the shared 2-core box
    data = load_movielens(data_path, n_items=n_items)
    t0 = time.perf_counter()
    fp32 = train_deeprec(data, epochs=epochs)
    train_s = time.perf_counter() - t0
    calib = list(data.train.split(64))
    example = (data.train[:4],)
    t0 = time.perf_counter()
    prepared = quant.prepare(fx.symbolic_trace(fp32), None, example)
    quant.calibrate(prepared, calib, progress=False)
    ours = quant.convert(prepared)
    ours_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ao_prepared = prepare_fx(copy.deepcopy(fp32), get_default_qconfig_mapping("x86"), example)
    with torch.no_grad():
        for b in calib:
            ao_prepared(b)
    ao = convert_fx(ao_prepared)
    ao_s = time.perf_counter() - t0
    selected, selection = quant.select_int8(fx.symbolic_trace(fp32), calib)
    print(selection, flush=True)
    x = data.train[:256]
    accuracy = (f"test RMSE fp32 {rmse(fp32, data):.4f}, fxdist int8 {rmse(ours, data):.4f}, "
                f"torch.ao int8 {rmse(ao, data):.4f}; rel. output error fxdist {_relative_error(ours, fp32, x):.4f}, "
                f"torch.ao {_relative_error(ao, fp32, x):.4f}")
    print(f"n_items={n_items}: trained {epochs} epochs in {train_s:.1f}s; quantize fxdist {ours_s:.1f}s, "
          f"torch.ao {ao_s:.1f}s; {accuracy}", flush=True)
    chosen = sum(1 for c in selection.layers if c.chosen)
    record.note(f"n_items {n_items}: {accuracy}; select_int8 chose int8 for {chosen} of {len(selection.layers)} layers")
    return {"data": data, "variants": {"fp32": fp32, "fxdist": ours, "torch.ao": ao, "selected": selected}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds per row")
    parser.add_argument("--budget", type=float, default=0.02, help="seconds per variant per round")
    parser.add_argument("--items", default="1682,17768")
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--data", type=Path, default=None, help="movielens-100k folder (default ../shared/data)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the record (benchmarks/_bench.py)")
    args = parser.parse_args()
    record = _bench.Record("quant", "DeepRecommender int8 on MovieLens-100K: fxdist vs torch.ao and fp32 eager",
                           {"epochs": args.epochs, "rounds": args.rounds, "budget_s": args.budget,
                            "quantized engine": torch.backends.quantized.engine,
                            "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_")})
    record.group("vs_ao", "fxdist int8 vs torch.ao quantize_fx int8 (x86 QConfigMapping)", "torch.ao int8", "ms")
    record.group("vs_fp32", "fxdist int8 vs fp32 eager", "fp32 eager", "ms")
    record.group("selected", "select_int8's per-layer choice vs fp32 eager", "fp32 eager", "ms")
    print(f"torch {torch.__version__}, quantized engine {torch.backends.quantized.engine}, ISA {quant.cpu_isa()}, "
          f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_')}, cpus {os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.1f} (other jobs share these cores: expect noise)")
    rows = []
    for n_items in [int(v) for v in args.items.split(",")]:
        epochs = args.epochs if n_items < 4000 else max(2, args.epochs // 3)  # the wide model is 9x costlier
        built = build(n_items, epochs, args.data, record)
        variants, data = built["variants"], built["data"]
        for threads in [int(v) for v in args.threads.split(",")]:
            torch.set_num_threads(threads)
            for batch in [int(v) for v in args.batches.split(",")]:
                x = data.train[:batch].contiguous()
                samples: dict[str, list[float]] = {k: [] for k in variants}
                with torch.no_grad():
                    for model in variants.values():
                        model(x)  # warm-up (weight packing, allocator)
                    for _ in range(args.rounds):
                        for name, model in variants.items():
                            samples[name].append(_bench.median_ms(model, x, args.budget))
                med = {k: statistics.median(v) for k, v in samples.items()}
                # paired per-round ratios (each round times all variants back to back): robust to load drift
                speedup = _median_ratio(samples["fp32"], samples["fxdist"])
                vs_ao = _median_ratio(samples["torch.ao"], samples["fxdist"])
                selected = _median_ratio(samples["fp32"], samples["selected"])
                rows.append((n_items, threads, batch, speedup, vs_ao))
                label = f"{n_items} items, {threads} thread{'s' if threads > 1 else ''}, batch {batch}"
                record.row("vs_ao", label, med["fxdist"], med["torch.ao"], 1 / vs_ao,
                           _bench.paired(samples["fxdist"], samples["torch.ao"]))
                record.row("vs_fp32", label, med["fxdist"], med["fp32"], 1 / speedup,
                           _bench.paired(samples["fxdist"], samples["fp32"]))
                record.row("selected", label, med["selected"], med["fp32"], 1 / selected,
                           _bench.paired(samples["selected"], samples["fp32"]))
                print(
                    f"n_items {n_items:>5}  threads {threads}  batch {batch:>3}  fp32 {med['fp32']:8.3f} ms  "
                    f"fxdist int8 {med['fxdist']:8.3f} ms  torch.ao int8 {med['torch.ao']:8.3f} ms  "
                    f"selected {med['selected']:8.3f} ms  speedup {speedup:5.2f}x  selected {selected:5.2f}x  "
                    f"torch.ao/fxdist {vs_ao:5.2f}",
                    flush=True,
                )
    best = max(r[3] for r in rows)
    ratios = [r[4] for r in rows]
    print(f"best speedup over fp32: {best:.2f}x (paper: up to 3.3x); torch.ao/fxdist latency ratio: "
          f"min {min(ratios):.2f}, median {statistics.median(ratios):.2f}, max {max(ratios):.2f}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    record.write(args.json)


if __name__ == "__main__":
    main()
