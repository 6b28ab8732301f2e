"""GraphModule: attribute sharing, recompilation, tracebacks, to_folder, deepcopy/pickle, submodules (the picklable
form and ``to_folder`` are fxdist/_graph_module_io.py)."""

from __future__ import annotations

import copy
import functools
import gc
import importlib
import linecache
import operator
import pickle
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fxdist as fx
from fxdist.graph_module import GraphModule
from tests._planted import Planted


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.param = nn.Parameter(torch.randn(4))
        self.linear = nn.Linear(4, 4)
        self.layer1 = nn.Sequential(nn.Sequential(nn.ReLU(), nn.Linear(4, 4)))
        self.register_buffer("buf", torch.rand(4))
        self.unused = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer1(self.linear(x + self.param).clamp(min=0.0, max=1.0)) * self.buf


def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


def net_graph() -> fx.Graph:
    """Net.forward built by hand (independent of the tracer)."""
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(operator.add, (x, g.get_attr("param")))
    c = g.call_method("clamp", (g.call_module("linear", (a,)),), {"min": 0.0, "max": 1.0})
    s = g.call_module("layer1.0.1", (g.call_module("layer1.0.0", (c,)),))
    g.output(g.call_function(operator.mul, (s, g.get_attr("buf"))))
    return g


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net()


def test_shares_referenced_attributes_and_computes_the_same(net: Net) -> None:
    gm = GraphModule(net, net_graph())
    x = torch.randn(3, 4)
    assert torch.allclose(gm(x), net(x))
    assert gm.linear.weight is net.linear.weight and gm.param is net.param and gm.buf is net.buf
    assert gm.get_submodule("layer1.0.1") is net.layer1[0][1]
    assert type(gm.layer1) is nn.Module  # intermediate modules are created empty, as in torch.fx
    assert not hasattr(gm, "unused") and "buf" in dict(gm.named_buffers())
    assert gm.graph.owning_module is gm and isinstance(gm, GraphModule) and gm.meta == {}


def test_traced_module(net: Net) -> None:
    gm = fx.symbolic_trace(net)
    x = torch.randn(3, 4)
    assert torch.allclose(gm(x), net(x)) and type(gm).__name__ == "Net"
    assert "self._modules['layer1']._modules['0']._modules['1'](" in gm.code


def test_dict_root() -> None:
    lin, w = nn.Linear(2, 2), nn.Parameter(torch.ones(2))
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(operator.add, (g.call_module("sub.lin", (x,)), g.get_attr("sub.lin.bias_extra"))))
    gm = GraphModule({"sub.lin": lin, "sub.lin.bias_extra": w}, g, class_name="FromDict")
    assert gm.sub.lin is lin and gm.sub.lin.bias_extra is w and type(gm).__name__ == "FromDict"
    assert torch.allclose(gm(torch.ones(2)), lin(torch.ones(2)) + 1)
    with pytest.raises(RuntimeError, match="sub.lin"):
        GraphModule({}, g)


def test_get_attr_through_a_plain_object_parent() -> None:
    class Config:
        scale = 3.0

    g = fx.Graph()
    g.output(g.call_function(operator.mul, (g.placeholder("x"), g.get_attr("cfg.scale"))))
    gm = GraphModule({"cfg": Config(), "cfg.scale": 2.0}, g)
    assert "cfg_scale = self.cfg.scale" in gm.code and gm(5) == 10.0


def test_bad_roots_are_clear_errors(net: Net) -> None:
    g = fx.Graph()
    g.output(g.get_attr("missing.weight"))
    with pytest.raises(AttributeError, match="'missing.weight'.*no attribute 'missing'"):
        GraphModule(net, g)
    with pytest.raises(RuntimeError, match="Unsupported type"):
        GraphModule([1, 2], fx.Graph())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fxdist Graph"):
        GraphModule(net, net_graph()).graph = "not a graph"  # type: ignore[assignment]


