"""Unique, valid Python identifiers for nodes and generated-code globals.

Source: torch/fx/graph.py ``_Namespace``. A name handed out here is always a valid identifier that is
not a Python keyword and does not shadow a builtin or one of the globals the code generator emits itself
(``torch``, ``inf``, ...), unless the object being named *is* that builtin. The numbering follows
torch.fx exactly (``add``, ``add_1``, ``add_2``; a requested ``add_5`` is kept if free and later ``add``
requests continue from 6), so node names agree with torch.fx's for the same sequence of requests.
"""

from __future__ import annotations

import builtins
import keyword
import math
import re
from typing import Any

import torch
import torch.utils._pytree as _pytree

__all__ = ["Namespace", "RESERVED_NAMES", "sanitize"]

_NO_OWNER = object()  # owner of reserved names that no object may claim (keywords, self, ...)

# name -> the object it denotes in generated code; a node may never take one of these names,
# but a global for exactly that object may.
_RESERVED: dict[str, Any] = {k: _NO_OWNER for k in keyword.kwlist}
_RESERVED.update(builtins.__dict__)
_RESERVED.update({
    "inf": math.inf,
    "nan": math.nan,
    "NoneType": type(None),
    "torch": torch,
    "device": torch.device,
    "pytree": _pytree,
    "fx_pytree": _NO_OWNER,
    "self": _NO_OWNER,  # the generated forward's first parameter
    "operator": _NO_OWNER,
})

RESERVED_NAMES: frozenset[str] = frozenset(_RESERVED)

_ILLEGAL_CHAR = re.compile(r"[^0-9a-zA-Z_]+")
# a valid identifier, split into base and optional numeric suffix (non-greedy base)
_NAME = re.compile(r"^([a-zA-Z_][0-9a-zA-Z_]*?)(?:_(\d+))?$")


def sanitize(candidate: str) -> str:
    """Turn any string into a valid identifier: illegal characters become ``_``, a leading digit
    gets a ``_`` prefix, and an empty result becomes ``_unnamed``.

    >>> sanitize("layer1.0.conv")
    'layer1_0_conv'
    >>> sanitize("0abc")
    '_0abc'
    """
    name = _ILLEGAL_CHAR.sub("_", candidate)
    if not name:
        return "_unnamed"
    if name[0].isdigit():
        name = f"_{name}"
    return name


class Namespace:
    """Hands out unique identifiers, remembering which object owns which name.

    ``create_name("add", obj)`` returns ``add``, then ``add_1``, ``add_2``... for other objects;
    asking again for the same object returns its existing name. Objects are keyed by identity, so
    unhashable objects can be named too.

    >>> ns = Namespace()
    >>> [ns.create_name(c, None) for c in ["add", "add", "add_5", "add", "input", "layer1.0"]]
    ['add', 'add_1', 'add_5', 'add_6', 'input_1', 'layer1_0']
    """

    def __init__(self) -> None:
        self._obj_to_name: dict[int, tuple[Any, str]] = {}
        self._used_names: set[str] = set()
        self._base_count: dict[str, int] = {}

    def create_name(self, candidate: str, obj: Any | None) -> str:
        """Return a fresh identifier derived from ``candidate`` and associate it with ``obj``.

        Args:
            candidate: any string (a target, an attribute path, a user-chosen name).
            obj: the owner of the name, or None for a name nobody owns.
        """
        if obj is not None and id(obj) in self._obj_to_name:
            return self._obj_to_name[id(obj)][1]
        match = _NAME.match(candidate)
        if match is None:
            candidate = sanitize(candidate)
            match = _NAME.match(candidate)
            assert match is not None, candidate
        base, num_str = match.group(1, 2)
        if num_str is None or candidate in self._used_names:
            num = self._base_count.get(base, 0)
            owner = _RESERVED.get(candidate, obj)
            if owner is not obj:
                num += 1
                candidate = f"{base}_{num}"
        else:
            num = int(num_str)
        while candidate in self._used_names:
            num += 1
            candidate = f"{base}_{num}"
        self._used_names.add(candidate)
        self._base_count[base] = num
        if obj is not None:
            self._obj_to_name[id(obj)] = (obj, candidate)
        return candidate

    def associate_name_with_obj(self, name: str, obj: Any) -> None:
        """Record that ``obj`` owns the already-created ``name``.

        Raises:
            RuntimeError: ``obj`` already owns a different name.
        """
        previous = self._obj_to_name.get(id(obj))
        if previous is not None and previous[1] != name:
            raise RuntimeError(f"object already named {previous[1]!r}, cannot also be {name!r}")
        self._obj_to_name[id(obj)] = (obj, name)

    def rename_object(self, obj: Any, name: str) -> None:
        """Give ``obj`` the name ``name`` (which must be free), releasing its old name.

        Raises:
            RuntimeError: ``name`` is taken or reserved.
        """
        if name in self._used_names or name in RESERVED_NAMES:
            raise RuntimeError(f"name {name!r} is already taken or reserved")
        old = self._obj_to_name.get(id(obj))
        if old is not None:
            self._used_names.discard(old[1])
        self._used_names.add(name)
        self._obj_to_name[id(obj)] = (obj, name)

    def _rename_object(self, obj: Any, name: str) -> None:
        """Point ``obj`` at ``name``, a name just made by ``create_name`` (torch.fx semantics: the old
        name stays used, so it is never handed out again)."""
        self._used_names.add(name)
        self._obj_to_name[id(obj)] = (obj, name)

    def release(self, name: str, obj: Any | None = None) -> None:
        """Forget ``name`` so it may be handed out again (torch.fx never does this on erase)."""
        self._used_names.discard(name)
        if obj is not None:
            self._obj_to_name.pop(id(obj), None)

    def __contains__(self, name: str) -> bool:
        return name in self._used_names
