"""Unpickling the ``socket`` transport's messages without running code from the wire.

``pickle.loads`` calls whatever global a message names: a request naming ``os.system`` runs a command. Every
message of the socket transport (:mod:`scheduling.ps.transport.socket_wire`, both ends) is decoded by
:class:`SafeUnpickler` instead, whose ``find_class`` returns only what is on an explicit list, and refuses
anything else with an ``UnpicklingError`` naming the module and the name (nothing is imported to look it up):

- the wire's own tensor rebuild (``socket_wire._rebuild``, checked: its buffer must be a received uint8 tensor);
- what torch's own pickling of the rare in-band tensors names: ``torch.Size``, ``torch.device``, every
  ``torch.<dtype>``, ``torch.serialization._get_layout``, ``torch._utils._rebuild_parameter`` (its hooks dropped)
  and ``torch._utils._rebuild_sparse_tensor`` (rebuilt with its invariants checked); never a storage
  (``torch.storage._load_from_bytes`` would run ``torch.load`` on bytes from the wire);
- ``collections.OrderedDict`` and the builtin containers without opcodes of their own (``set``, ``frozenset``,
  ``slice``, ``range``, ``complex``);
- exception classes (an answer may carry the server's exception): the builtin ones, and those of modules
  already imported under ``torch``, ``scheduling``, ``fxdist`` and ``recsys``;
- the project's request types: ``scheduling.ps.shard_plan.TableSpec`` / ``ShardSpec`` and
  ``scheduling.ps.dynamic.DynamicSpec`` (a ``configure`` request). Batches, orders and answers are tuples,
  dicts, strings, numbers and tensors.

The received buffers are tensors over memory torch cannot resize (``torch.from_numpy``), so a message that
rebuilds a tensor and then applies torch's legacy ``Tensor.__setstate__`` to it (``set_`` with any size) cannot
make the server allocate beyond its frame limits.

The check costs only on globals (a dict lookup each; pickle's memo sends each global once per message): the
per-request path is the C unpickler's.

Source: Python ``pickle`` ("Restricting Globals": ``Unpickler.find_class``); PEP 574 (out-of-band buffers);
torch ``_utils._rebuild_sparse_tensor`` / ``_rebuild_parameter``, ``torch.sparse.check_sparse_tensor_invariants``.
"""

from __future__ import annotations

import builtins
import collections
import io
import pickle
import sys
from typing import Any

import torch

__all__ = ["SafeUnpickler", "loads", "allow", "checked_rebuild"]

_EXCEPTION_MODULES = ("torch", "scheduling", "fxdist", "recsys")
"""Top-level packages whose (already imported) exception classes may cross the wire."""


def checked_rebuild(buffer: Any, dtype: Any, shape: Any) -> torch.Tensor:
    """``socket_wire._rebuild`` with its arguments checked (what a message naming it gets: the wire registers it,
    :func:`allow`): a 1-D uint8 tensor (a received buffer), a dtype, a tuple.

    Raises:
        pickle.UnpicklingError: another buffer, dtype or shape.
    """
    if type(buffer) is not torch.Tensor or buffer.dtype is not torch.uint8 or buffer.dim() != 1:
        raise pickle.UnpicklingError(f"refused tensor rebuild: its buffer is a {type(buffer).__name__}, not a "
                                     "received byte buffer")
    if not isinstance(dtype, torch.dtype) or not isinstance(shape, tuple):
        raise pickle.UnpicklingError("refused tensor rebuild: bad dtype or shape")
    return buffer.view(dtype).view(shape)


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any = None) -> torch.nn.Parameter:
    """``torch._utils._rebuild_parameter`` without the hooks (torch never serializes any)."""
    if not isinstance(data, torch.Tensor):
        raise pickle.UnpicklingError(f"refused parameter rebuild over a {type(data).__name__}")
    return torch.nn.Parameter(data, bool(requires_grad))


