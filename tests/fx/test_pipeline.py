"""fxdist.pipeline: the pass registry (the packages above fxdist declare their passes as entry points; fxdist names
none of them, tests/test_layout.py checks its strings) and ``fxdist.optimize`` (tracing, named/callable passes,
provenance, Parameter identity, DDP re-wrapping, errors)."""

from __future__ import annotations

import gc
import operator
from importlib.metadata import entry_points

import pytest
import torch
from torch import nn

import fxdist
from fxdist import pipeline
from fxdist.pipeline import PASSES, register_pass, resolve_pass
from jobs.config import JobConfig
from jobs.criteo import dlrm, to_kjt


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


def _mul_two_to_add(gm):
    """x * 2 -> x + x (same outputs)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is operator.mul and node.args[1] == 2:
            node.target, node.args = operator.add, (node.args[0], node.args[0])
    return gm


def _relu_to_neg(gm):
    """Changes the outputs: relu -> neg."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.relu:
            node.target = torch.neg
    return gm


class Doubler(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x) * 2)


def _dlrm():
    """The job's built-in model (torchrec's DLRM), small."""
    return dlrm(JobConfig().replace(model={"table_size": 50, "embedding_dim": 8, "bottom_mlp": [16], "top_mlp": [16]}))


def _inputs(b=6):
    return torch.rand(b, 13), to_kjt(torch.randint(0, 50, (b, 26)))


def test_optimize_keeps_parameters_and_records_passes():
    model = Doubler()
    x = torch.randn(3, 4)
    gm = fxdist.optimize(model, passes=(_mul_two_to_add, "dce"), example_inputs=(x,))
    assert isinstance(gm, fxdist.GraphModule)
    assert torch.allclose(gm(x), model(x))
    assert "lin + lin" in gm.code and "* 2" not in gm.code
    assert gm.lin.weight is model.lin.weight and gm.lin.bias is model.lin.bias
    records = gm.meta["fxdist"]["passes"]
    assert [r["name"] for r in records] == ["_mul_two_to_add", "dce"]
    assert records[0]["modified"] is True and records[1]["modified"] is False
    assert records[0]["nodes_added"] == 0 and records[0]["nodes_erased"] == 0
    assert gm.meta["fxdist"]["new_parameters"] == []
    assert gm.meta["fxdist"]["traced_nodes"] == len(fxdist.symbolic_trace(model).graph.nodes)


def test_training_the_optimized_module_trains_the_original():
    model = _dlrm()
    gm = fxdist.optimize(model, passes=("dce",))
    top = next(model.over_arch.parameters())
    before = top.detach().clone()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)  # built on the ORIGINAL module's parameters
    dense, sparse = _inputs()
    loss = nn.functional.binary_cross_entropy_with_logits(gm(dense, sparse).squeeze(1), torch.ones(6))
    loss.backward()
    opt.step()
    assert not torch.equal(before, top)
    assert {id(p) for p in gm.parameters()} == {id(p) for p in model.parameters()}
    assert torch.allclose(gm(dense, sparse), model(dense, sparse))


def test_a_pass_that_changes_outputs_is_caught_and_leaves_the_model_alone():
    from fxdist.passes.pass_base import PassVerificationError

    model = Doubler()
    x = torch.randn(3, 4)
    with pytest.raises(PassVerificationError, match="_relu_to_neg"):
        fxdist.optimize(model, passes=(_relu_to_neg,), example_inputs=(x,))
    # without example inputs nothing is verified: the pass runs
    gm = fxdist.optimize(model, passes=(_relu_to_neg,))
    assert "neg" in gm.code


def test_new_parameters_are_reported():
    def rescale(gm):
        gm.lin = nn.Linear(4, 4)  # a pass that replaces a module (e.g. folding) makes new parameters
        return gm

    model = Doubler()
    gm = fxdist.optimize(model, passes=(rescale,))
    assert sorted(gm.meta["fxdist"]["new_parameters"]) == ["lin.bias", "lin.weight"]
    assert gm.lin.weight is not model.lin.weight


