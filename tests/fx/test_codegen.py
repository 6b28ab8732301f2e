"""CodeGen: golden text against torch.fx, every template, signatures, freeing, constants, injection.

The same graph is built with ``fxdist.Graph`` and ``torch.fx.Graph`` (same API) and the generated
source compared. With ``CodeGen(fast_module_access=False)`` the text must be identical; with the
default, only ``call_module``/``get_attr`` module paths differ (documented in fxdist/codegen.py). The spelling of
Python objects in that source is fxdist/_pysource.py.
"""

from __future__ import annotations

import builtins
import collections
import enum
import math
import operator
import textwrap
import typing
from typing import Any, Dict, List, Optional, Tuple  # noqa: UP035 - torch.fx prints typing aliases

import pytest
import torch
import torch.fx

import fxdist as fx
from fxdist.codegen import CodeGen, PythonCode


def my_fn(x: Any) -> Any:
    return x


def build_mixed(G: type) -> Any:
    """A graph touching most code paths (annotations, defaults, every opcode but call_module)."""
    g = G()
    x = g.placeholder("x", type_expr=torch.Tensor)
    w = g.placeholder("w", type_expr=list[int])
    u = g.placeholder("u", type_expr=int | None)
    v = g.placeholder("v", type_expr=Dict[str, Any])  # noqa: UP006
    s = g.placeholder("s", type_expr="torch.Tensor")  # a string annotation (from __future__ annotations)
    g.placeholder("y", type_expr=List[int], default_value=3)  # noqa: UP006
    g.placeholder("z", type_expr=Optional[torch.Tensor], default_value=None)  # noqa: UP007
    a = g.call_function(operator.add, (x, 1.5))
    b = g.call_function(my_fn, (a,))
    d = g.call_function(math.sqrt, (2.0,))
    e = g.call_function(torch.relu, (b,), type_expr=torch.Tensor)
    f = g.call_function(torch.nn.functional.relu, (e,), {"inplace": False})
    h = g.call_function(getattr, (f, "shape"))
    i = g.call_function(operator.getitem, (h, 0))
    j = g.call_function(torch._C._nn.linear, (f, f))
    k = g.call_function(torch.ops.aten.add.Tensor, (j, j))
    m = g.call_method("clamp", (k,), {"min": 0.0, "max": float("inf")})
    g.call_function(torch.sum, (m,), {"dtype": torch.float32})
    n = g.call_function(torch.zeros, ((2, 3),), {"device": torch.device("cpu"), "layout": torch.strided})
    o = g.call_function(operator.neg, (n,))
    p = g.call_function(operator.getitem, (o, (slice(None, 2), Ellipsis, None)))
    q = g.call_function(operator.mul, (p, p))
    g.output((q, {"a": i, "b": [d, x, w, u, v, s]}), type_expr=Tuple[torch.Tensor, Dict[str, Any]])  # noqa: UP006
    return g


def build_modules(G: type) -> Any:
    g = G()
    x = g.placeholder("x")
    g.placeholder("*args")
    g.placeholder("**kwargs")
    g.get_attr("layer1.0.conv.weight")
    b = g.call_module("layer1.0.conv", (x,))
    g.get_attr("param")
    g.call_module("lin", (b,))
    g.output(None)
    return g


@pytest.mark.parametrize("build", [build_mixed, build_modules])
def test_compat_mode_text_identical_to_torch_fx(build: Any) -> None:
    ours = build(fx.Graph)
    theirs = build(torch.fx.Graph).python_code("self")
    compat = CodeGen(fast_module_access=False).gen_python_code(ours.nodes, "self")
    assert compat.src == theirs.src
    assert compat._lineno_map == theirs._lineno_map


def test_default_mode_differs_only_in_call_module_paths() -> None:
    ours = build_modules(fx.Graph).python_code("self").src
    theirs = build_modules(torch.fx.Graph).python_code("self").src
    differing = [(a, b) for a, b in zip(ours.splitlines(), theirs.splitlines()) if a != b]
    assert differing == [
        ("    layer1_0_conv = self._modules['layer1']._modules['0']._modules['conv'](x);  x = None",
         '    layer1_0_conv = getattr(self.layer1, "0").conv(x);  x = None'),
        ("    lin = self._modules['lin'](layer1_0_conv);  layer1_0_conv = lin = None",
         "    lin = self.lin(layer1_0_conv);  layer1_0_conv = lin = None"),
    ]
    # the mixed graph has no module access, so the default text equals torch.fx's there too
    assert build_mixed(fx.Graph).python_code("self").src == build_mixed(torch.fx.Graph).python_code("self").src


