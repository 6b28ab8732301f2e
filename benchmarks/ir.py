"""IR benchmark: build, python_code and recompile a 10k-node graph with fxdist and with torch.fx.

Both libraries build the *same* graph through the same public API (placeholder, call_function,
call_method, call_module, get_attr, output), then generate code for it and recompile a GraphModule
holding it. The phases are timed alternately (fxdist, torch.fx, fxdist, ...) and the median of the
repetitions is reported with the ratio fxdist / torch.fx (goal: <= 1.0 per phase, no slower than torch.fx).

"construction (gc off)" repeats construction with the cyclic garbage collector disabled: a single
full collection of the whole process heap (torch included) can land inside one library's build
and not the other's, depending on how many GC-tracked objects each allocates per node.

A second table times one forward call of a module-heavy model (nested Sequentials of small Linear
layers, the case where torch.fx's ``getattr(getattr(self.layer1, "0"), ...)`` chains cost most)
for eager PyTorch, torch.fx and fxdist.

Usage: .venv/bin/python benchmarks/ir.py [--nodes 10000] [--reps 7] [--json PATH]  (``--json``: the run's record,
``benchmarks/_bench.py``'s ``Record``)
"""

from __future__ import annotations

import argparse
import gc
import operator
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench  # noqa: E402  (this folder is sys.path[0])

import fxdist  # noqa: E402

N_MODULES = 8


def make_root() -> nn.Module:
    root = nn.Module()
    root.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(N_MODULES))
    root.scale = nn.Parameter(torch.ones(4))
    return root


def build(graph_cls: type, n_nodes: int) -> Any:
    """A chain of ``n_nodes`` nodes mixing the five non-output opcodes."""
    g = graph_cls()
    x = g.placeholder("x")
    y = g.placeholder("y")
    cur = x
    for i in range(n_nodes):
        k = i % 6
        if k == 0:
            cur = g.call_function(operator.add, (cur, y))
        elif k == 1:
            cur = g.call_function(torch.relu, (cur,))
        elif k == 2:
            cur = g.call_method("clamp", (cur,), {"min": -1.0, "max": 1.0})
        elif k == 3:
            cur = g.call_module(f"layers.{i % N_MODULES}", (cur,))
        elif k == 4:
            cur = g.call_function(operator.mul, (cur, g.get_attr("scale")))
        else:
            cur = g.call_function(torch.tanh, (cur,))
    g.output(cur)
    return g


def timed(fn: Callable[[], Any], gc_enabled: bool = True) -> float:
    gc.collect()
    if not gc_enabled:
        gc.disable()
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        gc.enable()


def ir_phases(n_nodes: int, reps: int) -> dict[str, dict[str, list[float]]]:
    root = make_root()
    libs = {"fxdist": (fxdist.Graph, fxdist.GraphModule), "torch.fx": (torch.fx.Graph, torch.fx.GraphModule)}
    graphs = {name: build(g_cls, n_nodes) for name, (g_cls, _) in libs.items()}
    modules = {name: gm_cls(root, graphs[name]) for name, (_, gm_cls) in libs.items()}
    phases = ("construction", "construction (gc off)", "python_code", "recompile")
    times: dict[str, dict[str, list[float]]] = {p: {n: [] for n in libs} for p in phases}
    for _ in range(reps):
        for name, (g_cls, _) in libs.items():
            times["construction"][name].append(timed(lambda: build(g_cls, n_nodes)))
            times["construction (gc off)"][name].append(timed(lambda: build(g_cls, n_nodes), gc_enabled=False))
            times["python_code"][name].append(timed(lambda: graphs[name].python_code("self")))
            times["recompile"][name].append(timed(lambda: modules[name].recompile()))
    return times


def deep_model(depth: int = 4, width: int = 4) -> nn.Module:
    """``width`` blocks of ``depth`` nested Sequentials around small Linear+ReLU pairs."""
    def block(d: int) -> nn.Module:
        if d == 0:
            return nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        return nn.Sequential(*(block(d - 1) for _ in range(2)))
    return nn.Sequential(*(block(depth) for _ in range(width)))


def forward_phase(reps: int, calls: int = 200) -> tuple[int, dict[str, list[float]]]:
    torch.set_num_threads(1)
    model = deep_model().eval()
    x = torch.randn(1, 8)
    contenders = {"eager": model, "torch.fx": torch.fx.symbolic_trace(model), "fxdist": fxdist.symbolic_trace(model)}
    expected = model(x)
    for fn in contenders.values():
        assert torch.allclose(fn(x), expected)
    n_calls = sum(1 for n in contenders["fxdist"].graph.nodes if n.op == "call_module")
    times: dict[str, list[float]] = {name: [] for name in contenders}
    with torch.no_grad():
        for _ in range(reps):
            for name, fn in contenders.items():
                times[name].append(timed(lambda: [fn(x) for _ in range(calls)]) / calls)
    return n_calls, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the record (benchmarks/_bench.py)")
    args = parser.parse_args()
    record = _bench.Record("ir", "Graph IR: build, python_code, recompile; forward of a module-heavy model",
                           {"nodes": args.nodes, "reps": args.reps, "forward threads": 1})
    record.group("ir", f"a {args.nodes}-node graph", "torch.fx", "ms")
    record.group("forward", "forward of nested Sequentials, per call", "torch.fx", "µs")
    record.group("forward_eager", "forward of nested Sequentials, per call", "eager", "µs")
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, {args.nodes} nodes, "
          f"median of {args.reps} alternating reps")
    print(f"{'phase':<24}{'fxdist ms':>12}{'torch.fx ms':>14}{'ratio':>8}")
    for phase, per_lib in ir_phases(args.nodes, args.reps).items():
        ours, theirs = statistics.median(per_lib["fxdist"]), statistics.median(per_lib["torch.fx"])
        print(f"{phase:<24}{ours * 1e3:>12.1f}{theirs * 1e3:>14.1f}{ours / theirs:>8.2f}")
        record.row("ir", phase, ours * 1e3, theirs * 1e3, spread=_bench.paired(per_lib["fxdist"], per_lib["torch.fx"]))
    n_calls, fwd = forward_phase(args.reps)
    eager = statistics.median(fwd["eager"])
    print(f"\nforward of a module-heavy model ({n_calls} call_module nodes, 1 thread), per call")
    print(f"{'contender':<14}{'us':>10}{'vs eager':>10}")
    for name, samples in fwd.items():
        t = statistics.median(samples)
        print(f"{name:<14}{t * 1e6:>10.0f}{t / eager:>10.2f}")
    ratio = statistics.median(fwd["fxdist"]) / statistics.median(fwd["torch.fx"])
    print(f"fxdist / torch.fx forward: {ratio:.2f}")
    label = f"{n_calls} call_module nodes"
    record.row("forward", label, statistics.median(fwd["fxdist"]) * 1e6, statistics.median(fwd["torch.fx"]) * 1e6,
               spread=_bench.paired(fwd["fxdist"], fwd["torch.fx"]))
    record.row("forward_eager", label, statistics.median(fwd["fxdist"]) * 1e6, eager * 1e6,
               spread=_bench.paired(fwd["fxdist"], fwd["eager"]))
    record.write(args.json)


if __name__ == "__main__":
    main()
