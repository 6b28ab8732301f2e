"""Exception types of the quantization and fusion passes.

Both are ``RuntimeError`` subclasses (like torch.fx's graph errors), so ``except RuntimeError`` still catches
them. Messages say what was wrong, at which node (with the user's source line when the tracer recorded it),
and how to fix it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FusionError", "QuantizationError", "describe_node"]


class FusionError(RuntimeError):
    """A fusion was asked for but would change the program's meaning (training mode, shared conv output...).

    See docs/troubleshooting.md#fusionerror.
    """


class QuantizationError(RuntimeError):
    """prepare/calibrate/convert was given a model or configuration it cannot handle.

    See docs/troubleshooting.md#quantizationerror.
    """


def describe_node(node: Any) -> str:
    """``%name (op[target=...])`` plus ``at file:line`` from ``node.stack_trace`` when the tracer kept one."""
    target = getattr(node.target, "__name__", node.target)
    text = f"%{node.name} ({node.op}[target={target}])"
    trace = node.meta.get("stack_trace") if hasattr(node, "meta") else None
    if trace:
        lines = [line.strip() for line in str(trace).strip().splitlines() if line.strip().startswith("File")]
        if lines:
            text += f" at {lines[-1]}"
    return text