def test_seed_walkthrough_table() -> None:
    """The body lines generated for MyModule (the torch.fx documentation's example)."""
    g = fx.Graph()
    x = g.placeholder("x")
    param = g.get_attr("param")
    add = g.call_function(operator.add, (x, param))
    linear = g.call_module("linear", (add,))
    clamp = g.call_method("clamp", (linear,), {"min": 0.0, "max": 1.0})
    g.output(clamp)
    src = CodeGen(fast_module_access=False).gen_python_code(g.nodes, "self").src
    assert src == textwrap.dedent("""\



        def forward(self, x):
            param = self.param
            add = x + param;  x = param = None
            linear = self.linear(add);  add = None
            clamp = linear.clamp(min = 0.0, max = 1.0);  linear = None
            return clamp
            """) + "    "


def _run(g: Any, *args: Any, **kwargs: Any) -> Any:
    code = g.python_code("self")
    namespace = dict(code.globals)
    exec(compile(code.src, "<test>", "exec"), namespace)
    return namespace["forward"](None, *args, **kwargs)


BINARY = ["add", "sub", "mul", "floordiv", "truediv", "mod", "pow", "lshift", "rshift", "and_", "or_",
          "xor", "matmul", "eq", "ne", "lt", "gt", "le", "ge", "getitem"]
SYMBOL = {"add": "+", "sub": "-", "mul": "*", "floordiv": "//", "truediv": "/", "mod": "%", "pow": "**",
          "lshift": "<<", "rshift": ">>", "and_": "&", "or_": "|", "xor": "^", "matmul": "@", "eq": "==",
          "ne": "!=", "lt": "<", "gt": ">", "le": "<=", "ge": ">="}


@pytest.mark.parametrize("name", BINARY)
def test_binary_templates(name: str) -> None:
    fn = getattr(operator, name)
    for G in (fx.Graph, torch.fx.Graph):
        g = G()
        a, b = g.placeholder("a"), g.placeholder("b")
        g.output(g.call_function(fn, (a, b)))
        if G is fx.Graph:
            ours = g
        else:
            assert ours.python_code("self").src == g.python_code("self").src
    line = ours.python_code("self").src.splitlines()[4]
    node = list(ours.nodes)[2].name
    expected = f"{node} = a[b]" if name == "getitem" else f"{node} = a {SYMBOL[name]} b"
    assert line == f"    {expected};  a = b = None"
    if name == "matmul":
        x, y = torch.randn(2, 3), torch.randn(3, 2)
        assert torch.equal(_run(ours, x, y), x @ y)
    elif name == "getitem":
        assert _run(ours, [5, 6, 7], 1) == 6
    else:
        assert _run(ours, 7, 3) == fn(7, 3)


@pytest.mark.parametrize("name, text", [("neg", "-a"), ("pos", "+a"), ("invert", "~a")])
def test_unary_templates(name: str, text: str) -> None:
    g = fx.Graph()
    a = g.placeholder("a")
    g.output(g.call_function(getattr(operator, name), (a,)))
    assert f"{name} = {text};  a = None" in g.python_code("self").src
    assert _run(g, 5) == getattr(operator, name)(5)


def test_reflected_operands_and_negative_left_operand() -> None:
    g = fx.Graph()
    a = g.placeholder("a")
    r = g.call_function(operator.sub, (10, a))  # from Proxy.__rsub__
    p = g.call_function(operator.pow, (-2, a))  # would be -(2 ** a) without parentheses
    g.output((r, p))
    src = g.python_code("self").src
    assert "sub = 10 - a" in src and "pow_1 = (-2) ** a" in src
    assert _run(g, 3) == (7, -8)


