"""A roofline cost model over fxdist graphs: the torch.fx paper's inference simulation.

Source: torch.fx paper (Reed et al., MLSys 2022) §6.3, "program analysis": the graph, annotated with shapes
by :class:`~fxdist.passes.shape_prop.ShapeProp`, is walked node by node to estimate FLOPs, memory traffic and
runtime on a hardware profile without running the model on that hardware.

Per node (``NodeCost``):

* ``flops``: floating-point operations; a multiply-add counts 2 (the convention of
  ``torch.utils.flop_counter``, so matmul/conv counts agree with it exactly). Elementwise and normalisation
  ops count a few FLOPs per output element (table ``_ELEMENTWISE_FLOPS``); shape/view ops count 0.
* ``bytes_read``: bytes of the tensor inputs plus the parameters and buffers a ``call_module`` reads;
  ``bytes_written``: bytes of the tensor outputs; ``param_bytes``: the parameter/buffer part of the reads.
* ``seconds``: roofline estimate ``max(flops / peak_flops, bytes / bandwidth) + op_overhead_seconds``
  for the profile; ``bound`` says which term won.

Shapes: read from ``node.meta["tensor_meta"]`` (shape, dtype), else from the tensors in ``node.meta["val"]``;
:func:`estimate` runs ShapeProp (in fake mode, so nothing is allocated) when the graph has no shapes yet.
Values ShapeProp leaves opaque (torchrec's ``KeyedJaggedTensor``/``KeyedTensor``, as in torch.fx) count 0
bytes, so an ``EmbeddingBagCollection`` leaf is charged for its tables alone.
"""

from __future__ import annotations

import functools
import math
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, cast

import torch
from torch.utils._pytree import tree_leaves

from fxdist.graph_module import GraphModule
from fxdist.node import Node

__all__ = ["HardwareProfile", "NodeCost", "CostReport", "estimate", "node_flops", "measure_cpu_profile",
           "PROFILES"]


@dataclass(frozen=True)
class HardwareProfile:
    """Peak rates of a device.

    Attributes:
        name: a label for reports.
        peak_flops: FLOP/s reached by fp32 matrix multiply.
        memory_bandwidth: bytes/s of streaming copies (read + write counted).
        peak_flops_half: FLOP/s for fp16/bf16 (tensor cores); defaults to ``peak_flops``.
        op_overhead_seconds: fixed cost per executed operator (dispatch, kernel launch), in seconds.
    """

    name: str
    peak_flops: float
    memory_bandwidth: float
    peak_flops_half: float | None = None
    op_overhead_seconds: float = 0.0

    def flops_for(self, dtype: torch.dtype | None) -> float:
        if dtype in (torch.float16, torch.bfloat16) and self.peak_flops_half:
            return self.peak_flops_half
        return self.peak_flops


# Vendor datasheet figures (dense, no sparsity): fp32 non-tensor-core peak, fp16/bf16 tensor-core peak, HBM.
PROFILES: dict[str, HardwareProfile] = {
    "nvidia-v100-sxm2": HardwareProfile("nvidia-v100-sxm2", 15.7e12, 900e9, 125e12, 5e-6),
    "nvidia-a100-sxm4-80gb": HardwareProfile("nvidia-a100-sxm4-80gb", 19.5e12, 2039e9, 312e12, 5e-6),
    "nvidia-h100-sxm5": HardwareProfile("nvidia-h100-sxm5", 67e12, 3350e9, 989e12, 4e-6),
}