def test_graph_setter_and_recompile(net: Net) -> None:
    gm = GraphModule(net, net_graph())
    x = torch.randn(3, 4)
    g2 = fx.Graph()
    g2.output(g2.call_function(torch.neg, (g2.placeholder("x"),)))
    gm.graph = g2
    assert g2.owning_module is gm and "torch.neg(x)" in gm.code and torch.equal(gm(x), -x)
    neg = next(n for n in g2.nodes if n.op == "call_function")
    with g2.inserting_after(neg):
        doubled = g2.call_function(operator.mul, (neg, 2))
    neg.replace_all_uses_with(doubled, delete_user_cb=lambda user: user is not doubled)
    assert torch.equal(gm(x), -x)  # not recompiled yet
    code = gm.recompile()
    assert code.src == gm.code and torch.equal(gm(x), -2 * x)


def test_failed_recompile_keeps_the_previous_forward(net: Net) -> None:
    gm = GraphModule(net, net_graph())
    x = torch.randn(3, 4)
    code = gm.code
    first = next(iter(gm.graph.nodes))
    with gm.graph.inserting_before(first):
        gm.graph.placeholder("with_default", default_value=1.0)  # a default before a plain parameter
    with pytest.raises(SyntaxError):
        gm.recompile()
    assert gm.code == code and torch.allclose(gm(x), net(x))


def test_instances_have_their_own_class(net: Net) -> None:
    a, b = GraphModule(net, net_graph()), GraphModule(net, net_graph(), class_name="Other")
    b.graph = fx.Graph()
    b.graph.output(b.graph.placeholder("x"))
    b.recompile()
    x = torch.randn(3, 4)
    assert type(a) is not type(b) and torch.allclose(a(x), net(x)) and b(x) is x
    assert type(a).__name__ == "GraphModule" and repr(b).startswith("Other(")


def test_replaced_submodule_is_used_without_recompile(net: Net) -> None:
    gm = GraphModule(net, net_graph())
    x = torch.randn(3, 4)
    gm.linear = nn.Identity()
    gm.get_submodule("layer1.0").add_module("1", nn.Identity())
    assert torch.allclose(gm(x), (x + net.param).clamp(0, 1) * net.buf)


def test_traceback_shows_generated_line(net: Net) -> None:
    def explode(t: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")

    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(explode, (g.call_function(torch.relu, (x,)),)))
    gm = GraphModule(net, g)
    with pytest.raises(ValueError, match="boom") as info:
        gm(torch.randn(2))
    frames = traceback.extract_tb(info.value.__traceback__)
    generated = [f for f in frames if f.filename.startswith("<eval_with_key>.")]
    assert len(generated) == 1 and generated[0].line.startswith("explode = ")
    offset = generated[0].lineno - gm._prologue_start
    assert list(g.nodes)[gm._lineno_map[offset]].name == "explode"
    assert "explode = " in linecache.getline(generated[0].filename, generated[0].lineno)
    assert "explode = " in "".join(traceback.format_exception(info.value))


def test_linecache_entries_do_not_accumulate(net: Net) -> None:
    gm = GraphModule(net, net_graph())
    first = type(gm)._fxdist_source["filename"]
    assert linecache.getline(first, gm._prologue_start).startswith("def forward(self, x)")
    gm.recompile()
    second = type(gm)._fxdist_source["filename"]
    assert first not in linecache.cache and second in linecache.cache
    del gm
    gc.collect()
    assert second not in linecache.cache


