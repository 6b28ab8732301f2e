"""Interpreter, ShapeProp and replace_pattern: fxdist vs torch.fx, measured in the same run.

Models: a 200-layer MLP (600 nodes, tiny tensors: measures per-node overhead) and transformers'
ResNet-50 (built from its config, ``ResNetEmbeddings`` as a leaf). For each, prints the median wall
time (ms) of ``Interpreter(gm).run(x)``, ``ShapeProp(gm).propagate(x)`` and a relu -> gelu
``replace_pattern`` on a fresh trace, for fxdist and torch.fx, and the ratio fxdist / torch.fx
(< 1 means fxdist is faster). The two are run alternately, REPS times each.

Run: .venv/bin/python benchmarks/interpreter.py [--reps 15] [--models mlp,resnet50] [--json PATH]
(MALLOC_MMAP_THRESHOLD_ is fixed below; ``--json``: the run's record, ``benchmarks/_bench.py``'s ``Record``)
"""

from __future__ import annotations

import os

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "33554432")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import _bench  # noqa: E402  (this folder is sys.path[0])
import torch  # noqa: E402
import torch.fx  # noqa: E402
from torch.fx import subgraph_rewriter as torch_rewriter  # noqa: E402
from torch.fx.passes.shape_prop import ShapeProp as TorchShapeProp  # noqa: E402

import fxdist as fx  # noqa: E402
from fxdist import subgraph_rewriter  # noqa: E402
from fxdist.passes.shape_prop import ShapeProp  # noqa: E402

REPS = 15


class MLP(torch.nn.Module):
    def __init__(self, depth: int = 200, width: int = 8) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x)) + 1
        return x


def resnet50():
    import transformers
    from transformers.models.resnet.modeling_resnet import ResNetEmbeddings

    model = transformers.ResNetModel(transformers.ResNetConfig()).eval()

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.resnet = model

        def forward(self, pixel_values):
            return self.resnet(pixel_values, output_hidden_states=False, return_dict=False)[0]

    def tracer(base):
        class Leaf(base):
            def is_leaf_module(self, m, qualname):
                return isinstance(m, ResNetEmbeddings) or super().is_leaf_module(m, qualname)

        return Leaf

    return Wrapper(), tracer


def median_ms(ours: Callable[[], object], theirs: Callable[[], object]) -> tuple[float, float, list[float]]:
    """Median wall times (ms) of ``ours`` and ``theirs``, run alternately so load changes hit both, and the
    per-round ratios ours / theirs."""
    ours(), theirs()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(REPS):
        for fn, out in ((ours, times[0]), (theirs, times[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3, _bench.paired(*times)


def relu_pattern(x):
    return torch.relu(x)


def gelu_replacement(x):
    return torch.nn.functional.gelu(x)


def compare(name: str, model: torch.nn.Module, x: torch.Tensor, tracer=None, record=None) -> None:
    def trace(lib):
        if tracer is None:
            return lib.symbolic_trace(model)
        return lib.GraphModule(model, tracer(lib.Tracer)().trace(model))

    ours, theirs = trace(fx), trace(torch.fx)
    rows = [
        ("Interpreter.run", lambda: fx.Interpreter(ours).run(x), lambda: torch.fx.Interpreter(theirs).run(x)),
        ("ShapeProp.propagate", lambda: ShapeProp(ours).propagate(x), lambda: TorchShapeProp(theirs).propagate(x)),
        (
            "trace + replace_pattern",
            lambda: subgraph_rewriter.replace_pattern(trace(fx), relu_pattern, gelu_replacement),
            lambda: torch_rewriter.replace_pattern(trace(torch.fx), relu_pattern, gelu_replacement),
        ),
    ]
    print(f"\n{name}: {len(ours.graph.nodes)} nodes")
    with torch.no_grad():
        for label, ours_fn, theirs_fn in rows:
            a, b, ratios = median_ms(ours_fn, theirs_fn)
            print(f"  {label:<24} fxdist {a:8.2f} ms   torch.fx {b:8.2f} ms   ratio {a / b:5.2f}")
            if record is not None:
                record.row("interpreter", f"{name}: {label}", a, b, spread=ratios)


def main() -> None:
    global REPS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=REPS, help="alternating timed runs of each (median)")
    parser.add_argument("--models", default="mlp,resnet50")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the record (benchmarks/_bench.py)")
    args = parser.parse_args()
    REPS = args.reps
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {REPS}")
    record = _bench.Record("interpreter", "Interpreter, ShapeProp and replace_pattern: fxdist vs torch.fx",
                           {"reps": REPS, "threads": torch.get_num_threads()})
    record.group("interpreter", "wall time of one call", "torch.fx", "ms")
    models = args.models.split(",")
    if "mlp" in models:
        compare("MLP(200 x Linear(8, 8))", MLP(), torch.randn(4, 8), record=record)
    if "resnet50" in models:
        model, tracer = resnet50()
        compare("ResNet-50 (transformers), 1x3x64x64", model, torch.randn(1, 3, 64, 64), tracer, record)
    record.write(args.json)


if __name__ == "__main__":
    main()