@functools.lru_cache(maxsize=None)
def measure_cpu_profile(threads: int | None = None) -> HardwareProfile:
    """Measure this CPU once (about 0.5 s) and cache the result.

    Peak FLOP/s from a 512x512 fp32 matmul, bandwidth from copying a 64 MiB tensor, per-op overhead from a
    tiny ``add``. ``threads`` defaults to ``torch.get_num_threads()``.
    """
    old = torch.get_num_threads()
    threads = threads or old
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        flops = 2 * 512**3 / _best_time(lambda: torch.mm(a, b), 10)
        src, dst = torch.empty(16 * 2**20), torch.empty(16 * 2**20)
        bandwidth = 2 * src.numel() * 4 / _best_time(lambda: dst.copy_(src), 5)
        x = torch.ones(4)
        overhead = _best_time(lambda: torch.add(x, x), 200)
    finally:
        torch.set_num_threads(old)
    return HardwareProfile(f"cpu-{threads}t", flops, bandwidth, None, overhead)


def _best_time(fn, reps: int) -> float:
    fn()
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


@dataclass
class NodeCost:
    """The estimate for one node; see the module docstring for the meaning of each field."""

    name: str
    op: str
    target: str
    flops: int
    bytes_read: int
    bytes_written: int
    param_bytes: int
    seconds: float = 0.0
    bound: str = "none"


@dataclass
class CostReport:
    """Per-node costs in graph order, with totals."""

    profile: HardwareProfile
    nodes: list[NodeCost] = field(default_factory=list)

    @property
    def total_flops(self) -> int:
        return sum(n.flops for n in self.nodes)

    @property
    def total_bytes(self) -> int:
        return sum(n.bytes_read + n.bytes_written for n in self.nodes)

    @property
    def total_param_bytes(self) -> int:
        return sum(n.param_bytes for n in self.nodes)

    @property
    def total_seconds(self) -> float:
        return sum(n.seconds for n in self.nodes)

    def table(self) -> str:
        """A fixed-width table: one row per node that does work, then the totals."""
        rows = [f"{'node':<28}{'op':<14}{'MFLOP':>10}{'MB read':>10}{'MB written':>11}{'µs':>10}  bound"]
        for n in self.nodes:
            if n.op in ("placeholder", "output", "get_attr"):
                continue
            rows.append(f"{n.name[:27]:<28}{n.op:<14}{n.flops / 1e6:>10.3f}{n.bytes_read / 1e6:>10.3f}"
                        f"{n.bytes_written / 1e6:>11.3f}{n.seconds * 1e6:>10.1f}  {n.bound}")
        rows.append(f"{'total':<42}{self.total_flops / 1e6:>10.3f}{self.total_bytes / 1e6:>21.3f}"
                    f"{self.total_seconds * 1e6:>10.1f}  ({self.profile.name})")
        return "\n".join(rows)


# -- FLOP rules ----------------------------------------------------------------------------------------
def _numel(meta: Any) -> int:
    return sum(math.prod(m.shape) for m in _metas(meta))


def _metas(value: Any) -> list[Any]:
    """Every TensorMetadata inside a (nested) meta value."""
    if value is None:
        return []
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [m for v in value for m in _metas(v)]
    return []


def _shape(node_or_value: Any) -> tuple[int, ...] | None:
    if isinstance(node_or_value, Node):
        metas = _metas(node_or_value.meta.get("tensor_meta"))
        return tuple(metas[0].shape) if metas else None
    return None


