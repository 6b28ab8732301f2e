"""Python source generation for fxdist graphs: ``CodeGen`` and ``PythonCode``.

Source: torch/fx/graph.py (``CodeGen._gen_python_code``) and the torch.fx paper, section 4.3: one
``name = expression`` line per node, each value freed after its last use (``x = param = None``), and a
dict of globals for everything the text cannot spell by itself. Written anew and split per opcode
and per concern (names, constants, callables, types).

Safety: nothing stored in a graph can inject code into the generated source.

* Node names are registered in a fresh ``Namespace``; a name that is not a valid, unused identifier
  is replaced by a sanitized one, so ``"x; import os"`` can never reach the text.
* Attribute and method names are emitted with ``.`` only when they are plain ASCII identifiers and
  not keywords; anything else becomes ``getattr(obj, 'escaped')``.
* Constants are emitted with ``repr`` only for exact safe types (None, bool, int, float, complex, str,
  bytes, slice, range, Ellipsis, torch.dtype/device/layout/memory_format, enum members, and tuples,
  lists, dicts of these); any other object (a tensor, a ``str`` subclass...) becomes a global.
* Callables are spelled by a dotted path (``torch.relu``, ``operator.not_``, ``len``) only after the
  path has been walked and found to be the very same object; otherwise they become a global under a
  sanitized unique name (``__main___my_fn``). An attacker-chosen ``__name__``/``__module__`` is never
  emitted.

Documented differences from torch.fx 2.13's text (everything else is identical, see
tests/fx/test_codegen.py):

1. ``call_module`` reaches its submodule through ``_modules`` (``self._modules['layer1']._modules['0'](x)``)
   instead of ``getattr(self.layer1, "0")(x)``: ``nn.Module.__getattr__`` costs about 1 µs per step on
   the CI machine, the dict lookup about 50 ns, and the lookup still happens at call time, so a
   submodule replaced on the GraphModule is seen without ``recompile()``. A ``call_module`` target is
   a submodule path, so every component is in its parent's ``_modules``. ``get_attr`` keeps
   torch.fx's attribute chain (its parents may be plain objects; get_attr nodes are few).
   ``CodeGen(fast_module_access=False)`` emits torch.fx's form everywhere; ``torch.jit.script`` gets
   that form (``GraphModule.__prepare_scriptable__``).
2. ``operator`` functions without a template are called as ``operator.not_(x)``. In-place operators
   print as ``iadd = x;  iadd += y`` (torch.fx: ``x += y;  iadd = x``, which rebinds ``x``, so a later
   user of an int ``x`` sees the sum: eager and torch.fx's own Interpreter do not) and ``setitem`` as
   ``x[i] = v;  setitem = None`` (torch.fx binds ``x``; ``operator.setitem`` returns None).
3. ``torch.Tensor.add`` used as a function is spelled ``torch.Tensor.add``.
4. Constants without a valid-Python ``repr`` become globals (torch.fx emits invalid text for them).
5. No ``wrap("fn")`` statements: fxdist pickles the graph, it never re-traces the generated code.
"""

from __future__ import annotations

import builtins
import enum
import inspect
import math
import operator
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable, cast

import torch
from torch.utils._dtype_abbrs import dtype_abbrs

from fxdist._body_lines import transformed_lines
from fxdist._namespace import RESERVED_NAMES, Namespace, sanitize

# ruff's isort would put one name a line here: over the 600-line module limit
# isort: off
from fxdist._pysource import (DIGITS_OR_WORD, FIXED_GLOBALS, INPLACE_OPERATORS, OPERATOR_TEMPLATES, ORIGIN_TYPING, TIGHT_LEFT,
                              TORCH_SINGLETONS, is_plain_ident, one_line_comment, qualified_hint, safe_attr, snake_case,
                              stack_summary, torch_path, torch_path_of_singleton)
# isort: on
from fxdist.node import Node

__all__ = ["CodeGen", "PythonCode"]


