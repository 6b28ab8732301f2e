"""Unique, valid Python identifiers for nodes and generated-code globals.

Source: torch/fx/graph.py ``_Namespace``. A name handed out here is always a valid identifier that is
not a Python keyword, not a builtin and not one of the globals the code generator emits itself
(``torch``, ``inf``, ...), so no node name can shadow or inject into generated code.
"""

from __future__ import annotations

import builtins
import keyword
import re
from typing import Any

__all__ = ["Namespace", "RESERVED_NAMES", "sanitize"]

# Names generated code relies on; a node may never take one of them.
RESERVED_NAMES: frozenset[str] = frozenset(
    set(keyword.kwlist)
    | set(keyword.softkwlist)
    | set(dir(builtins))
    | {"inf", "nan", "NoneType", "torch", "device", "fx_pytree", "pytree", "self", "operator"}
)

_ILLEGAL_CHAR = re.compile(r"[^0-9a-zA-Z_]+")
_NUMBERED = re.compile(r"(.*)_(\d+)$")


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
    asking again for the same object returns its existing name.
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
        candidate = sanitize(candidate)
        match = _NUMBERED.match(candidate)
        if match is None:
            base, num = candidate, None
        else:
            base, num = match.group(1), int(match.group(2))
        if candidate in self._used_names or candidate in RESERVED_NAMES:
            num = self._base_count.get(candidate, 0) if num is None else num
            while True:
                num += 1
                candidate = f"{base}_{num}"
                if candidate not in self._used_names and candidate not in RESERVED_NAMES:
                    break
            self._base_count[base if match is None else base] = num
        self._used_names.add(candidate)
        if obj is not None:
            self._obj_to_name[id(obj)] = (obj, candidate)
        return candidate

    def associate_name_with_obj(self, name: str, obj: Any) -> None:
        """Record that ``obj`` owns the already-created ``name``."""
        previous = self._obj_to_name.get(id(obj))
        if previous is not None and previous[1] != name:
            raise RuntimeError(f"object already named {previous[1]!r}, cannot also be {name!r}")
        self._obj_to_name[id(obj)] = (obj, name)

    def rename_object(self, obj: Any, name: str) -> None:
        """Give ``obj`` the name ``name`` (which must be free), releasing its old name."""
        if name in self._used_names or name in RESERVED_NAMES:
            raise RuntimeError(f"name {name!r} is already taken or reserved")
        old = self._obj_to_name.get(id(obj))
        if old is not None:
            self._used_names.discard(old[1])
        self._used_names.add(name)
        self._obj_to_name[id(obj)] = (obj, name)

    def release(self, name: str, obj: Any | None = None) -> None:
        """Forget ``name`` (e.g. when its node is erased) so it may be handed out again."""
        self._used_names.discard(name)
        if obj is not None:
            self._obj_to_name.pop(id(obj), None)

    def __contains__(self, name: str) -> bool:
        return name in self._used_names