def _matmul_flops(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """2*M*N*K times the broadcast batch, for torch.matmul semantics (1-D operands promoted)."""
    a2 = a if len(a) > 1 else (1, a[0])
    b2 = b if len(b) > 1 else (b[0], 1)
    batch = torch.broadcast_shapes(a2[:-2], b2[:-2]) if len(a2) > 2 or len(b2) > 2 else ()
    return 2 * math.prod(batch) * a2[-2] * a2[-1] * b2[-1]


def _conv_flops(out_shape: tuple[int, ...], weight_shape: tuple[int, ...], transposed: bool,
                in_shape: tuple[int, ...]) -> int:
    """2 * N * C_out * (C_in / groups) * prod(kernel) * prod(spatial); spatial of the input if transposed."""
    spatial = in_shape[2:] if transposed else out_shape[2:]
    return 2 * out_shape[0] * math.prod(weight_shape) * math.prod(spatial)


def _module_flops(module: torch.nn.Module, node: Node) -> int | None:
    in_shape, out_meta = _shape(node.args[0]) if node.args else None, node.meta.get("tensor_meta")
    out = _metas(out_meta)
    if not out or in_shape is None:
        return None
    out_shape = tuple(out[0].shape)
    if isinstance(module, torch.nn.Sequential) and len(module) and type(module).__module__.startswith(
            "torch.ao.nn.intrinsic"):
        module = module[0]  # a fused Linear/Conv + ReLU (quant's prepare): the first part does the FLOPs
    if isinstance(module, torch.nn.Linear):
        return 2 * math.prod(in_shape[:-1]) * module.in_features * module.out_features
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        return _conv_flops(out_shape, tuple(module.weight.shape), module.transposed, in_shape)
    if isinstance(module, torch.nn.EmbeddingBag):
        return math.prod(in_shape) * module.embedding_dim
    if isinstance(module, (torch.nn.modules.batchnorm._BatchNorm, torch.nn.LayerNorm, torch.nn.GroupNorm)):
        return 5 * math.prod(out_shape)
    return None


_MATMULS = {torch.matmul, torch.mm, torch.bmm, operator.matmul, "matmul", "mm", "bmm"}
_ELEMENTWISE_FLOPS = {  # FLOPs per output element
    "relu": 1, "relu_": 1, "add": 1, "add_": 1, "sub": 1, "mul": 1, "mul_": 1, "truediv": 1, "div": 1,
    "sigmoid": 4, "tanh": 4, "gelu": 8, "selu": 5, "silu": 5, "softmax": 5, "log_softmax": 5, "exp": 2,
    "pow": 2, "sqrt": 2, "rsqrt": 2, "neg": 1, "clamp": 2, "hardtanh": 2, "dropout": 1, "sum": 1, "mean": 1,
    "layer_norm": 5, "batch_norm": 5, "max_pool2d": 1, "avg_pool2d": 1, "adaptive_avg_pool2d": 1,
}


def _target_name(node: Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", str(target)).split(".")[-1]


def node_flops(node: Node, modules: dict[str, torch.nn.Module]) -> int:
    """FLOPs of one shape-annotated node (0 for placeholders, attributes, views and unknown ops)."""
    if node.op in ("placeholder", "get_attr", "output"):
        return 0
    if node.op == "call_module":
        flops = _module_flops(modules[cast(str, node.target)], node)
        if flops is not None:
            return flops
    name = _target_name(node)
    shapes = [s for s in (_shape(a) for a in node.args[:2]) if s is not None]  # 2: both args' shapes known
    if (node.target in _MATMULS or name in ("matmul", "mm", "bmm")) and len(shapes) == 2:
        return _matmul_flops(shapes[0], shapes[1])
    if name in ("linear",) and len(shapes) == 2:
        return 2 * math.prod(shapes[0][:-1]) * shapes[1][0] * shapes[1][1]
    if name in ("addmm", "baddbmm") and len(node.args) >= 3:
        a, b = _shape(node.args[1]), _shape(node.args[2])
        return _matmul_flops(a, b) if a and b else 0
    if name.startswith("conv") and len(node.args) >= 2 and (w := _shape(node.args[1])) and (x := _shape(node.args[0])):
        out = _metas(node.meta.get("tensor_meta"))
        return _conv_flops(tuple(out[0].shape), w, "transpose" in name, x) if out else 0
    per_element = _ELEMENTWISE_FLOPS.get(name.rstrip("_") if name not in _ELEMENTWISE_FLOPS else name, 0)
    return per_element * _numel(node.meta.get("tensor_meta"))


def _bytes(node: Node) -> int:
    """Bytes of a node's value: from its tensor_meta, else from the tensors inside ``meta["val"]`` (a
    torchrec KeyedTensor or KeyedJaggedTensor flattens to its tensors with torch.utils._pytree)."""
    metas = _metas(node.meta.get("tensor_meta"))
    if metas:
        return sum(math.prod(m.shape) * m.dtype.itemsize for m in metas)
    leaves = tree_leaves(node.meta.get("val"))
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _node_cost(node: Node, modules: dict[str, torch.nn.Module], profile: HardwareProfile) -> NodeCost:
    flops = node_flops(node, modules)
    param_bytes = 0
    if node.op == "call_module":
        module = modules[cast(str, node.target)]
        param_bytes = sum(t.numel() * t.element_size()
                          for t in list(module.parameters()) + list(module.buffers()))
    reads = sum(_bytes(n) for n in node.all_input_nodes) + param_bytes
    writes = _bytes(node) if node.op not in ("output", "placeholder", "get_attr") else 0
    cost = NodeCost(node.name, node.op, _target_name(node), flops, reads if node.op != "output" else 0,
                    writes, param_bytes)
    if node.op in ("call_function", "call_method", "call_module"):
        dtypes = [m.dtype for m in _metas(node.meta.get("tensor_meta"))]
        compute = flops / profile.flops_for(dtypes[0] if dtypes else None)
        memory = (cost.bytes_read + cost.bytes_written) / profile.memory_bandwidth
        cost.bound = "compute" if compute >= memory else "memory"
        cost.seconds = max(compute, memory) + profile.op_overhead_seconds
    return cost


def estimate(gm: GraphModule, *example_inputs: Any, profile: HardwareProfile | str | None = None) -> CostReport:
    """Estimate per-node FLOPs, bytes and runtime of ``gm`` on ``profile``.

    Args:
        gm: the module; its nodes need ``meta["tensor_meta"]``, else ``example_inputs`` are required and
            ShapeProp runs first (under FakeTensorMode: no real compute or allocation; on real inputs
            when a shape depends on data, as with a KeyedJaggedTensor).
        example_inputs: inputs for ShapeProp, only needed when the graph has no shapes.
        profile: a :class:`HardwareProfile`, a key of :data:`PROFILES`, or None for this CPU (measured once).

    Returns:
        A :class:`CostReport`; each node also gets ``node.meta["cost"]`` (its :class:`NodeCost`).

    Raises:
        ValueError: if shapes are missing and no example inputs were given, or the profile name is unknown.
    """
    if isinstance(profile, str):
        if profile not in PROFILES:
            raise ValueError(f"unknown hardware profile {profile!r}; known: {sorted(PROFILES)} or a HardwareProfile")
        profile = PROFILES[profile]
    profile = profile or measure_cpu_profile()
    if _needs_shapes(gm.graph.nodes):
        if not example_inputs:
            raise ValueError("the graph has no node.meta['tensor_meta']; pass example inputs so ShapeProp can run")
        _propagate_shapes(gm, example_inputs)
    modules = dict(gm.named_modules())
    report = CostReport(profile)
    for node in gm.graph.nodes:
        cost = _node_cost(node, modules, profile)
        node.meta["cost"] = cost
        report.nodes.append(cost)
    return report


def _needs_shapes(nodes: Iterable[Node]) -> bool:
    return not any("tensor_meta" in n.meta for n in nodes if n.op != "output")


def _propagate_shapes(gm: GraphModule, example_inputs: tuple[Any, ...]) -> None:
    """ShapeProp under FakeTensorMode; models whose shapes depend on data (a torchrec
    KeyedJaggedTensor's lengths, ``.tolist()``) fall back to propagating the real inputs."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    from fxdist.passes.shape_prop import ShapeProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_inputs = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    try:
        ShapeProp(gm, fake_mode=mode).propagate(*fake_inputs)
    except DataDependentOutputException:
        with torch.no_grad():
            ShapeProp(gm).propagate(*example_inputs)