@dataclass
class PythonCode:
    """Everything needed to ``exec`` or save a graph as Python code.

    Source: torch/fx/graph.py ``PythonCode``.
    """

    src: str
    """Source of ``def forward(...)`` at top-level indentation."""
    globals: dict[str, Any]
    """Names the source refers to (beyond builtins) -> the objects they denote."""
    _lineno_map: dict[int, int | None] | None
    """Line number relative to the ``def`` line (which is 0) -> index of the node that emitted it."""
    _prologue_start: int = 0
    """1-based line of ``src`` holding the ``def``; ``src`` line L belongs to node
    ``_lineno_map[L - _prologue_start]``."""


class _Emitter:
    """Per-call state of one code generation: names, globals, body lines."""

    def __init__(self, codegen: CodeGen, nodes: list[Node], root_module: str, verbose: bool) -> None:
        self.codegen = codegen
        self.nodes = nodes
        self.root = root_module
        self.verbose = verbose
        self.namespace = Namespace()
        self.globals: dict[str, Any] = dict(FIXED_GLOBALS)
        self.names: dict[Node, str] = {}
        self.free_vars: list[str] = []
        self.lines: list[str] = []
        self.line_nodes: list[int | None] = []
        self.return_annotation = ""
        self.bare_names: set[str] = set()  # builtins and fixed globals the text relies on
        self.param_names: set[str] = set()
        self._callables: dict[int, str] = {}
        self._prev_summary: str | None = None
        self.include_stride = self.include_device = False

    # -- names ---------------------------------------------------------------------------------
    def register_names(self) -> None:
        """Parameter names first, so no other node can take one (its value would be overwritten
        before the placeholder reads it); then node names, which are normally unique identifiers
        already and come out unchanged."""
        create = self.namespace.create_name
        names = self.names
        for node in self.nodes:
            if node.op == "placeholder":
                raw = self._param_name(node)
                if raw == node.name:
                    names[node] = create(raw, node)
                elif raw not in RESERVED_NAMES and raw not in self.namespace:
                    create(raw, None)
        for node in self.nodes:
            if node not in names:
                names[node] = create(node.name, node)

    def _param_name(self, node: Node) -> str:
        """The parameter name of a placeholder (target without ``*``/``**``), validated."""
        target = node.target
        raw = target.lstrip("*") if isinstance(target, str) else None
        if raw is None or not is_plain_ident(raw) or len(cast(str, target)) - len(raw) > 2:
            raise ValueError(f"placeholder {node.name!r} has target {target!r}; a placeholder target must be "
                             "a parameter name (an identifier, optionally prefixed with * or **)")
        if raw == "self":
            raise ValueError(f"placeholder {node.name!r}: 'self' is the module parameter of forward; rename it")
        if raw in self.param_names:
            raise ValueError(f"placeholder {node.name!r}: parameter name {raw!r} is used twice")
        self.param_names.add(raw)
        return raw

    def name_of(self, node: Node) -> str:
        try:
            return self.names[node]
        except KeyError:
            raise RuntimeError(f"node {node.name!r} ({node.op}) is used as an argument but is not among the "
                               "nodes being generated; it belongs to another graph or was erased") from None

    def bare(self, name: str) -> str:
        """Record that the text relies on the builtin/fixed global ``name`` (or a dotted path from it)."""
        self.bare_names.add(name.split(".", 1)[0])
        return name

    def add_global(self, hint: str, obj: Any) -> str:
        """Register ``obj`` as a global under a fresh identifier derived from ``hint``."""
        name = self.namespace.create_name(hint, obj)
        existing = self.globals.get(name, obj)
        if existing is not obj:  # the namespace keys objects by identity, so this is a bug
            raise AssertionError(f"global {name!r} already denotes {existing!r}")
        self.globals[name] = obj
        return name

    def add_fixed_global(self, name: str, obj: Any) -> None:
        """Register ``obj`` under exactly ``name`` (for ``CodeGen.additional_globals``).

        Raises:
            ValueError: ``name`` is not an identifier, or is already a node, parameter or global name.
        """
        if name in ("pytree", "fx_pytree"):  # reserved for a pytree CodeGen's helpers, as in torch.fx
            self.globals[name] = obj
            return
        if not is_plain_ident(name) or name in RESERVED_NAMES or name in self.namespace:
            raise ValueError(f"additional global {name!r} is not a free identifier in the generated code "
                             "(it is reserved, or a node/parameter already has that name)")
        self.namespace.create_name(name, None)
        self.globals[name] = obj

    # -- callables and types -------------------------------------------------------------------
    def callable_ref(self, fn: Any) -> str:
        """Text that evaluates to exactly ``fn``."""
        key = id(fn)
        ref = self._callables.get(key)
        if ref is None:
            ref = self._callable_ref(fn)
            self._callables[key] = ref
        return self.bare(ref)

    def _callable_ref(self, fn: Any) -> str:
        name = safe_attr(fn, "__name__")
        if is_plain_ident(name):
            if getattr(builtins, name, None) is fn:
                return name
            if getattr(operator, name, None) is fn:
                return f"operator.{name}"
        if fn is torch.device:
            return "device"
        path = torch_path(fn)
        if path is not None:
            return path
        return self.add_global(qualified_hint(fn), fn)

    def type_ref(self, tp: Any) -> str:
        """Text for a type annotation (evaluated at ``def`` time for parameters and returns)."""
        if type(tp) is tuple and not tp:
            return "()"
        if tp is Ellipsis:
            return "..."
        if isinstance(tp, types.UnionType):
            return "|".join(self.type_ref(a) for a in typing.get_args(tp))
        origin = safe_attr(tp, "__origin__")
        if origin is not None:
            if isinstance(tp, typing._GenericAlias):  # type: ignore[attr-defined]
                origin = ORIGIN_TYPING.get(origin, origin)
            head = self._type_head(origin)
            args = typing.get_args(tp)
            return f"{head}[{','.join(self.type_ref(a) for a in args)}]" if args else head
        return self._type_head(tp)

    def _type_head(self, tp: Any) -> str:
        if isinstance(tp, type):
            if tp.__module__ == "builtins" and cast(object, getattr(builtins, tp.__qualname__, None)) is tp:
                return self.bare(tp.__qualname__)
            if tp is type(None):
                return self.bare("NoneType")
            path = torch_path(tp)
            if path is not None:
                return self.bare(path)
            return self.add_global(f"{tp.__module__}.{tp.__qualname__}", tp)
        hint = repr(tp) if isinstance(tp, str) else getattr(tp, "_name", None) or type(tp).__name__
        module = getattr(tp, "__module__", None)
        if module == "typing" and isinstance(hint, str):
            hint = f"typing.{hint}"
        return self.add_global(hint, tp)

    # -- constants and arguments ---------------------------------------------------------------
    def arg(self, a: Any) -> str:
        """Text that evaluates to the argument ``a`` (Nodes by name, containers recursively)."""
        t = type(a)
        if t is Node:
            return self.name_of(a)
        if t is str or t is bool or a is None or t is bytes or (t is int and a.bit_length() < 10_000):
            return repr(a)  # (a longer int has no repr under Python's int/str conversion limit)
        if t is float:
            return self._float(a)
        if t is tuple:
            return f"({self.arg(a[0])},)" if len(a) == 1 else f"({', '.join(map(self.arg, a))})"
        if isinstance(a, Node):
            return self.name_of(a)
        return self._other_arg(a)

    def _float(self, a: float) -> str:
        text = repr(a)  # 'inf', '-inf', 'nan' resolve through the inf/nan globals
        if not math.isfinite(a):
            self.bare_names.add("nan" if math.isnan(a) else "inf")
        return text

    def _other_arg(self, a: Any) -> str:
        if isinstance(a, list):
            return f"[{', '.join(map(self.arg, a))}]"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{self.arg(k)}: {self.arg(v)}" for k, v in a.items()) + "}"
        if isinstance(a, tuple):
            body = ", ".join(map(self.arg, a))
            if hasattr(type(a), "_fields"):  # namedtuple: rebuild through its class
                return f"{self.callable_ref(type(a))}({body})"
            return f"({self.arg(a[0])},)" if len(a) == 1 else f"({body})"
        if type(a) is slice:
            return f"slice({self.arg(a.start)}, {self.arg(a.stop)}, {self.arg(a.step)})"
        if type(a) is complex:
            if math.isfinite(a.real) and math.isfinite(a.imag):
                return repr(a)
            return f"complex({self._float(a.real)}, {self._float(a.imag)})"
        if type(a) is range or a is Ellipsis:
            return repr(a)
        if isinstance(a, TORCH_SINGLETONS):
            path = torch_path_of_singleton(a)
            if path is not None:
                return self.bare(path)
        elif type(a) is torch.device:
            index = "" if a.index is None else f", index={a.index!r}"
            return f"{self.bare('device')}(type={a.type!r}{index})"
        elif isinstance(a, enum.Enum) and is_plain_ident(a.name) and cast(object, getattr(type(a), a.name, None)) is a:
            return f"{self.callable_ref(type(a))}.{a.name}"
        return self.add_global(f"_{snake_case(sanitize(type(a).__name__))}_constant", a)

    def call_args(self, args: tuple, kwargs: dict[str, Any]) -> str:
        parts = [self.arg(a) for a in args]
        odd = {}
        for key, value in kwargs.items():
            if is_plain_ident(key):
                parts.append(f"{key} = {self.arg(value)}")
            else:
                odd[key] = value
        if odd:
            parts.append(f"**{self.arg(odd)}")
        return ", ".join(parts)

    def operand(self, a: Any) -> str:
        """An argument used as the receiver of ``.attr``/``[...]``: constants get parentheses."""
        return self.name_of(a) if isinstance(a, Node) else f"({self.arg(a)})"

    def attr_path(self, base: str, target: str, modules: int) -> str:
        """``base.a.b``; the first ``modules`` components are read from ``_modules`` in fast mode."""
        fast = self.codegen.fast_module_access
        for i, part in enumerate(target.split(".")):
            if fast and i < modules:
                base = f"{base}._modules[{part!r}]"
            elif is_plain_ident(part):
                base = f"{base}.{part}"
            elif DIGITS_OR_WORD.match(part):
                base = f'{self.bare("getattr")}({base}, "{part}")'
            else:
                base = f"{self.bare('getattr')}({base}, {part!r})"
        return base

    def method_ref(self, receiver: str, name: Any) -> str:
        if not isinstance(name, str):
            raise TypeError(f"call_method target must be a str method name, got {name!r}")
        if is_plain_ident(name):
            return f"{receiver}.{name}"
        return f"{self.bare('getattr')}({receiver}, {name!r})"