def test_template_not_used_for_impostor_or_wrong_arity() -> None:
    def add(x: int, y: int) -> int:  # claims to be operator.add
        return x * y
    add.__module__ = "_operator"
    g = fx.Graph()
    a = g.placeholder("a")
    s = g.call_function(add, (a, 3))
    t = g.call_function(operator.add, (a,), {})
    g.output((s, g.call_function(operator.not_, (a,)), g.call_function(operator.iadd, ([1], [2]))))
    g.erase_node(t)
    src = g.python_code("self").src
    assert " a + 3" not in src and "operator.not_(a)" in src and "iadd = [1];  iadd += [2]" in src
    assert _run(g, 4) == (12, False, [1, 2])


def test_placeholder_defaults_varargs_kwargs_and_annotations() -> None:
    g = fx.Graph()
    x = g.placeholder("x", type_expr=torch.Tensor)
    y = g.placeholder("y", type_expr=int, default_value=3)
    args = g.placeholder("*args")
    kwargs = g.placeholder("**kwargs")
    out = g.call_function(operator.add, (x, y), type_expr=torch.Tensor)
    g.output((out, args, kwargs), type_expr=tuple)
    src = g.python_code("self").src
    assert "def forward(self, x : torch.Tensor, y : int = 3, *args, **kwargs) -> tuple:" in src
    assert "add : torch.Tensor = x + y" in src
    assert "_args = args" in src and "_kwargs = kwargs" in src
    t = torch.ones(2)
    res, rest, kw = _run(g, t, 4, 5, 6, k=1)
    assert torch.equal(res, t + 4) and rest == (5, 6) and kw == {"k": 1}
    assert torch.equal(_run(g, t)[0], t + 3)


def test_values_freed_after_last_use_and_unused_values_freed_at_once() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.neg, (x,))
    g.call_function(print, ("side effect",))  # no users: freed on its own line
    b = g.call_function(operator.add, (a, x))
    g.output(b)
    lines = g.python_code("self").src.splitlines()
    assert lines[4:7] == ["    neg = torch.neg(x)",
                          "    print_1 = print('side effect');  print_1 = None",
                          "    add = neg + x;  neg = x = None"]


class Color(enum.Enum):
    RED = 1


Point = collections.namedtuple("Point", ["x", "y"])

CONSTANTS = [None, True, 0, -7, 2**70, 3**20_000, 1.5, -0.0, math.inf, -math.inf, complex(1, -2), complex(math.inf, 1),
             "s", "quote ' \" \\ \n \x00 \u2028", b"\x00\xff'", slice(1, None, -1), range(2, 9, 3), Ellipsis,
             torch.float16, torch.device("cpu"), torch.device("cuda", 1), torch.sparse_coo, torch.channels_last,
             Color.RED, Point(1, (2, 3)), (), (1,), [1, [2.5, None]], {"k": [1], 2: "v"}, torch.Size([2, 3])]


@pytest.mark.parametrize("value", CONSTANTS, ids=[f"{type(c).__name__}{i}" for i, c in enumerate(CONSTANTS)])
def test_constants_round_trip(value: Any) -> None:
    g = fx.Graph()
    g.output(value)
    got = _run(g)
    assert got == value and type(got) is (tuple if type(value) is torch.Size else type(value))
    if isinstance(value, float) and value == 0:
        assert math.copysign(1, got) == -1


def test_nan_and_arbitrary_objects_round_trip() -> None:
    obj, tensor = object(), torch.randn(3)
    g = fx.Graph()
    g.output((math.nan, obj, tensor, [obj]))
    code = g.python_code("self")
    nan, got_obj, got_tensor, [again] = _run(g)
    assert math.isnan(nan) and got_obj is obj and got_tensor is tensor and again is obj
    assert sum(v is obj for v in code.globals.values()) == 1  # one global per object


def test_callables_are_spelled_by_verified_paths_or_registered() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.Tensor.add, (x, x))
    b = g.call_function(len, ([1, 2],))
    c = g.call_function(my_fn, (a,))
    g.output((c, b))
    code = g.python_code("self")
    assert "torch.Tensor.add(x, x)" in code.src and "len([1, 2])" in code.src
    assert f"{__name__.replace('.', '_')}_my_fn(add)" in code.src
    assert code.globals[f"{__name__.replace('.', '_')}_my_fn"] is my_fn


