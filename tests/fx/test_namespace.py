"""Namespace: unique valid identifiers, numbered exactly as torch.fx numbers them."""

from __future__ import annotations

import builtins
import keyword

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.graph import _Namespace as TorchNamespace

from fxdist._namespace import RESERVED_NAMES, Namespace, sanitize

_CANDIDATES = st.sampled_from([
    "add", "add_1", "add_2", "add_10", "add_01", "x", "x_1_2", "input", "list", "for", "torch", "inf",
    "layer1.0.conv", "0", "", "a-b", "getitem", "getitem_3", "_", "__name__", "relu_", "é",
])


@settings(max_examples=100, deadline=None)
@given(st.lists(_CANDIDATES, max_size=30))
def test_same_names_as_torch_fx_for_any_request_sequence(candidates: list[str]) -> None:
    ours, theirs = Namespace(), TorchNamespace()
    got = [ours.create_name(c, None) for c in candidates]
    assert got == [theirs.create_name(c, None) for c in candidates]
    assert len(set(got)) == len(got)
    assert all(n.isidentifier() and not keyword.iskeyword(n) for n in got)
    assert not set(got) & RESERVED_NAMES


def test_numbering_examples() -> None:
    ns = Namespace()
    got = [ns.create_name(c, None) for c in ["add", "add", "add_5", "add", "add_5", "input", "layer1.0"]]
    assert got == ["add", "add_1", "add_5", "add_6", "add_7", "input_1", "layer1_0"]
    assert "add_6" in ns and "add_3" not in ns


def test_objects_keep_their_name_and_may_claim_their_own_builtin() -> None:
    ns = Namespace()
    obj = object()
    assert ns.create_name("thing", obj) == "thing"
    assert ns.create_name("other", obj) == "thing"
    assert ns.create_name("getattr", getattr) == "getattr"     # the builtin itself may use its name
    assert ns.create_name("getattr", None) == "getattr_1"
    assert ns.create_name("torch", torch) == "torch"
    assert ns.create_name("self", None) == "self_1"           # the forward's first parameter
    unhashable = [1]
    assert ns.create_name("lst", unhashable) == "lst" == ns.create_name("x", unhashable)


def test_associate_and_rename() -> None:
    ns = Namespace()
    a, b = object(), object()
    name = ns.create_name("a", None)
    ns.associate_name_with_obj(name, a)
    assert ns.create_name("zzz", a) == "a"
    with pytest.raises(RuntimeError, match="already named 'a'"):
        ns.associate_name_with_obj("b", a)
    ns.rename_object(a, "alpha")
    assert "alpha" in ns and "a" not in ns and ns.create_name("q", a) == "alpha"
    with pytest.raises(RuntimeError, match="already taken or reserved"):
        ns.rename_object(b, "alpha")
    with pytest.raises(RuntimeError, match="already taken or reserved"):
        ns.rename_object(b, "len")
    ns.release("alpha", a)
    assert "alpha" not in ns and ns.create_name("alpha", None) == "alpha"


def test_sanitize_and_reserved() -> None:
    assert sanitize("layer1.0.conv") == "layer1_0_conv"
    assert sanitize("0abc") == "_0abc" and sanitize("") == "_unnamed" and sanitize("a b;c") == "a_b_c"
    assert set(keyword.kwlist) <= RESERVED_NAMES and "print" in RESERVED_NAMES
    assert {"torch", "inf", "nan", "device", "NoneType", "self"} <= RESERVED_NAMES
    assert {"print", "len", "input", "list", "getattr", "__name__"} <= RESERVED_NAMES
    assert len(set(dir(builtins)) - RESERVED_NAMES) < 5  # other code may add builtins after import


def test_node_rename_keeps_old_name_used() -> None:
    from fxdist.graph import Graph

    g = Graph()
    x = g.placeholder("x")
    x._rename("inp")
    assert x.name == "inp"
    assert g.placeholder("x").name == "x_1"       # as torch.fx: the old name is never reused
    assert g.placeholder("inp").name == "inp_1"
    g.lint()


def test_assigning_node_name_reserves_it() -> None:
    from fxdist.graph import Graph

    g = Graph()
    x = g.placeholder("x")
    x.name = "foo"                                # direct assignment, as passes do
    assert g.placeholder("foo").name == "foo_1"   # torch.fx would hand out "foo" again
    g.lint()
