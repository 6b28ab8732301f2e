"""``prepare``: insert torch.ao observers into an fxdist graph for post-training quantization.

Steps:
 1. Copy the module (the caller's is never touched); check it is in eval mode.
 2. Record which values are float tensors by running ``example_inputs`` through an ``fxdist.Interpreter``.
 3. Fuse: fold BatchNorm (:class:`~quant.fuse_conv_bn.FuseConvBn`), then Conv/Linear/add + ReLU
    (:class:`~quant.fuse_patterns.FuseReluPatterns`), so FBGEMM's fused kernels are used and the
    observers see the fused outputs.
 4. Classify each node (:func:`quant.rules.classify`) and find its qconfig (module name, then object type,
    then global; ``None`` or an exclusion keeps it in float). Stored in ``node.meta["quant"]``.
 5. Insert observers (``activation_post_process_<k>`` submodules, ``call_module`` nodes): one after each
    *compute* op (all users read through it), and one on each float input of a compute op. A value read by
    several quantized ops gets one observer (shared inputs); *same-scale* ops inherit their input's observer;
    *float* ops get none.

Printed result for ``relu(linear(x))`` (``x`` observed once, the fused ``LinearReLU`` observed on output)::

    %x : placeholder[target=x]
    %activation_post_process_0 : call_module[target=activation_post_process_0](args = (%x,))
    %linear : call_module[target=linear](args = (%activation_post_process_0,))   # nni.LinearReLU
    %activation_post_process_1 : call_module[target=activation_post_process_1](args = (%linear,))
    return activation_post_process_1

Source: torch.fx paper §6.2.1; torch/ao/quantization/fx/prepare.py (observer placement rules).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.ao.nn.intrinsic as nni
from torch import nn
from torch.ao.quantization import QConfigMapping, get_default_qconfig_mapping

import fxdist as fx
from fxdist.passes.pass_base import PassManager
from quant.errors import QuantizationError
from quant.fuse_conv_bn import FuseConvBn
from quant.fuse_patterns import FuseReluPatterns
from quant.rules import _tensor_inputs, classify

__all__ = ["prepare", "record_float_tensors", "resolve_qconfig"]


def record_float_tensors(gm: Any, example_inputs: Sequence[Any]) -> None:
    """Run ``gm`` once and set ``node.meta["quant_float_tensor"]`` (float, non-quantized tensor output)."""
    from fxdist.interpreter import Interpreter

    class _Recorder(Interpreter):
        def run_node(self, n: Any) -> Any:
            value = super().run_node(n)
            n.meta["quant_float_tensor"] = (
                isinstance(value, torch.Tensor) and value.is_floating_point() and not value.is_quantized
            )
            return value

    with torch.no_grad():
        _Recorder(gm).run(*example_inputs)


def resolve_qconfig(
    node: Any, mapping: QConfigMapping, modules: dict[str, nn.Module], exclude_names: Iterable[str] = (),
    exclude_types: Iterable[Any] = (),
) -> Any:
    """The qconfig of ``node``: module name (longest prefix), regex, object type, then global; None = float.

    ``exclude_names`` holds module names (a ``call_module`` node whose target is one of them or below one) and
    node names (a ``call_function``/``call_method`` node of that name, e.g. ``"cat_1"``).
    """
    if node.op == "call_module":
        mod = modules.get(node.target)
        target, mod_type = str(node.target), type(mod)
        if any(target == n or target.startswith(n + ".") for n in exclude_names):
            return None
        # a fused intrinsic module (nni.LinearReLU...) is excluded when any of its parts' types is
        parts = [mod_type, *(type(c) for c in mod.children())] if isinstance(mod, nni._FusedModule) else [mod_type]
        if any(isinstance(t, type) and issubclass(p, t) for p in parts for t in exclude_types):
            return None
        for name in sorted(mapping.module_name_qconfigs, key=len, reverse=True):
            if target == name or target.startswith(name + "."):
                return mapping.module_name_qconfigs[name]
        for pattern, qconfig in mapping.module_name_regex_qconfigs.items():
            if re.fullmatch(pattern, target):
                return qconfig
        key = mod_type
    else:
        key = node.target
        if node.name in exclude_names:  # a function/method call is excluded by its node name
            return None
        if any(key is t or key == t for t in exclude_types):
            return None
    if key in mapping.object_type_qconfigs:
        return mapping.object_type_qconfigs[key]
    return mapping.global_qconfig


def _check_eval(gm: nn.Module) -> None:
    """Modules the program calls (and their children) must be in eval mode; bare containers do not matter."""
    if isinstance(gm, fx.GraphModule):
        called = {n.target for n in gm.graph.nodes if n.op == "call_module"}
        mods = [(f"{t}.{c}".rstrip("."), m) for t in called for c, m in gm.get_submodule(t).named_modules()]
    else:
        mods = list(gm.named_modules())
    training = [name or "<root>" for name, m in mods if m.training]
    if training:
        raise QuantizationError(
            f"prepare: post-training quantization needs an eval-mode model, but {len(training)} module(s) are "
            f"in training mode (first: {training[:3]}); call model.eval() first"
        )


class _Inserter:
    """Step 5: observer insertion with one observer per value."""

    def __init__(self, gm: Any) -> None:
        self.gm, self.graph, self.count = gm, gm.graph, 0
        self.carrier: dict[Any, Any] = {}  # graph value -> observer node carrying its qparams
        self.input_observer: dict[Any, Any] = {}  # float value -> observer inserted for quantized readers

    def _observer(self, after: Any, qconfig: Any) -> Any:
        name = f"activation_post_process_{self.count}"
        self.count += 1
        setattr(self.gm, name, qconfig.activation())
        with self.graph.inserting_after(after):
            obs = self.graph.call_module(name, (after,))
        obs.meta["quant"] = {"kind": "observer", "qconfig": qconfig}
        obs.meta["quant_float_tensor"] = True
        self.carrier[obs] = obs
        return obs

    def compute(self, node: Any, qconfig: Any) -> None:
        for value in dict.fromkeys(_tensor_inputs(node)):
            if value in self.carrier:
                continue
            obs = self.input_observer.get(value)
            if obs is None:
                obs = self.input_observer[value] = self._observer(value, qconfig)
            node.replace_input_with(value, obs)
        users = list(node.users)
        obs = self._observer(node, qconfig)
        for user in users:
            user.replace_input_with(node, obs)
        if node.target is torch.cat:
            self._share_with_inputs(node, obs)

    def _share_with_inputs(self, cat: Any, out_obs: Any) -> None:
        """``cat`` with a shared scale: inputs read only by the cat use the output's observer instance, so
        their producers emit int8 at the cat's scale and the cat just copies bytes (no requantization)."""
        for arg in cat.args[0]:
            if arg.op == "call_module" and arg.meta.get("quant", {}).get("kind") == "observer" and len(arg.users) == 1:
                arg.target = out_obs.target

    def same_scale(self, node: Any) -> bool:
        source = _tensor_inputs(node)[0]
        if source not in self.carrier:
            return False
        self.carrier[node] = self.carrier[source]
        return True


