"""PassBase / PassResult / PassManager: naming rules, provenance, lint, verification, and
"loses nothing already done" (the caller's module is untouched when a pass fails)."""

from __future__ import annotations

import dataclasses
import doctest
import operator
from dataclasses import dataclass
from textwrap import dedent
from typing import ClassVar

import pytest
import torch

import fxdist as fx
import fxdist.passes.pass_base as pass_base
from fxdist.passes import PassBase, PassManager, PassResult, PassVerificationError


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x) * 2) + 0


@dataclass(frozen=True)
class MulTwoToAdd(PassBase):
    """``x * 2 -> x + x`` (same outputs; modifies in place)."""

    name: ClassVar[str] = "mul-two-to-add"

    def call(self, gm):
        modified = False
        for node in gm.graph.find_nodes(op="call_function", target=operator.mul):
            if node.args[1] == 2:
                node.target, node.args = operator.add, (node.args[0], node.args[0])
                modified = True
        return PassResult(gm, modified)


@dataclass(frozen=True)
class DropAddZero(PassBase):
    """``x + 0 -> x`` (erases nodes)."""

    name: ClassVar[str] = "drop-add-zero"

    def call(self, gm):
        erased = 0
        for node in gm.graph.find_nodes(op="call_function", target=operator.add):
            if node.args[1] == 0:
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
                erased += 1
        return PassResult(gm, erased > 0)


@dataclass(frozen=True)
class ReluToSigmoid(PassBase):
    """Changes semantics on purpose; ``report`` controls what it claims."""

    name: ClassVar[str] = "relu-to-sigmoid"
    report: bool = True

    def call(self, gm):
        for node in gm.graph.find_nodes(op="call_function", target=torch.relu):
            node.target = torch.sigmoid
        return PassResult(gm, self.report)


@dataclass(frozen=True)
class MutateThenFail(PassBase):
    name: ClassVar[str] = "mutate-then-fail"

    def call(self, gm):
        for node in list(gm.graph.nodes):
            if node.op == "call_function":
                node.target = torch.sigmoid
        raise ValueError("boom after mutating")


@dataclass(frozen=True)
class BreakLint(PassBase):
    """Makes a node use a node of another graph: lint must catch it."""

    name: ClassVar[str] = "break-lint"

    def call(self, gm):
        other = fx.Graph()
        stranger = other.placeholder("stranger")
        relu = gm.graph.find_nodes(op="call_function", target=torch.relu)[0]
        relu.args = (stranger,)
        return PassResult(gm, True)


def traced():
    torch.manual_seed(0)
    return fx.symbolic_trace(Net())


def test_name_must_be_kebab_case():
    with pytest.raises(TypeError, match=r"kebab-case.*'Fuse_Conv'"):

        @dataclass(frozen=True)
        class Bad(PassBase):
            name: ClassVar[str] = "Fuse_Conv"

            def call(self, gm):
                return PassResult(gm, False)