def test_named_passes_resolve_lazily():
    register_pass("mul2add-test", "tests.fx.test_pipeline:_mul_two_to_add")
    try:
        name, fn = resolve_pass("mul2add-test")
        assert (name, fn) == ("mul2add-test", _mul_two_to_add)
        gm = fxdist.optimize(Doubler(), passes=["mul2add-test"])
        assert gm.meta["fxdist"]["passes"][0]["name"] == "mul2add-test"
    finally:
        del PASSES["mul2add-test"]
    assert PASSES["async_rpc"] == "scheduling:async_rpc" and PASSES["fuse"] == "quant:fuse"
    with pytest.raises(ValueError, match=r"unknown pass 'nope'; known passes: .*async_rpc"):
        fxdist.optimize(Doubler(), passes=["nope"])
    register_pass("broken-test", "no_such_module_xyz:fn")
    try:
        with pytest.raises(ImportError) as info:
            fxdist.optimize(Doubler(), passes=["broken-test"])
        assert any("no_such_module_xyz" in note for note in info.value.__notes__)
    finally:
        del PASSES["broken-test"]
    with pytest.raises(TypeError, match="must be 'module:attribute' or a callable"):
        register_pass("x", 3)


class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


class LinThenBranchy(nn.Module):
    """A traceable Linear feeding an untraceable Branchy (traceable with Branchy as a leaf)."""

    def __init__(self):
        super().__init__()
        self.branchy = Branchy()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.branchy(self.lin(x))


def test_untraceable_model_gets_the_tracer_error_and_a_hint():
    with pytest.raises(fxdist.TraceError) as info:
        fxdist.optimize(Branchy(), passes=())
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "could not trace Branchy" in notes
    for remedy in ("is_leaf_module", "concrete_args", "fxdist.wrap", "allow_eager_fallback"):
        assert remedy in notes


def test_tracer_class_with_leaf_modules():
    class LeafTracer(fxdist.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, Branchy) or super().is_leaf_module(m, qualname)

    model = LinThenBranchy()
    gm = fxdist.optimize(model, passes=(), tracer_class=LeafTracer)
    x = torch.randn(2, 3)
    assert torch.allclose(gm(x), model(x))
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["lin", "branchy"]


def test_ddp_module_is_rewrapped_with_the_same_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = _dlrm()
        ddp = nn.parallel.DistributedDataParallel(model)
        out = fxdist.optimize(ddp, passes=("dce",))
        assert isinstance(out, nn.parallel.DistributedDataParallel)
        assert isinstance(out.module, fxdist.GraphModule)
        assert out.process_group is ddp.process_group
        assert {id(p) for p in out.parameters()} == {id(p) for p in model.parameters()}
        dense, sparse = _inputs()
        out(dense, sparse).sum().backward()
        assert next(model.dense_arch.parameters()).grad is not None
    finally:
        # the DDP wrappers (their Reducers hold the gloo group) go first: a group freed by the last Reducer after
        # destroy_process_group hung in ~ProcessGroupGloo (once in a full run)
        ddp = out = None
        gc.collect()
        dist.destroy_process_group()