def prepare(
    model: nn.Module,
    qconfig_mapping: QConfigMapping | None = None,
    example_inputs: Sequence[Any] = (),
    *,
    exclude_names: Iterable[str] = (),
    exclude_types: Iterable[Any] = (),
    backend: str = "x86",
) -> Any:
    """Return an observed copy of ``model`` ready for :func:`quant.calibrate`.

    Args:
        model: an fxdist ``GraphModule`` (a plain ``nn.Module`` is traced with ``fxdist.symbolic_trace``),
            in eval mode.
        qconfig_mapping: torch.ao ``QConfigMapping``; default ``get_default_qconfig_mapping(backend)``
            (HistogramObserver on activations, per-channel MinMax weights, reduce_range on x86/fbgemm).
        example_inputs: positional inputs, used to tell float tensors from other values.
        exclude_names: module names (and their children) kept in float; also node names of function and
            method calls (``"cat_1"``, ``"add_relu"``: node names of the prepared graph, which preparing the same model
            again reproduces).
            :class:`~quant.select.SelectInt8` uses both.
        exclude_types: module types, functions or method names kept in float.
        backend: ``"x86"`` or ``"fbgemm"`` (the default mapping's backend).

    Returns:
        The observed GraphModule; ``node.meta["quant"]`` holds each node's ``kind`` and ``qconfig``.

    Raises:
        QuantizationError: the model is in training mode, or ``example_inputs`` is empty.
        FusionError: never for BatchNorm folding (pairs that cannot be folded are skipped with a warning).
    """
    if not example_inputs:
        raise QuantizationError("prepare: example_inputs is empty; pass a tuple of positional inputs, e.g. (x,)")
    _check_eval(model)
    gm = model if isinstance(model, fx.GraphModule) else fx.symbolic_trace(model)
    gm = copy.deepcopy(gm)
    mapping = qconfig_mapping if qconfig_mapping is not None else get_default_qconfig_mapping(backend)
    record_float_tensors(gm, example_inputs)
    gm = PassManager([FuseConvBn(strict=False), FuseReluPatterns()]).run(gm).graph_module
    modules = dict(gm.named_modules())
    inserter = _Inserter(gm)
    exclude_names, exclude_types = tuple(exclude_names), tuple(exclude_types)
    for node in list(gm.graph.nodes):
        kind = classify(node, modules)
        qconfig = resolve_qconfig(node, mapping, modules, exclude_names, exclude_types) if kind != "float" else None
        if qconfig is None or (kind == "weight_only" and not _is_weight_only(qconfig)):
            kind = "float"
        if kind == "compute":
            inserter.compute(node, qconfig)
        elif kind == "same_scale" and not inserter.same_scale(node):
            kind = "float"
        node.meta["quant"] = {"kind": kind, "qconfig": qconfig}
    gm.graph.lint()
    gm.recompile()
    return gm


def _is_weight_only(qconfig: Any) -> bool:
    """A qconfig for 8-bit row-wise embedding weights (``float_qparams_weight_only_qconfig``)."""
    try:
        return qconfig.weight().qscheme == torch.per_channel_affine_float_qparams
    except Exception as e:  # a qconfig whose weight factory fails is a user error
        raise QuantizationError(f"qconfig {qconfig} has no usable weight observer: {e}") from e