def test_to_folder_is_importable_and_computes_the_same(net: Net, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    gm = fx.symbolic_trace(net)
    out = gm.graph.output_node()
    with gm.graph.inserting_before(out):
        halved = gm.graph.call_function(functools.partial(scale, factor=0.5), (out.args[0],))  # pickled global
        scaled = gm.graph.call_function(scale, (halved, 3.0))  # imported global
    out.args = (scaled,)
    gm.register_buffer("scratch", torch.full((2,), 7.0), persistent=False)
    gm.recompile()
    gm.to_folder(tmp_path / "fxdist_saved_net", "SavedNet")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        module = importlib.import_module("fxdist_saved_net")
        loaded = module.SavedNet()
    finally:
        for name in [m for m in sys.modules if m.startswith("fxdist_saved_net")]:
            del sys.modules[name]
    x = torch.randn(3, 4)
    assert torch.allclose(loaded(x), net(x) * 1.5)
    assert torch.equal(loaded.scratch, gm.scratch) and (tmp_path / "fxdist_saved_net" / "globals.pt").exists()
    source = (tmp_path / "fxdist_saved_net" / "module.py").read_text()
    assert "from tests.fx.test_graph_module import scale as" in source
    with pytest.raises(ValueError, match="identifier"):
        gm.to_folder(tmp_path / "other", "not valid")


class _Local(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def test_to_folder_loads_its_files_weights_only(net: Net, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """module.py reads its .pt files with torch.load(weights_only=True), allowing only the types it wrote (listed
    in _SAFE_GLOBALS): a child file swapped for a pickle that names another callable is refused, naming the file
    and that callable, and the callable never runs."""
    gm = fx.symbolic_trace(net)
    gm.to_folder(tmp_path / "fxdist_planted_net", "PlantedNet")
    source = (tmp_path / "fxdist_planted_net" / "module.py").read_text()
    assert "weights_only=True" in source and "weights_only=False" not in source
    assert "importlib.import_module('torch.nn.modules.linear').Linear," in source
    marker = tmp_path / "marker"
    child = next((tmp_path / "fxdist_planted_net").glob("000_*.pt"))
    torch.save({"weight": torch.zeros(2), "hook": Planted(marker)}, child)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        module = importlib.import_module("fxdist_planted_net")
        refused = rf"(?s){child.name}: not loaded: .*GLOBAL tests\._planted\.write_marker"
        with pytest.raises(pickle.UnpicklingError, match=refused):
            module.PlantedNet()
    finally:
        for name in [m for m in sys.modules if m.startswith("fxdist_planted_net")]:
            del sys.modules[name]
    assert not marker.exists()

    class KeepLocal(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return isinstance(m, _Local) or super().is_leaf_module(m, qualname)

    root = nn.Sequential(_Local())
    main_gm = GraphModule(root, KeepLocal().trace(root))
    monkeypatch.setattr(_Local, "__module__", "__main__")  # defined in a script: picklable, but no import path
    monkeypatch.setattr(sys.modules["__main__"], "_Local", _Local, raising=False)
    with pytest.raises(ValueError, match=r"000_+0.pt holds __main__\._Local, which has no import path"):
        main_gm.to_folder(tmp_path / "other", "Other")


def _roundtrip_checks(gm: GraphModule, new: GraphModule, x: torch.Tensor) -> None:
    assert torch.allclose(new(x), gm(x))
    assert type(new).__name__ == type(gm).__name__ and type(new) is not type(gm)
    assert [(n.op, n.name, n.target) for n in new.graph.nodes] == [(n.op, n.name, n.target) for n in gm.graph.nodes]
    assert new.code == gm.code and new.graph.owning_module is new


def test_deepcopy(net: Net) -> None:
    gm = fx.symbolic_trace(net)
    gm.meta["note"] = [1]
    copied = copy.deepcopy(gm)
    x = torch.randn(3, 4)
    _roundtrip_checks(gm, copied, x)
    assert copied.linear.weight is not gm.linear.weight and copied.meta == {"note": [1]}
    assert copied.meta["note"] is not gm.meta["note"]
    with torch.no_grad():
        copied.linear.weight.zero_()
    assert not torch.allclose(copied(x), gm(x))
    shallow = copy.copy(gm)
    assert shallow.linear is gm.linear and shallow.meta is gm.meta and torch.allclose(shallow(x), gm(x))


def test_pickle_round_trip_keeps_graph_state_and_children(net: Net) -> None:
    gm = fx.symbolic_trace(net)
    inner = fx.symbolic_trace(nn.Sequential(nn.Tanh()))
    gm.add_submodule("inner", inner)
    with gm.graph.inserting_before(gm.graph.output_node()):
        wrapped = gm.graph.call_module("inner", (gm.graph.output_node().args[0],))
    gm.graph.output_node().args = (wrapped,)
    gm.recompile()
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    node.meta["stack_trace"] = 'File "m.py", line 3, in forward'
    loaded = pickle.loads(pickle.dumps(gm))
    x = torch.randn(3, 4)
    _roundtrip_checks(gm, loaded, x)
    assert isinstance(loaded.inner, GraphModule) and torch.allclose(loaded(x), torch.tanh(net(x)))
    assert next(n for n in loaded.graph.nodes if n.op == "call_module").meta == {"stack_trace": node.meta["stack_trace"]}


def test_pickle_large_graph_without_deep_recursion() -> None:
    g = fx.Graph()
    cur = g.placeholder("x")
    for _ in range(1500):
        cur = g.call_function(operator.add, (cur, 1))
    g.output(cur)
    loaded = pickle.loads(pickle.dumps(GraphModule(nn.Module(), g)))
    assert loaded(0) == 1500


def test_print_readable_and_str(net: Net) -> None:
    gm = fx.symbolic_trace(net)
    gm.add_submodule("child", fx.symbolic_trace(nn.Sequential(nn.ReLU())))
    text = gm.print_readable(print_output=False)
    assert text.startswith("class Net(torch.nn.Module):\n    def forward(self, x")
    assert "        # No stacktrace found for following nodes\n" in text
    assert "\n    class child(torch.nn.Module):\n        def forward(self, input):\n" in text
    assert str(gm).startswith("Net(") and gm.code in str(gm) and str(gm).endswith("print_readable()`")


def test_submodule_management(net: Net) -> None:
    gm = fx.symbolic_trace(net)
    assert gm.add_submodule("extra.deep.lin", nn.Linear(1, 1))
    assert isinstance(gm.get_submodule("extra.deep.lin"), nn.Linear)
    assert not gm.add_submodule("param.sub", nn.ReLU())  # param is not a module
    assert gm.delete_submodule("extra.deep.lin") and not gm.delete_submodule("extra.deep.lin")
    assert not gm.delete_submodule("param") and not gm.delete_submodule("nope.x")
    gm.add_submodule("extra.other", nn.ReLU())
    gm.delete_all_unused_submodules()
    names = {name for name, _ in gm.named_modules()}
    assert "extra" not in names and {"linear", "layer1", "layer1.0", "layer1.0.1"} <= names
    x = torch.randn(3, 4)
    assert torch.allclose(gm(x), net(x))


def test_data_parallel_replica_uses_its_own_modules(net: Net) -> None:
    gm = fx.symbolic_trace(net)
    replica = gm._replicate_for_data_parallel()
    replica.param = gm.param  # DataParallel's replicate() installs parameter copies like this
    replica._modules["linear"] = nn.Identity()
    x = torch.randn(3, 4)
    assert torch.allclose(gm(x), net(x))
    assert torch.allclose(replica(x), net.layer1((x + net.param).clamp(0, 1)) * net.buf)


def test_state_dict_and_optimizer_see_shared_parameters(net: Net) -> None:
    gm = fx.symbolic_trace(net)
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    before = net.linear.weight.detach().clone()
    gm(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert not torch.equal(before, net.linear.weight)  # the root's parameter moved
    assert set(gm.state_dict()) == {"param", "buf", "linear.weight", "linear.bias", "layer1.0.1.weight",
                                    "layer1.0.1.bias"}


def _count(gm: Any) -> int:
    return len(list(gm.graph.nodes))


def test_recompile_recompiles_graph_module_children(net: Net) -> None:
    child = fx.symbolic_trace(nn.Sequential(nn.ReLU()))
    g = fx.Graph()
    g.output(g.call_module("child", (g.placeholder("x"),)))
    gm = GraphModule({"child": child}, g)
    relu = next(n for n in child.graph.nodes if n.op == "call_module")
    relu.target, relu.name = "0", "relu0"
    child.graph.lint()
    gm.recompile()
    assert "relu0 = " in child.code and _count(child) == 3
