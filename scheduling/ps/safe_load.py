"""Reading checkpoints without running their code: every ``torch.load`` of scheduling/ and jobs/ goes through
:func:`safe_load`.

A ``.pt`` file is a pickle, and ``torch.load(weights_only=False)`` runs whatever the pickle names (PyTorch
SECURITY.md: "Untrusted models ... ``torch.load`` ... can execute arbitrary code"). A checkpoint path can come from
outside the job (``fxdist launch --resume DIR``, a server's ``checkpoint=`` file, a shared run folder), so the
project reads them with ``weights_only=True``: tensors, plain containers and numbers, and the types named in
:data:`SAFE_GLOBALS`, registered once with ``torch.serialization.add_safe_globals``. Those are exactly what the
checkpoints the project writes hold (found by loading them: a server's ``PSServer.save`` file holds its shards'
:class:`~scheduling.ps.shard_plan.ShardSpec` with their :class:`~scheduling.ps.shard_plan.TableSpec` and, for a
dynamic table, its :class:`~scheduling.ps.dynamic.DynamicSpec`; a job's Ray Train ``state.pt`` holds tensors,
optimizer state dicts and numbers only). A file that needs anything else is refused with
:class:`CheckpointRefused`, which names the file and the type; nothing of it was loaded.

Source: PyTorch SECURITY.md ("Untrusted models"); ``torch.load`` and ``torch.serialization.add_safe_globals``
documentation ("weights_only" unpickler, "Safe globals").
"""

from __future__ import annotations

import os
import pickle
import pickletools
import re
from typing import Any

import torch

__all__ = ["CheckpointRefused", "SAFE_GLOBALS", "safe_globals", "safe_load"]

SAFE_GLOBALS = ("scheduling.ps.shard_plan.ShardSpec", "scheduling.ps.shard_plan.TableSpec",
                "scheduling.ps.dynamic.DynamicSpec")
"""The project's own types a checkpoint may hold (plain frozen dataclasses of ints, strings and tuples), by their
pickled names; registered with ``torch.serialization.add_safe_globals`` on the first :func:`safe_load`."""
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_registered: list[bool] = []


class CheckpointRefused(pickle.UnpicklingError):
    """A checkpoint needs a type that ``torch.load(weights_only=True)`` may not build (see the module docstring);
    the file was not loaded. ``path``: the file; ``types``: the names it needs that are not allowed.

    See docs/troubleshooting.md#checkpointrefused.
    """

    def __init__(self, path: str, types: list[str], detail: str) -> None:
        self.path, self.types = path, types
        what = ", ".join(types) if types else "an object torch's weights-only unpickler refuses"
        super().__init__(
            f"{path}: checkpoint not loaded: it holds {what}, which is not a tensor, a plain container or one of the "
            f"project's checkpoint types ({', '.join(SAFE_GLOBALS)}). fxdist reads checkpoints with "
            "torch.load(weights_only=True) because unpickling anything else can run code (PyTorch SECURITY.md). "
            f"torch: {_reason(detail)}")


def safe_globals() -> list[Any]:
    """The classes of :data:`SAFE_GLOBALS`, imported."""
    from .dynamic import DynamicSpec
    from .shard_plan import ShardSpec, TableSpec

    return [ShardSpec, TableSpec, DynamicSpec]


def safe_load(path: str | os.PathLike[str], *, map_location: Any = None, mmap: bool = False) -> Any:
    """``torch.load(path, map_location=..., mmap=..., weights_only=True)`` with the project's types allowed.

    Raises:
        CheckpointRefused: the file needs a type outside the weights-only allowlist (named in the message; the
            file was not loaded, none of its code ran).
        FileNotFoundError: no file at ``path``.
    """
    if not _registered:
        torch.serialization.add_safe_globals(safe_globals())
        _registered.append(True)
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointRefused(os.fspath(path), _refused_types(path, str(e)), str(e).strip()) from None


def _refused_types(path: str | os.PathLike[str], message: str) -> list[str]:
    """The global names torch's message gives, else those the file's pickle names outside the allowlist (read
    with ``torch.serialization.get_unsafe_globals_in_checkpoint``, which parses the pickle and runs nothing)."""
    found = _GLOBAL.findall(message)
    if not found:
        try:
            found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # noqa: BLE001 - not torch's zip format (a bare pickle): scan its opcodes
            found = _pickle_globals(path)
    return [n for n in dict.fromkeys(found) if n not in SAFE_GLOBALS]


def _pickle_globals(path: str | os.PathLike[str]) -> list[str]:
    """The ``module.name`` globals a bare pickle file names (``GLOBAL``, and ``STACK_GLOBAL`` after its two strings),
    read with :mod:`pickletools` (nothing is built or run); [] when the file is no pickle."""
    names: list[str] = []
    strings: list[str] = []
    try:
        with open(path, "rb") as f:
            for op, arg, _ in pickletools.genops(f):
                if op.name == "GLOBAL":
                    names.append(str(arg).replace(" ", "."))
                elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                    names.append(f"{strings[-2]}.{strings[-1]}")
                elif isinstance(arg, str) and "UNICODE" in op.name:
                    strings.append(arg)
    except Exception:  # noqa: BLE001 - a damaged file: what was read so far
        pass
    return names


def _reason(message: str) -> str:
    """Torch's line that says what a weights-only load refused (``Unsupported global: GLOBAL x.Y ...``), without its
    boilerplate and its advice to allowlist the type."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    line = next((x for x in lines if "GLOBAL" in x or "Unsupported" in x), lines[-1] if lines else "")
    return line.partition("WeightsUnpickler error: ")[2 if "WeightsUnpickler error: " in line else 0].split(
        " Please use")[0]
