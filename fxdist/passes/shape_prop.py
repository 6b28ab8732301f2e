"""Shape propagation: run a GraphModule on example inputs and record each value's tensor metadata.

Source: torch/fx/passes/shape_prop.py (``ShapeProp``, ``TensorMetadata``); torch.fx paper §6.3
(shape analysis by interpretation).
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, NamedTuple, cast

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensor, FakeTensorMode

from fxdist.graph_module import GraphModule, _is_torch_fx
from fxdist.interpreter import Interpreter
from fxdist.node import Node

__all__ = ["ShapeProp", "TensorMetadata", "extract_tensor_metadata"]

_MEMORY_FORMATS = ((torch.contiguous_format, None), (torch.channels_last, 4), (torch.channels_last_3d, 5))
_SCALARS = (int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.Size, torch.memory_format)


class TensorMetadata(NamedTuple):
    """What ShapeProp records about one tensor value.

    Attributes:
        shape: ``torch.Size`` of the tensor.
        dtype: Element type.
        requires_grad: Whether autograd tracks it.
        stride: Strides in elements (``()`` for sparse tensors).
        memory_format: The first of contiguous / channels_last / channels_last_3d the tensor is
            contiguous in, else None.
        is_quantized: Whether it is a quantized tensor.
        qparams: For quantized tensors: ``qscheme``, ``scale``, ``zero_point`` (and ``axis`` per channel).
    """

    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool
    stride: tuple[int, ...]
    memory_format: torch.memory_format | None
    is_quantized: bool
    qparams: dict[str, Any]


def _memory_format(t: torch.Tensor) -> torch.memory_format | None:
    for fmt, ndim in _MEMORY_FORMATS:
        if (ndim is None or t.dim() == ndim) and t.is_contiguous(memory_format=fmt):
            return fmt
    return None


def _qparams(t: torch.Tensor) -> dict[str, Any]:
    qscheme = t.qscheme()
    if qscheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return {"qscheme": qscheme, "scale": t.q_scale(), "zero_point": t.q_zero_point()}
    return {
        "qscheme": qscheme,
        "scale": t.q_per_channel_scales().tolist(),
        "zero_point": t.q_per_channel_zero_points().tolist(),
        "axis": t.q_per_channel_axis(),
    }


def extract_tensor_metadata(t: torch.Tensor) -> TensorMetadata:
    """Return the ``TensorMetadata`` of ``t`` (works on real, meta and fake tensors)."""
    strided = t.layout == torch.strided
    return TensorMetadata(
        shape=t.shape,
        dtype=t.dtype,
        requires_grad=t.requires_grad,
        stride=t.stride() if strided else (),
        memory_format=_memory_format(t) if strided else None,
        is_quantized=t.is_quantized,
        qparams=_qparams(t) if t.is_quantized else {},
    )


def _as_meta(t: torch.Tensor) -> torch.Tensor | None:
    """A ``meta``-device tensor with ``t``'s shape, strides and dtype (no storage), or None."""
    if t.layout != torch.strided or t.is_quantized:
        return None
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta", requires_grad=t.requires_grad)


def _is_fake_of(mode: FakeTensorMode, module: torch.nn.Module) -> bool:
    tensors = itertools.chain(module.parameters(), module.buffers())
    return all(isinstance(t, FakeTensor) and t.fake_mode is mode for t in tensors)


def _is_leaf(x: Any) -> bool:
    """Descend only into built-in containers (tuple, namedtuple, list, dict), as torch.fx's ShapeProp
    does: a registered pytree class such as torchrec's ``KeyedJaggedTensor`` stays one opaque value."""
    return not isinstance(x, (tuple, list, dict))