def test_pass_is_frozen_dataclass_with_options():
    p = ReluToSigmoid(report=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.report = True  # type: ignore[misc]
    assert p == ReluToSigmoid(report=False) and hash(p) == hash(ReluToSigmoid(report=False))
    with pytest.raises(TypeError):
        PassBase()  # abstract


def test_pipeline_golden_text_and_provenance():
    gm = traced()
    before_graph, before_code = str(gm.graph), gm.code
    x = torch.randn(3, 4)
    result = PassManager([MulTwoToAdd(), DropAddZero()]).run(gm, example_inputs=(x,))
    out = result.graph_module
    assert result.modified
    assert str(out.graph) == dedent(
        """\
        graph():
            %x : [num_users=1] = placeholder[target=x]
            %lin : [num_users=1] = call_module[target=lin](args = (%x,), kwargs = {})
            %mul : [num_users=1] = call_function[target=operator.add](args = (%lin, %lin), kwargs = {})
            %relu : [num_users=1] = call_function[target=torch.relu](args = (%mul,), kwargs = {})
            return relu"""
    )
    assert "mul = lin + lin" in out.code
    records = out.meta["fxdist"]["passes"]
    assert [(r["name"], r["nodes_added"], r["nodes_erased"], r["modified"]) for r in records] == [
        ("mul-two-to-add", 0, 0, True),
        ("drop-add-zero", 0, 1, True),
    ]
    assert all(isinstance(r["ms"], float) and r["ms"] >= 0 for r in records)
    torch.testing.assert_close(out(x), gm(x))
    # the caller's module is untouched
    assert str(gm.graph) == before_graph and gm.code == before_code and "fxdist" not in gm.meta


def test_provenance_accumulates_over_runs():
    first = PassManager([MulTwoToAdd()]).run(traced()).graph_module
    second = PassManager([DropAddZero(), MulTwoToAdd()]).run(first).graph_module
    assert [r["name"] for r in second.meta["fxdist"]["passes"]] == ["mul-two-to-add", "drop-add-zero", "mul-two-to-add"]
    assert [r["modified"] for r in second.meta["fxdist"]["passes"]] == [True, True, False]
    assert len(first.meta["fxdist"]["passes"]) == 1  # the earlier result is not appended to


def test_failing_pass_leaves_input_unchanged_and_is_named():
    gm = traced()
    before = str(gm.graph)
    with pytest.raises(ValueError, match="boom after mutating") as info:
        PassManager([MulTwoToAdd(), MutateThenFail()]).run(gm)
    assert any("'mutate-then-fail' (2 of 2)" in note for note in info.value.__notes__)
    assert str(gm.graph) == before
    assert torch.relu in [n.target for n in gm.graph.nodes]


def test_lint_after_each_pass():
    gm = traced()
    before = str(gm.graph)
    with pytest.raises(RuntimeError, match=r"Graph.lint: %relu .* uses %stranger, which belongs to another graph") as info:
        PassManager([BreakLint()]).run(gm)
    assert any("'break-lint'" in note for note in info.value.__notes__)
    assert str(gm.graph) == before


def test_verify_outputs_catches_semantic_change():
    gm = traced()
    x = torch.randn(3, 4)
    with pytest.raises(PassVerificationError, match=r"'relu-to-sigmoid' changed the module's outputs: .*max abs"):
        PassManager([ReluToSigmoid()]).run(gm, example_inputs=(x,))
    # a pass that reports no modification is not checked; nor is anything with verify_outputs=False
    PassManager([ReluToSigmoid(report=False)]).run(gm, example_inputs=(x,))
    out = PassManager([ReluToSigmoid()], verify_outputs=False).run(gm, example_inputs=(x,)).graph_module
    assert torch.sigmoid in [n.target for n in out.graph.nodes]
    with pytest.raises(ValueError, match="needs example_inputs"):
        PassManager([ReluToSigmoid()], verify_outputs=True).run(gm)


def test_bad_return_and_plain_callables():
    gm = traced()
    with pytest.raises(TypeError, match="'returns-none' returned NoneType"):

        def returns_none(gm):
            return None

        returns_none.name = "returns-none"
        PassManager([returns_none]).run(gm)

    def retrace(gm):
        return PassResult(fx.Transformer(gm).transform(), True)

    out = PassManager([retrace]).run(gm, example_inputs=(torch.randn(2, 4),)).graph_module
    n = len(gm.graph.nodes)
    rec = out.meta["fxdist"]["passes"][0]
    assert (rec["name"], rec["nodes_added"], rec["nodes_erased"]) == ("retrace", n, n)
    with pytest.raises(TypeError, match="not a pass"):
        PassManager([42])


def test_docstring_example_runs():
    result = doctest.testmod(pass_base, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_verify_outputs_compares_structure_and_integer_outputs():
    gm = fx.symbolic_trace(lambda x: (x.argmax(dim=0), {"pos": x > 0}))
    x = torch.randn(4, 3)

    def flip_gt(gm):
        (gt,) = gm.graph.find_nodes(op="call_function", target=operator.gt)
        gt.target = operator.lt
        return PassResult(gm, True)

    flip_gt.name = "flip-gt"
    with pytest.raises(PassVerificationError, match=r"'flip-gt' changed the module's outputs: output leaf 1: torch.bool"):
        PassManager([flip_gt]).run(gm, example_inputs=(x,))

    def drop_dict(gm):
        (out,) = gm.graph.find_nodes(op="output")
        out.args = (out.args[0][0],)
        return PassResult(gm, True)

    drop_dict.name = "drop-dict"
    with pytest.raises(PassVerificationError, match="output structure changed"):
        PassManager([drop_dict]).run(gm, example_inputs=(x,))


def test_in_place_for_modules_that_cannot_be_copied():
    gm = traced()
    result = PassManager([MulTwoToAdd()]).run(gm, in_place=True)
    assert result.graph_module is gm and gm.meta["fxdist"]["passes"][0]["name"] == "mul-two-to-add"
    assert operator.mul not in [n.target for n in gm.graph.nodes]
    with pytest.raises(ValueError) as info:
        PassManager([MutateThenFail()])(gm, in_place=True)
    assert any("may be partly transformed" in note for note in info.value.__notes__)
