"""``check_mutable_operations``: refuse to record a call that mutates its operands.

A ``call_function`` target is looked up as torch.fx does: an ATen ``OpOverload`` has its one schema, a
torch builtin (``torch.sigmoid``) the schemas of every overload of its TorchScript name. The call's
arguments are bound against each schema (``self`` is called ``input``, ``from`` is ``from_``, as in the
Python signatures torch.fx builds); when exactly one schema accepts them and that schema is mutable (an
in-place or ``out=`` overload: ``torch.sigmoid(x, out=y)`` binds only ``aten::sigmoid.out``), the call is
refused. No match or several matches: nothing is checked (best effort, as torch.fx).

Source: torch/fx/operator_schemas.py (``check_for_mutable_operation``, ``get_signature_for_torch_op``,
``_torchscript_schema_to_signature``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_not_mutating"]

_PY_NAMES = {"self": "input", "from": "from_"}


def _schemas(target: Any) -> list[Any]:
    if isinstance(target, torch._ops.OpOverload):
        return [target._schema]
    from torch.jit._builtins import _find_builtin

    try:
        name = _find_builtin(target)
    except TypeError:  # unhashable target
        return []
    return list(torch._C._jit_get_schemas_for_operator(name)) if name else []


def _binds(schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``args``/``kwargs`` can be passed to ``schema``'s Python signature (no type checks)."""
    params = [(_PY_NAMES.get(a.name, a.name), a.kwarg_only, a.has_default_value()) for a in schema.arguments]
    positional = [p for p in params if not p[1]]
    if len(args) > len(positional):
        return False
    given = {name for name, _, _ in positional[: len(args)]}
    names = {name for name, _, _ in params}
    if any(k in given or k not in names for k in kwargs):
        return False
    given |= set(kwargs)
    return all(has_default or name in given for name, _, has_default in params)


def check_not_mutating(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse ``target(*args, **kwargs)`` if the one schema it binds to mutates an operand.

    Raises:
        RuntimeError: "Tried to trace mutable operation <schema>...", as torch.fx's
            ``check_for_mutable_operation``.
    """
    matched = [s for s in _schemas(target) if _binds(s, args, kwargs)]
    if len(matched) == 1 and matched[0].is_mutable:
        raise RuntimeError(f"Tried to trace mutable operation {matched[0]}. FX only supports functional "
                           "code, so operations that mutate operands in-place (e.g. via `out` arguments) "
                           "are not supported")