class CodeGen:
    """Turns a graph's node list into the source of ``def forward(self, ...)``.

    Subclasses may override ``gen_fn_def``, ``generate_output``, ``process_inputs``,
    ``process_outputs`` and ``additional_globals`` as in torch.fx.

    Args:
        fast_module_access: reach submodules through ``_modules[...]`` (default) instead of
            attribute chains; see the module docstring.

    Source: torch/fx/graph.py ``CodeGen``.
    """

    fast_module_access: bool = True  # (a class default too: torch.fx subclasses may skip __init__)

    def __init__(self, *, fast_module_access: bool = True) -> None:
        self._body_transformer: Callable[[list[str]], list[str]] | None = None
        self._func_name: str = "forward"
        self.fast_module_access = fast_module_access

    # -- torch.fx customisation hooks ----------------------------------------------------------
    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str, *, expanded_def: bool = False) -> str:
        """``def forward(self, a, b) -> T:``; inserts ``self`` when missing. With ``expanded_def``
        one parameter a line, as torch.fx formats it."""
        if not free_vars or free_vars[0] != "self":
            free_vars.insert(0, "self")
        if expanded_def:
            params = "".join(_multiline_item(v) for v in free_vars)
            return f"def {self._func_name}(\n{params}){maybe_return_annotation}:"
        return f"def {self._func_name}({', '.join(free_vars)}){maybe_return_annotation}:"

    def generate_output(self, output_args: Any, *, descs: list[str] | None = None,
                        repr_fn: Callable[[Any], str] | None = None) -> str:
        """The ``return ...`` statement (not indented); with ``descs`` (one per item of a list or
        tuple output) one item a line, each followed by ``# desc``, as torch.fx formats it.

        Overrides may omit ``descs``/``repr_fn``: like torch.fx, fxdist passes only the keyword
        arguments an override's signature names.
        """
        repr_fn = repr if repr_fn is None else repr_fn
        if descs is not None and isinstance(output_args, (list, tuple)):
            left, right = ("(", ")") if isinstance(output_args, tuple) else ("[", "]")
            items = "".join(f"    {repr_fn(item)},  # {desc}\n" for item, desc in zip(output_args, descs))
            return f"return {left}\n{items}{right}"
        return f"return {repr_fn(output_args)}"

    def process_inputs(self, *args: Any) -> Any:
        return args

    def process_outputs(self, outputs: Any) -> Any:
        return outputs

    def additional_globals(self) -> list[tuple[str, Any]]:
        return []

    # -- generation ----------------------------------------------------------------------------
    def gen_python_code(self, nodes: Iterable[Node], root_module: str, *, verbose: bool = False,
                        include_stride: bool = False, include_device: bool = False,
                        colored: bool = False) -> PythonCode:
        """Generate the source and globals of ``forward`` for ``nodes`` (in execution order).

        Args:
            nodes: the graph's nodes, placeholders first and the output node last.
            root_module: the name the generated code uses for the module (normally ``"self"``).
            verbose: add ``# File: ...`` comments from ``node.stack_trace`` and tensor annotations
                such as ``: "f32[2, 3]"`` from ``node.meta["val"]``/``["tensor_meta"]``.
            include_stride: verbose annotations also show strides (``"f32[2, 3][3, 1]"``).
            include_device: verbose annotations also show the device (``"f32[2, 3]cpu"``).
            colored: accepted for torch.fx compatibility; fxdist never emits terminal colours.

        Returns:
            PythonCode with ``src``, ``globals`` and the line map.

        Raises:
            ValueError: a placeholder's target is not a usable parameter name, or a parameter name
                would shadow a global the body needs.
            RuntimeError: a node uses a node that is not in ``nodes``.
        """
        em = _Emitter(self, list(nodes), root_module, verbose)
        em.include_stride, em.include_device = include_stride, include_device
        em.register_names()
        for name, value in self.additional_globals():
            em.add_fixed_global(name, value)
        ops = [node.op for node in em.nodes]
        dels = _deletions(em.nodes, ops)
        emit = {"placeholder": self._emit_placeholder, "call_function": self._emit_call_function,
                "call_method": self._emit_call_method, "call_module": self._emit_call_module,
                "get_attr": self._emit_get_attr, "output": self._emit_output}
        for index, (node, op) in enumerate(zip(em.nodes, ops)):
            fn = emit.get(op)
            if fn is None:
                raise RuntimeError(f"node {node.name!r} has unknown opcode {op!r}")
            if verbose:
                _emit_summary(em, node, index)
            stmt = fn(em, node, _annotation(em, node))
            if stmt is None:
                continue
            gone = dels.get(node)
            if gone:
                stmt = f"{stmt};  {' = '.join(em.names[n] for n in gone)} = None"
            em.lines.append(stmt)
            em.line_nodes.append(index)
        return self._assemble(em)

    def _assemble(self, em: _Emitter) -> PythonCode:
        clash = em.param_names & (em.bare_names | (set(em.globals) - set(FIXED_GLOBALS)))
        if clash:
            raise ValueError(f"placeholder parameter name(s) {sorted(clash)} would shadow names the generated "
                             "code needs; rename the placeholder target(s)")
        lines, line_nodes = em.lines or ["pass"], em.line_nodes if em.lines else cast(list[int | None], [None])
        if self._body_transformer is not None:  # keeps the line map as torch.fx does (see _body_lines)
            lines, line_nodes = transformed_lines(lines, line_nodes, self._body_transformer(lines))
        prologue = self.gen_fn_def(em.free_vars, em.return_annotation)
        offset = prologue.count("\n") + 1
        if any("\n" in line for line in lines):  # a multi-line statement: indent and map each line
            pairs = [(part, index) for line, index in zip(lines, line_nodes) for part in line.split("\n")]
            lines, line_nodes = [p for p, _ in pairs], [i for _, i in pairs]
        last = line_nodes[-1] if line_nodes else None
        lineno_map = dict(zip(range(offset, offset + len(lines) + 1), [*line_nodes, last]))
        body = "\n    ".join(lines)
        src = f"\n\n\n{prologue}\n    {body}\n    "
        return PythonCode(src, em.globals, lineno_map, 4)

    # -- one method per opcode: return the statement, or None when nothing goes in the body --
    @staticmethod
    def _emit_placeholder(em: _Emitter, node: Node, annotation: str) -> str | None:
        default = f" = {em.arg(node.args[0])}" if node.args else ""
        em.free_vars.append(f"{node.target}{annotation}{default}")
        raw = cast(str, node.target).lstrip("*")
        name = em.names[node]
        return None if raw == name else f"{name} = {raw}"

    @staticmethod
    def _emit_call_function(em: _Emitter, node: Node, annotation: str) -> str:
        target, args, kwargs = node.target, node.args, node.kwargs
        if not callable(target):
            raise TypeError(f"call_function node {node.name!r} has a target that is not callable: {target!r}")
        lhs = f"{em.names[node]}{annotation}"
        template = OPERATOR_TEMPLATES.get(id(target))
        if template is not None and not kwargs and len(args) == template[1]:
            ops = [em.arg(a) for a in args]
            if id(target) in TIGHT_LEFT and ops[0].startswith("-"):
                ops[0] = f"({ops[0]})"
            return f"{lhs} = {template[0].format(*ops)}"
        if not kwargs and (id(target) in INPLACE_OPERATORS or target is operator.setitem):
            stmt = _inplace_statement(em, node, lhs)
            if stmt is not None:
                return stmt
        if (target is getattr and len(args) == 2 and not kwargs and is_plain_ident(args[1])):
            return f"{lhs} = {em.operand(args[0])}.{args[1]}"
        return f"{lhs} = {em.callable_ref(target)}({em.call_args(args, kwargs)})"

    @staticmethod
    def _emit_call_method(em: _Emitter, node: Node, annotation: str) -> str:
        if not node.args:
            raise ValueError(f"call_method node {node.name!r} ({node.target!r}) has no receiver in args[0]")
        method = em.method_ref(em.operand(node.args[0]), node.target)
        return f"{em.names[node]}{annotation} = {method}({em.call_args(node.args[1:], node.kwargs)})"

    @staticmethod
    def _emit_call_module(em: _Emitter, node: Node, annotation: str) -> str:
        target = _str_target(node)
        path = em.attr_path(em.root, target, modules=target.count(".") + 1)
        return f"{em.names[node]}{annotation} = {path}({em.call_args(node.args, node.kwargs)})"

    @staticmethod
    def _emit_get_attr(em: _Emitter, node: Node, annotation: str) -> str:
        target = _str_target(node)
        return f"{em.names[node]}{annotation} = {em.attr_path(em.root, target, modules=0)}"

    def _emit_output(self, em: _Emitter, node: Node, annotation: str) -> str:
        if node.type is not None:
            em.return_annotation = f" -> {em.type_ref(node.type)}"
        return _call_hook(self, "generate_output", node.args[0] if node.args else None, repr_fn=em.arg)


