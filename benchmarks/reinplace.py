"""Reinplace: peak memory and time of a functionalized graph before and after the pass, vs eager.

Two models with in-place-able work on 2048x2048 float32 tensors (16 MiB each):
* ``elementwise_chain``: 12 in-place elementwise ops on a clone (functionalization makes each one allocate);
* ``slice_select_updates``: 8 in-place updates of row slices and columns (functionalization turns each
  into a full-size ``slice_scatter``/``select_scatter`` copy, which reinplace removes);
* ``sgd_step``: ``p.mul_(0.9).add_(g, alpha=-0.1)`` on the input ``p`` (functionalization computes a new
  tensor and ``copy_``s it back); reinplaced with ``reuse_overwritten_inputs=True``.

Each is captured with ``fxdist.make_fx(torch.func.functionalize(f))``, then ``fxdist.passes.reinplace``.
Peak memory = the largest total size of tensor storages allocated during one call and still alive,
counted by a TorchDispatchMode (every ATen op's fresh output storages; freed when their last tensor
dies). Time = median of REPS calls (perf_counter). Prints bytes, seconds and the ratios after/before and
after/eager, measured in the same run.

Allocator: glibc's malloc returns large blocks to the OS with default settings (page faults on every batch); the
script re-executes itself with MALLOC_MMAP_THRESHOLD_=33554432 (32 MiB > one tensor) and 1 intra-op thread.

Run: .venv/bin/python benchmarks/reinplace.py
"""

from __future__ import annotations

import os

import _bench  # noqa: E402  (this folder is sys.path[0])

_bench.reexec_with_fixed_allocator({"OMP_NUM_THREADS": "1"})

import statistics  # noqa: E402
import time  # noqa: E402
import weakref  # noqa: E402

import torch  # noqa: E402
from torch.func import functionalize  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from fxdist.experimental.proxy_tensor import make_fx  # noqa: E402
from fxdist.passes.reinplace import reinplace  # noqa: E402

N = 2048
REPS = 9


class PeakMemory(TorchDispatchMode):
    """Counts bytes of storages allocated by ATen ops while active; ``peak_bytes`` is the high-water mark."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list] = {}  # data_ptr -> [nbytes, live tensor count]
        self.current_bytes = 0
        self.peak_bytes = 0

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current_bytes -= entry[0]
            del self.live[ptr]

    def _track(self, t: torch.Tensor, preexisting: set[int]) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in preexisting and ptr not in self.live:
            return  # an input's (or a mutated argument's) storage: not allocated here
        entry = self.live.get(ptr)
        if entry is None:
            entry = self.live[ptr] = [storage.nbytes(), 0]
            self.current_bytes += entry[0]
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        entry[1] += 1
        weakref.finalize(t, self._release, ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        preexisting = {
            a.untyped_storage().data_ptr() for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, preexisting)
        return out


def elementwise_chain(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    for _ in range(4):
        y.mul_(0.5).add_(1.0).sigmoid_()
    return y


def slice_select_updates(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    rows = x.shape[0] // 8
    for i in range(8):
        y[i * rows : (i + 1) * rows].mul_(2.0)
        y[:, i].zero_()
    return y


def sgd_step(p: torch.Tensor) -> torch.Tensor:
    g = p.sin()
    p.mul_(0.9).add_(g, alpha=-0.1)
    return p


def _peak_bytes(fn, x: torch.Tensor) -> int:
    counter = PeakMemory()
    with counter:
        out = fn(x)
    del out
    return counter.peak_bytes


def _median_seconds(fns: dict[str, object], x: torch.Tensor) -> dict[str, float]:
    """Median wall time per function; calls are interleaved so machine noise hits all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(REPS + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(x)
            if rep:  # the first round is a warm-up
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _pass_seconds(fn, x: torch.Tensor, reps: int = 3) -> tuple[float, float]:
    """Median seconds to capture and reinplace ``fn`` with fxdist, and with torch.fx (the peer)."""
    from torch.fx.experimental.proxy_tensor import make_fx as torch_make_fx
    from torch.fx.passes.reinplace import reinplace as torch_reinplace

    small = x[:64, :64].clone()  # the pass only reads metadata; keep tracing cheap
    ours, theirs = [], []
    for _ in range(reps):
        start = time.perf_counter()
        reinplace(make_fx(functionalize(fn))(small.clone()), small)
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        torch_reinplace(torch_make_fx(functionalize(fn))(small.clone()), small)
        theirs.append(time.perf_counter() - start)
    return statistics.median(ours), statistics.median(theirs)


def _report(label: str, values: dict[str, float], fmt: str) -> None:
    shown = "  ".join(f"{k}={fmt.format(v)}" for k, v in values.items())
    ratios = f"after/before={values['after'] / values['before']:.3f}  after/eager={values['after'] / values['eager']:.3f}"
    print(f"  {label}   {shown}   {ratios}")


def main() -> None:
    torch.manual_seed(0)
    print(f"reinplace benchmark: {N}x{N} float32, torch {torch.__version__}, threads={torch.get_num_threads()}, "
          f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}, median of {REPS}")
    for fn in (elementwise_chain, slice_select_updates, sgd_step):
        x = torch.randn(N, N)
        before = make_fx(functionalize(fn))(x)
        after = reinplace(make_fx(functionalize(fn))(x), x, reuse_overwritten_inputs=fn is sgd_step)
        torch.testing.assert_close(after(x.clone()), fn(x.clone()))
        counts = {k: sum(1 for n in g.graph.nodes if n.op == "call_function") for k, g in (("before", before), ("after", after))}  # noqa: E501
        inplace = sum(1 for n in after.graph.nodes if n.op == "call_function" and n.target._schema.is_mutable)
        variants = {"eager": fn, "before": before, "after": after}
        peak = {name: _peak_bytes(f, x) for name, f in variants.items()}
        secs = _median_seconds(variants, x)
        print(f"\n{fn.__name__}: ops before={counts['before']} after={counts['after']} (in-place after: {inplace})")
        _report("peak MiB", {k: v / 2**20 for k, v in peak.items()}, "{:.0f}")
        _report("time ms ", {k: v * 1e3 for k, v in secs.items()}, "{:.1f}")
        ours, theirs = _pass_seconds(fn, x)
        print(f"  pass time ms   fxdist={ours * 1e3:.1f}  torch.fx={theirs * 1e3:.1f}   fxdist/torch.fx={ours / theirs:.3f}"
              "   (make_fx + reinplace of the same function)")


if __name__ == "__main__":
    main()