def _rebuild_sparse(layout: Any, data: Any) -> torch.Tensor:
    """``torch._utils._rebuild_sparse_tensor`` with the invariants checked at once (torch defers the check to
    ``torch.load``'s end, which never comes here): indices outside the size are refused."""
    if layout is torch.sparse_coo and isinstance(data, tuple) and len(data) in (3, 4):
        indices, values, size = data[:3]
        coalesced = data[3] if len(data) == 4 else None
        return torch.sparse_coo_tensor(indices, values, size, check_invariants=True, is_coalesced=coalesced)
    if layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc) and isinstance(
            data, tuple) and len(data) == 4:
        compressed, plain, values, size = data
        return torch.sparse_compressed_tensor(compressed, plain, values, size, layout=layout, check_invariants=True)
    raise pickle.UnpicklingError(f"refused sparse tensor rebuild of layout {layout!r}")


def _layout(name: Any) -> Any:
    """``torch.serialization._get_layout``: a layout by its name, only a real one."""
    layout = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(layout, torch.layout):
        raise pickle.UnpicklingError(f"refused layout {name!r}")
    return layout


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_sparse_tensor"): _rebuild_sparse,
    ("torch.serialization", "_get_layout"): _layout,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("collections", "OrderedDict"): collections.OrderedDict,
    **{("builtins", n): getattr(builtins, n) for n in ("set", "frozenset", "slice", "range", "complex")},
}
"""``(module, name)`` -> the object ``find_class`` returns: the real one, or a checked stand-in."""
_PROJECT_TYPES = (("scheduling.ps.shard_plan", "TableSpec"), ("scheduling.ps.shard_plan", "ShardSpec"),
                  ("scheduling.ps.dynamic", "DynamicSpec"))
"""The project's own request types, looked up in their (imported) modules when first named."""


def allow(module: str, name: str, obj: Any) -> None:
    """Let messages name ``module.name``, decoded as ``obj`` (for a type of your own that requests carry: a
    plain data class whose construction runs no code of the sender's choosing)."""
    _ALLOWED[(module, name)] = obj


def _lookup(module: str, name: str) -> Any:
    """What ``module.name`` may decode as, or None: a torch dtype, an exception class, a project request type.
    Only modules already imported are looked in."""
    if "." in name:
        return None
    if module == "torch":
        found = getattr(torch, name, None)
        if isinstance(found, torch.dtype):
            return found
    if (module, name) in _PROJECT_TYPES:
        __import__(module)   # the project's own module, named in the list above
        return getattr(sys.modules[module], name, None)
    if module == "builtins" or module.partition(".")[0] in _EXCEPTION_MODULES:
        owner = builtins if module == "builtins" else sys.modules.get(module)
        found = getattr(owner, name, None) if owner is not None else None
        if isinstance(found, type) and issubclass(found, BaseException):
            return found
    return None


class SafeUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` that resolves only the globals :mod:`this module <scheduling.ps.transport.safe_pickle>`
    allows (see there); any other raises ``pickle.UnpicklingError("refused global <module>.<name> ...")``."""

    def find_class(self, module: str, name: str) -> Any:
        """The allowed object ``module.name`` stands for.

        Raises:
            pickle.UnpicklingError: ``module.name`` is not allowed.
        """
        found = _ALLOWED.get((module, name))
        if found is None:
            found = _lookup(module, name)
            if found is None:
                raise pickle.UnpicklingError(f"refused global {module}.{name}: not one the socket transport's "
                                             "messages carry (scheduling.ps.transport.safe_pickle)")
            _ALLOWED[(module, name)] = found
        return found


def loads(data: Any, buffers: Any = ()) -> Any:
    """Unpickle ``data`` (bytes-like) with :class:`SafeUnpickler`; ``buffers``: its out-of-band buffers (PEP 574).

    Raises:
        pickle.UnpicklingError: a refused global, or a broken message (also other exceptions of a corrupt one).
    """
    return SafeUnpickler(io.BytesIO(data), buffers=buffers).load()