def _inplace_statement(em: _Emitter, node: Node, lhs: str) -> str | None:
    """``x *= y`` / ``x[i] = v`` as statements (TorchScript compiles them; it has no ``operator.imul``).

    ``imul = x;  imul *= y`` binds the result without rebinding ``x``: eager's value whether ``x`` is
    a tensor (mutated in place, ``imul`` is the same object), a list (likewise) or an int (``x`` keeps
    its value for later users). torch.fx prints ``x *= y;  imul = x``, which changes ``x`` for its
    later users when ``x`` is immutable. ``setitem`` binds None, as ``operator.setitem`` returns.
    """
    args = node.args
    if node.target is operator.setitem:
        if len(args) != 3:
            return None
        return f"{em.operand(args[0])}[{em.arg(args[1])}] = {em.arg(args[2])};  {lhs} = None"
    if len(args) != 2:
        return None
    name = em.names[node]
    return f"{lhs} = {em.arg(args[0])};  {name} {INPLACE_OPERATORS[id(node.target)]} {em.arg(args[1])}"


def _call_hook(codegen: CodeGen, name: str, *args: Any, **kwargs: Any) -> Any:
    """Call ``codegen.<name>`` with only the keyword arguments its signature accepts (an override
    written for an older torch.fx may lack ``repr_fn``). Source: torch/fx/graph.py
    ``CodeGen._call_method_with_signature_check``."""
    method = getattr(codegen, name)
    if getattr(type(codegen), name) is not getattr(CodeGen, name):
        params = inspect.signature(method).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in params}
    return method(*args, **kwargs)


