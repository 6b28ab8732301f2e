"""Spelling Python objects safely in generated source (used by codegen and GraphModule.to_folder).

Every function here answers "which text evaluates to exactly this object?" and only ever returns text
built from verified identifiers: a dotted path is returned only after walking it attribute by
attribute and finding the very same object, so an attacker-chosen ``__name__``/``__module__`` or a
hostile string never reaches generated code.

Source: the rules torch/fx/graph.py and torch/fx/node.py (``_get_qualified_name``,
``_is_from_torch``, ``magic_methods``) apply, re-derived with identity checks.
"""

from __future__ import annotations

import keyword
import math
import operator
import re
import sys
import typing
from typing import Any

import torch
import torch.utils._pytree as _pytree

_PLAIN_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
DIGITS_OR_WORD = re.compile(r"[A-Za-z0-9_]*\Z")
_CONTROL_CHARS = re.compile("[\x00-\x1f\x7f\x85\u2028\u2029]")

# Globals every generated function can use; node names can never shadow them (see _namespace).
FIXED_GLOBALS: dict[str, Any] = {
    "inf": math.inf,
    "nan": math.nan,
    "NoneType": type(None),
    "torch": torch,
    "device": torch.device,
    "pytree": _pytree,
    "operator": operator,
}

# id(operator function) -> (template, arity). Keyed by identity, so a function that merely claims
# ``__module__ == "_operator"`` is not printed as an operator.
OPERATOR_TEMPLATES: dict[int, tuple[str, int]] = {}
for _name, _tpl in {
    "add": "{} + {}", "sub": "{} - {}", "mul": "{} * {}", "floordiv": "{} // {}",
    "truediv": "{} / {}", "mod": "{} % {}", "pow": "{} ** {}", "lshift": "{} << {}",
    "rshift": "{} >> {}", "and_": "{} & {}", "or_": "{} | {}", "xor": "{} ^ {}",
    "getitem": "{}[{}]", "matmul": "{} @ {}", "eq": "{} == {}", "ne": "{} != {}",
    "lt": "{} < {}", "gt": "{} > {}", "le": "{} <= {}", "ge": "{} >= {}",
    "pos": "+{}", "neg": "-{}", "invert": "~{}",
}.items():
    OPERATOR_TEMPLATES[id(getattr(operator, _name))] = (_tpl, _tpl.count("{}"))
# id(in-place operator function) -> augmented assignment operator (torch/fx/graph.py inplace_methods).
INPLACE_OPERATORS: dict[int, str] = {
    id(getattr(operator, f"i{name}")): op for name, op in {
        "add": "+=", "and": "&=", "floordiv": "//=", "lshift": "<<=", "mod": "%=", "mul": "*=",
        "matmul": "@=", "or": "|=", "pow": "**=", "rshift": ">>=", "sub": "-=", "truediv": "/=", "xor": "^=",
    }.items()
}
# Operators whose left operand binds tighter than a unary minus: (-1) ** x, (-1)[0].
TIGHT_LEFT = {id(operator.pow), id(operator.getitem)}

# PEP 585 builtins printed as their typing alias inside typing generics, as torch.fx does.
ORIGIN_TYPING = {list: typing.List, dict: typing.Dict, set: typing.Set,  # noqa: UP006
                  frozenset: typing.FrozenSet, tuple: typing.Tuple}  # noqa: UP006
TORCH_SINGLETONS = (torch.dtype, torch.layout, torch.memory_format)


def is_plain_ident(name: object) -> bool:
    """A name safe to print after a dot or as a keyword argument (ASCII, not a keyword)."""
    return type(name) is str and _PLAIN_IDENT.match(name) is not None and not keyword.iskeyword(name)


def resolve_torch_path(path: str) -> Any:
    """Walk ``torch.a.b`` attribute by attribute from the torch module; raises on failure."""
    head, *rest = path.split(".")
    if head != "torch" or not all(is_plain_ident(p) for p in rest):
        raise LookupError(path)
    obj: Any = torch
    for part in rest:
        obj = getattr(obj, part)
    return obj


def safe_attr(obj: Any, name: str) -> Any:
    """``getattr(obj, name, None)`` that also survives attribute hooks raising other errors."""
    try:
        return getattr(obj, name, None)
    except Exception:  # noqa: BLE001
        return None


def torch_path(obj: Any) -> str | None:
    """The dotted ``torch.`` path that evaluates to exactly ``obj``, or None."""
    name, module, qualname = safe_attr(obj, "__name__"), safe_attr(obj, "__module__"), safe_attr(obj, "__qualname__")
    candidates = []
    if isinstance(module, str) and module.startswith("torch"):
        module = module.replace("torch._ops", "torch.ops")
        if isinstance(qualname, str):
            candidates.append(f"{module}.{qualname}")
        if isinstance(name, str):
            candidates.append(f"{module}.{name}")
    if isinstance(name, str):
        candidates += [f"torch.{name}", f"torch.nn.functional.{name}", f"torch.Tensor.{name}"]
    for path in candidates:
        try:
            if resolve_torch_path(path) is obj:
                return path
        except Exception:  # noqa: BLE001 - any failure just means "not this path"
            continue
    return None


def qualified_hint(obj: Any) -> str:
    """A readable (not trusted) name hint for a global, in torch.fx's ``module.name`` style."""
    name = safe_attr(obj, "__name__")
    if not isinstance(name, str):
        name = type(obj).__name__
    module = safe_attr(obj, "__module__")
    return f"{module}.{name}" if isinstance(module, str) and module != "builtins" else name


def snake_case(name: str) -> str:
    return re.sub(r"(?<=[a-z])([A-Z])", r"_\1", name).lower()


def one_line_comment(text: str) -> str:
    """Make arbitrary text safe for a one-line ``#`` comment."""
    return _CONTROL_CHARS.sub(" ", text)


def stack_summary(stack_trace: str | None) -> str | None:
    """``File: f.py:12 in forward, code: return x + 1`` from the innermost frame of a stack trace."""
    if not stack_trace:
        return None
    lines = stack_trace.strip().split("\n")
    pattern = re.compile(r'^File "(.+)", line (\d+), in (.+)$')
    for idx in range(len(lines) - 2, -1, -1):
        match = pattern.match(lines[idx].strip())
        if match:
            file, lineno, name = match.groups()
            return f"File: {file}:{lineno} in {name}, code: {lines[idx + 1].strip()}"
    return None


def torch_path_of_singleton(value: Any) -> str | None:
    """``torch.float32`` for a dtype, ``torch.strided`` for a layout... verified by identity."""
    text = str(value)
    if text.startswith("torch.") and is_plain_ident(text[6:]):
        try:
            return text if resolve_torch_path(text) is value else None
        except Exception:  # noqa: BLE001
            return None
    return None


def importable_path(obj: Any) -> tuple[str, str] | None:
    """``(module, qualname)`` such that ``import module`` then walking ``qualname`` gives exactly
    ``obj`` (for writing import statements), or None. Only already-imported modules are considered;
    ``__main__`` objects are not importable."""
    module, qualname = safe_attr(obj, "__module__"), safe_attr(obj, "__qualname__")
    if not isinstance(module, str) or not isinstance(qualname, str) or module == "__main__":
        return None
    if not all(is_plain_ident(p) for p in module.split(".") + qualname.split(".")):
        return None
    found: Any = sys.modules.get(module)  # never import: a hostile __module__ must not run code
    if found is None:
        return None
    try:
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:  # noqa: BLE001 - not importable by this path
        return None
    return (module, qualname) if found is obj else None