def _two_ranks(tmp_path, calls: tuple[bool, bool], timeout_s: float) -> dict[int, dict]:
    """Run tests/fx/_ddp_ranks.rank_main in 2 spawned processes (gloo); their reports by rank."""
    import multiprocessing as mp

    from tests.fx._ddp_ranks import rank_main

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, str(tmp_path / "store"), calls[r], 0.0, timeout_s, queue),
                         daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = {r["rank"]: r for r in (queue.get(timeout=120) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert not [r["unexpected"] for r in results.values() if "unexpected" in r]
    return results


def test_optimize_on_ddp_with_both_ranks_rewraps_and_retires_the_old_wrapper(tmp_path):
    results = _two_ranks(tmp_path, (True, True), timeout_s=30.0)
    for r in results.values():
        assert "error" not in r, r
        assert r["new_is_ddp"]
        assert "replaced by the one fxdist.optimize returned" in r["old_error"]
    assert results[0]["grad"] == results[1]["grad"]  # the new DDP all-reduced the gradients


def test_optimize_on_ddp_by_one_rank_alone_fails_naming_the_missing_rank(tmp_path):
    results = _two_ranks(tmp_path, (True, False), timeout_s=1.0)  # the absent rank lives 3 s past the timeout
    r = results[0]
    assert r["error"] == "DDPRanksMissingError"
    assert 1.0 <= r["seconds"] < 20.0
    assert "is a collective: all 2 ranks" in r["message"] and "missing rank(s): 1" in r["message"]


def test_optimize_on_ddp_by_rank_1_alone_fails_naming_rank_0(tmp_path):
    r = _two_ranks(tmp_path, (False, True), timeout_s=1.0)[1]
    assert r["error"] == "DDPRanksMissingError"
    assert 1.0 <= r["seconds"] < 20.0 and "Rank 1 waited 1 s; missing rank(s): 0" in r["message"]


def test_ddp_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(pipeline.DDP_TIMEOUT_ENV, "7.5")
    assert pipeline._ddp_timeout_s(None) == 7.5
    assert pipeline._ddp_timeout_s(2) == 2
    monkeypatch.delenv(pipeline.DDP_TIMEOUT_ENV)
    assert pipeline._ddp_timeout_s(None) == 60
    with pytest.raises(ValueError, match="ddp_timeout_s must be > 0"):
        pipeline._ddp_timeout_s(0)


def test_a_pass_that_changes_nothing_is_warned_with_its_reason():
    from fxdist.pipeline import NO_OP_REASONS, NoOpPassWarning

    def records_its_reason(gm):
        gm.meta.setdefault("fxdist", {})["unchanged_reason"] = "nothing to do here"
        return gm

    with pytest.warns(NoOpPassWarning) as record:
        gm = fxdist.optimize(Doubler(), passes=("dce", records_its_reason, _mul_two_to_add, "async_rpc"))
    assert [str(w.message) for w in record if w.category is NoOpPassWarning] == [
        f"dce: changed nothing: {NO_OP_REASONS['dce']}",
        "records_its_reason: changed nothing: nothing to do here",
        f"async_rpc: changed nothing: {NO_OP_REASONS['async_rpc']}"]     # _mul_two_to_add changed the graph
    assert gm.meta["fxdist"]["unchanged"] == {"dce": NO_OP_REASONS["dce"],
                                              "records_its_reason": "nothing to do here",
                                              "async_rpc": NO_OP_REASONS["async_rpc"]}
    assert "unchanged_reason" not in gm.meta["fxdist"]
    assert "no blocking RPC found" in NO_OP_REASONS["async_rpc"]


def test_passes_can_add_leaf_modules_and_partials_keep_their_name():
    import functools

    seen = []

    def count_calls(gm, label="calls"):
        seen.append((label, [n.target for n in gm.graph.nodes if n.op == "call_module"]))
        return gm

    count_calls.fxdist_leaf_module = lambda m: isinstance(m, Branchy)
    model = LinThenBranchy()
    gm = fxdist.optimize(model, passes=(functools.partial(count_calls, label="leaf"),))  # Branchy alone fails
    assert seen == [("leaf", ["lin", "branchy"])]
    assert [r["name"] for r in gm.meta["fxdist"]["passes"]] == ["count_calls"]
    x = torch.randn(2, 3)
    assert torch.allclose(gm(x), model(x))
    with pytest.raises(fxdist.TraceError):  # without the pass's leaf, the control flow is traced
        fxdist.optimize(model, passes=(_mul_two_to_add,))