def _multiline_item(text: str) -> str:
    """One parameter of an expanded ``def``: ``    a,\n``, a ``# comment`` kept after the comma."""
    if "#" in text:
        arg, comment = text.split("#", 1)
        return f"    {arg.rstrip()},  # {comment.lstrip()}\n"
    return f"    {text},\n"


def _str_target(node: Node) -> str:
    if not isinstance(node.target, str) or not node.target:
        raise TypeError(f"{node.op} node {node.name!r} needs a non-empty str target (a qualified attribute "
                        f"path such as 'layer1.0.conv'), got {node.target!r}")
    return node.target


def _deletions(nodes: list[Node], ops: list[str]) -> dict[Node, list[Node]]:
    """node -> the values to free right after it: inputs whose last use it is, and itself when it has
    no users (an impure node kept by DCE). Placeholders and the output free nothing."""
    seen: set[Node] = set()
    dels: dict[Node, list[Node]] = {}
    for user in reversed(nodes):
        for inp in user._input_nodes:
            if inp not in seen:
                seen.add(inp)
                dels.setdefault(user, []).append(inp)
    for node, op in zip(nodes, ops):
        if op == "placeholder" or op == "output":
            dels.pop(node, None)
        elif not node.users:
            dels.setdefault(node, []).append(node)
    return dels


