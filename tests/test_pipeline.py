"""fxdist.pipeline's pass registry: the packages above fxdist declare their passes as entry points; fxdist names
none of them (tests/test_layout.py checks its strings)."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch
from torch import nn

import fxdist
from fxdist import pipeline


def test_the_projects_passes_come_from_entry_points():
    declared = {ep.name: ep.value for ep in entry_points(group=pipeline.ENTRY_POINT_GROUP)}
    assert declared == {"parameter_servers": "scheduling.placement:parameter_servers",
                        "async_rpc": "scheduling:async_rpc",
                        "async_rpc_prefetch": "scheduling.async_rpc_pass:async_rpc_prefetch", "fuse": "quant:fuse"}
    import scheduling

    name, fn = pipeline.resolve_pass("async_rpc")
    assert name == "async_rpc" and fn is scheduling.async_rpc
    assert pipeline.NO_OP_REASONS["async_rpc"] == scheduling.async_rpc.fxdist_no_op_reason


def test_an_unknown_pass_name_says_how_to_declare_one():
    with pytest.raises(ValueError, match=r"unknown pass 'nope'; known passes: .*async_rpc_prefetch.*entry points "
                                         r"of the group 'fxdist.passes', or calls fxdist.register_pass"):
        pipeline.resolve_pass("nope")


def test_a_registered_pass_runs_by_name():
    calls = []

    def mark(gm):
        calls.append(len(list(gm.graph.nodes)))
        return gm

    mark.fxdist_no_op_reason = "it only looks"
    fxdist.register_pass("mark_for_test", mark)
    try:
        with pytest.warns(fxdist.pipeline.NoOpPassWarning, match="mark_for_test: changed nothing: it only looks"):
            fxdist.optimize(nn.Sequential(nn.Linear(2, 2)), passes=("mark_for_test",))
        assert calls == [3]                       # placeholder, call_module, output
    finally:
        pipeline.PASSES.pop("mark_for_test", None)
        pipeline.NO_OP_REASONS.pop("mark_for_test", None)