def test_lineno_map_points_at_the_emitting_node() -> None:
    g = build_mixed(fx.Graph)
    code = g.python_code("self")
    lines = code.src.splitlines()
    nodes = list(g.nodes)
    for offset, index in code._lineno_map.items():
        line = lines[code._prologue_start - 1 + offset] if code._prologue_start - 1 + offset < len(lines) else ""
        if line.strip() and not line.strip().startswith("return"):
            assert line.strip().startswith(nodes[index].name)
    assert lines[code._prologue_start - 1].startswith("def forward(")


def test_verbose_stack_trace_comments_and_tensor_annotations() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.relu, (x,))
    a.meta["stack_trace"] = 'File "model.py", line 12, in forward\n    return torch.relu(x)\n'
    a.meta["val"] = torch.empty(2, 3)
    b = g.call_function(torch.neg, (a,))
    g.output(b)
    src = g.python_code("self", verbose=True, include_stride=True).src
    assert "    # File: model.py:12 in forward, code: return torch.relu(x)\n" in src
    assert '    relu: "f32[2, 3][3, 1]" = torch.relu(x);  x = None' in src
    assert "# No stacktrace found for following nodes" in src


def build_verbose(G: type) -> Any:
    g = G()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2, 3)
    a = g.call_function(torch.relu, (x,))
    a.meta["stack_trace"] = 'File "m.py", line 3, in forward\n    y = torch.relu(x)\n'
    a.meta["val"] = torch.empty(2, 3)
    b = g.call_function(operator.add, (a, 1))
    b.meta["stack_trace"] = a.meta["stack_trace"]
    c = g.call_method("sum", (b,))
    c.meta["stack_trace"] = 'File "m.py", line 4, in forward\n    return y.sum()\n'
    g.output(g.call_function(torch.neg, (c,)))
    return g


@pytest.mark.parametrize("options", [{}, {"include_stride": True, "include_device": True}])
def test_verbose_text_identical_to_torch_fx(options: dict[str, bool]) -> None:
    ours = build_verbose(fx.Graph).python_code("self", verbose=True, **options).src
    assert ours == build_verbose(torch.fx.Graph).python_code("self", verbose=True, **options).src
    assert "    \n    # File: m.py:4 in forward, code: return y.sum()\n" in ours


def test_custom_codegen_hooks() -> None:
    class MyCodeGen(CodeGen):
        def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str) -> str:
            return f"def forward(self, {', '.join(free_vars)}, extra=1){maybe_return_annotation}:"

        def generate_output(self, output_args: Any, *, repr_fn: Any = repr) -> str:
            return f"return ({repr_fn(output_args)}, extra)"

        def additional_globals(self) -> list[tuple[str, Any]]:
            return [("extra_a", None), ("extra_b", None)]  # the same object under two names

    g = fx.Graph()
    g.set_codegen(MyCodeGen())
    g.output(g.placeholder("x"))
    assert _run(g, 5) == (5, 1)
    code = g.python_code("self")
    assert isinstance(code, PythonCode) and code.globals["extra_a"] is None and "extra_b" in code.globals
    g.placeholder("extra_a")
    with pytest.raises(ValueError, match="extra_a"):
        g.python_code("self")


# -- injection ------------------------------------------------------------------------------------
HOSTILE = ["x; import os", "__import__('os')", "a'); fxdist_sentinel(); ('", 'a"); fxdist_sentinel(); ("',
           "a\nfxdist_sentinel()", "a\\", "fxdist_sentinel()", "a\r\nfxdist_sentinel()#", "class", "\u2028x",
           "ﬁ"]


