"""Helpers for the quant tests."""

from __future__ import annotations


def module_types(gm) -> list[type]:
    """The types of the submodules the graph calls, in graph order."""
    return [type(gm.get_submodule(n.target)) for n in gm.graph.nodes if n.op == "call_module"]