class ShapeProp(Interpreter):
    """Runs a GraphModule node by node and records, on every node whose value holds tensors:

    * ``node.meta["tensor_meta"]``: a ``TensorMetadata``, or the same nested structure of tuples,
      namedtuples, lists and dicts (rebuilt with ``torch.utils._pytree``) with a ``TensorMetadata``
      per tensor and other leaves as they are; other objects (e.g. torchrec's ``KeyedTensor``) are
      opaque, as in torch.fx;
    * ``node.meta["val"]``: the value with every tensor replaced by a storage-less stand-in (the
      ``FakeTensor`` itself under a fake mode, else a ``meta``-device tensor of the same shape,
      strides and dtype), for nodes whose value is made of tensors and plain scalars;
    * ``node.meta["type"]``: the Python type of the value (every node);
    * under a fake mode with a ``ShapeEnv``: ``node.meta["unbacked_bindings"]``, with the fresh
      unbacked symbols first bound to the ones the graph recorded (``torch.export`` graphs with
      ``nonzero``/``item`` and their ``_assert_scalar`` guards), as torch.fx's ShapeProp does.

    A torch.fx GraphModule (``make_fx``, ``torch.export``'s ``graph_module``, ``symbolic_trace``) is
    accepted as is: its graph is converted (``fxdist.interop.as_fxdist``) to nodes sharing its nodes'
    ``meta`` dicts, so the metadata lands on the caller's torch.fx graph as with torch.fx;
    ``meta["val"]`` is then left alone, as torch.fx's ShapeProp leaves it (torch.export keeps
    symbolic values there).

    Example:

    >>> import torch, fxdist as fx
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()))
    >>> _ = ShapeProp(gm).propagate(torch.randn(2, 8))
    >>> [(n.name, tuple(n.meta["tensor_meta"].shape)) for n in gm.graph.nodes]
    [('input_1', (2, 8)), ('_0', (2, 4)), ('_1', (2, 4)), ('output', (2, 4))]

    Fake mode: with a ``FakeTensorMode`` (given, or active when ShapeProp is built) inputs are
    converted to fake tensors and the module runs on a fake copy of itself (or on itself, when its
    parameters and buffers are already fake tensors of that mode), so no real storage is allocated
    and the weights never need to exist. A module on the ``meta`` device with ``meta`` inputs needs
    no fake mode.

    Shapes: whatever the model's shapes are; nothing is assumed.

    Args:
        gm: The module to run.
        fake_mode: An optional ``torch._subclasses.fake_tensor.FakeTensorMode``.

    Raises:
        Whatever a node raises, with the Interpreter's note naming the node.

    Source: torch/fx/passes/shape_prop.py; torch.fx paper §6.3.
    """

    def __init__(self, gm: GraphModule, fake_mode: FakeTensorMode | None = None) -> None:
        # The Interpreter converts a torch.fx graph; our nodes share the meta dicts of its nodes, and
        # we leave meta["val"] to torch's producers (torch.export records symbolic FakeTensors there).
        self._record_val = not _is_torch_fx(gm)
        super().__init__(gm)
        if fake_mode is None:
            from torch._guards import detect_fake_mode

            fake_mode = detect_fake_mode()
        self.fake_mode = fake_mode
        self.real_module = self.module
        self.fake_module = None
        if fake_mode is not None:
            if _is_fake_of(fake_mode, gm):
                self.fake_module = gm
            else:
                with FakeCopyMode(fake_mode):
                    self.fake_module = copy.deepcopy(gm)

    def run_node(self, n: Node) -> Any:
        if self.fake_mode is None:
            result = super().run_node(n)
        else:
            from fxdist.interop import run_with_unbacked_bindings

            self.module = cast(GraphModule, self.fake_module)  # set with fake_mode
            try:
                run = super().run_node
                with self.fake_mode:
                    result = run_with_unbacked_bindings(self.fake_mode.shape_env, n, lambda: run(n))
            finally:
                self.module = self.real_module
        self._record(n, result)
        return result

    def fetch_attr(self, target: str) -> Any:
        value = super().fetch_attr(target)
        if self.fake_mode is not None and isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            value = self.fake_mode.from_tensor(value)  # a plain tensor attribute the fake copy kept real
        return value

    def _record(self, n: Node, result: Any) -> None:
        leaves, spec = pytree.tree_flatten(result, is_leaf=_is_leaf)
        n.meta["type"] = type(result)
        if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
            if self._record_val and all(isinstance(leaf, _SCALARS) for leaf in leaves):
                n.meta["val"] = result
            return
        metas = [extract_tensor_metadata(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        n.meta["tensor_meta"] = pytree.tree_unflatten(metas, spec)
        if self._record_val and all(isinstance(x, (torch.Tensor, *_SCALARS)) for x in leaves):
            vals = [self._stand_in(x) if isinstance(x, torch.Tensor) else x for x in leaves]
            if not any(v is None for v, x in zip(vals, leaves) if isinstance(x, torch.Tensor)):
                n.meta["val"] = pytree.tree_unflatten(vals, spec)

    def _stand_in(self, t: torch.Tensor) -> torch.Tensor | None:
        if isinstance(t, FakeTensor) or t.device.type == "meta":
            return t
        return _as_meta(t)

    def propagate(self, *args: Any) -> Any:
        """Run the module on ``args`` and record metadata. Under a fake mode, tensors in ``args`` (also
        inside tuples, lists and dicts) are converted to fake tensors first.

        Returns:
            The module's output (fake tensors under a fake mode).
        """
        if self.fake_mode is not None:
            mode = self.fake_mode

            def fake(a: Any) -> Any:
                return mode.from_tensor(a) if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) else a

            args = pytree.tree_map(fake, args, is_leaf=_is_leaf)
        return self.run(*args)