@pytest.fixture
def sentinel(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``fxdist_sentinel()`` is callable from any code; the list records every call."""
    hits: list[str] = []
    monkeypatch.setattr(builtins, "fxdist_sentinel", lambda *a: hits.append("executed"), raising=False)
    return hits


@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_node_names_cannot_inject(hostile: str, sentinel: list[str]) -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.create_node("call_function", operator.add, (x, 1), name=hostile)
    b = g.call_function(operator.mul, (a, 2))
    b.name = hostile + "_forced"  # bypass the graph's namespace: codegen must still sanitize
    g.output((a, b))
    assert _run(g, 3) == (4, 8)
    assert not sentinel


@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_targets_and_constants_cannot_inject(hostile: str, sentinel: list[str]) -> None:
    buf, sub = torch.arange(3.0), torch.nn.ReLU()
    g = fx.Graph()
    x = g.placeholder("x")
    got = g.create_node("get_attr", f"holder.{hostile}")
    called = g.create_node("call_module", hostile, (x,))
    method = g.create_node("call_method", hostile, (x,))
    g.output((got, called, hostile, method))
    gm = fx.GraphModule({f"holder.{hostile}": buf, hostile: sub}, g)
    with pytest.raises(AttributeError):  # the hostile method name is looked up, never executed
        gm(torch.tensor([-1.0, 2.0]))
    g.erase_node(g.output_node())
    g.erase_node(method)
    g.output((got, called, hostile))
    gm.recompile()
    out = gm(torch.tensor([-1.0, 2.0]))
    assert out[0] is buf and torch.equal(out[1], torch.tensor([0.0, 2.0])) and out[2] == hostile
    assert not sentinel


class HostileRepr(str):
    def __repr__(self) -> str:
        return "fxdist_sentinel()"


def test_hostile_reprs_names_and_types_cannot_inject(sentinel: list[str]) -> None:
    def fn(v: Any, **kw: Any) -> Any:
        return (v, kw)
    fn.__name__ = fn.__qualname__ = "relu; fxdist_sentinel()"
    fn.__module__ = "torch"
    Evil = type("Evil; fxdist_sentinel()", (), {"__repr__": lambda self: "fxdist_sentinel()"})
    Evil.__module__ = "builtins"
    evil, text = Evil(), HostileRepr("plain")
    g = fx.Graph()
    x = g.placeholder("x", type_expr=Evil)
    y = g.call_function(fn, (x,), {"not an identifier": text, "ok": evil}, type_expr=Evil)
    y.meta["stack_trace"] = 'File "f.py", line 1, in f\n    a\nfxdist_sentinel()\n'
    g.output(y, type_expr=Evil)
    for verbose in (False, True):
        code = g.python_code("self", verbose=verbose)
        ns = dict(code.globals)
        exec(compile(code.src, "<test>", "exec"), ns)
        value, kw = ns["forward"](None, 5)
        assert value == 5 and kw["not an identifier"] is text and kw["ok"] is evil
    assert not sentinel


@pytest.mark.parametrize("target", ["x; fxdist_sentinel()", "*", "***x", "a b", "self"])
def test_bad_placeholder_targets_rejected(target: str) -> None:
    g = fx.Graph()
    g.output(g.placeholder(target))
    with pytest.raises(ValueError, match="placeholder"):
        g.python_code("self")


def test_parameter_names_are_never_overwritten_by_other_nodes() -> None:
    g = fx.Graph()
    a = g.placeholder("y")
    b = g.placeholder("x")
    a.name, b.name = "x", "x_1"  # node "x" reads parameter y; node "x_1" reads parameter x
    g.output((a, b))
    src = g.python_code("self").src
    assert "def forward(self, y, x):" in src and "\n    x = " not in src  # naive text: x = y; x_1 = x
    assert _run(g, 1, 2) == (1, 2)


def test_parameter_shadowing_a_needed_global_is_rejected() -> None:
    g = fx.Graph()
    t = g.placeholder("torch")
    g.output(g.call_function(torch.relu, (t,)))
    with pytest.raises(ValueError, match="shadow"):
        g.python_code("self")


def test_foreign_node_argument_is_a_clear_error() -> None:
    other = fx.Graph()
    foreign = other.placeholder("w")
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(operator.add, (x, foreign)))
    with pytest.raises(RuntimeError, match="not among the nodes"):
        g.python_code("self")


def test_typing_generics_annotations_compile() -> None:
    g = fx.Graph()
    a = g.placeholder("a", type_expr=typing.Callable[..., int])
    b = g.placeholder("b", type_expr=tuple[()])
    c = g.placeholder("c", type_expr=dict[str, list[torch.Tensor]] | None)
    g.output((a, b, c), type_expr=typing.Any)
    assert _run(g, 1, 2, 3) == (1, 2, 3)