def _annotation(em: _Emitter, node: Node) -> str:
    """`` : T`` from ``node.type``; in verbose mode a shape string such as ``: "f32[2, 3]"``."""
    text = "" if node.type is None or node.op == "output" else f" : {em.type_ref(node.type)}"
    if not em.verbose:
        return text
    val = node.meta.get("val", node.meta.get("tensor_meta"))
    dtype, shape = getattr(val, "dtype", None), getattr(val, "shape", None)
    if isinstance(dtype, torch.dtype) and shape is not None and dtype in dtype_abbrs:
        text = f"{dtype_abbrs[dtype]}{_dims(shape)}"
        stride = getattr(val, "stride", None)
        if em.include_stride and stride is not None:
            text += _dims(stride() if callable(stride) else stride)
        device = getattr(val, "device", None)
        if em.include_device and isinstance(device, torch.device):
            text += str(device)
        return f': "{text}"'
    return text


def _dims(sizes: Iterable[Any]) -> str:
    """``[2, 3]``; symbolic sizes are printed with ``str``, made safe for a string literal."""
    return "[" + ", ".join(one_line_comment(str(d)).replace('"', "'").replace("\\", "/") for d in sizes) + "]"


def _emit_summary(em: _Emitter, node: Node, index: int) -> None:
    """Verbose mode: a ``# File: ...`` comment whenever the source location changes."""
    if node.op in ("placeholder", "output"):
        return
    summary = stack_summary(node.meta.get("stack_trace"))
    text = "# " + one_line_comment(summary or "No stacktrace found for following nodes")
    if text != em._prev_summary:
        em._prev_summary = text
        if em.lines:
            em.lines.append("")
            em.line_nodes.append(index)
        em.lines.append(text)
        em.line_nodes.append(index)
