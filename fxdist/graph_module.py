"""``GraphModule``: an ``nn.Module`` whose ``forward`` is Python code generated from a ``Graph``.

Source: torch/fx/graph_module.py (torch 2.13) and the torch.fx paper, section 4.3. Written anew; the
semantics follow torch.fx:

* Each instance gets its own class (``forward`` is set on the class), named ``class_name``.
* The submodules, parameters and buffers the graph references (``get_attr``/``call_module``
  targets) are copied from ``root`` by qualified name, *sharing* the objects (optimizers and DDP
  hooks keep working); missing intermediate modules are created empty.
* Assigning ``gm.graph`` sets ``graph.owning_module`` and recompiles; after editing the graph in
  place, call ``recompile()``.

Design choices where fxdist differs (documented, tested in tests/fx/test_graph_module.py):

* Submodule access: the generated ``forward`` calls submodules through ``_modules[...]``
  (see fxdist/codegen.py), about 20x cheaper than ``nn.Module.__getattr__`` chains, and still
  resolved at call time, so a replaced submodule is used even before ``recompile()``; DataParallel
  replicas and deep copies use their own submodules. We chose this over binding submodules as
  globals at ``recompile()`` (a little faster still) because bound globals go stale when a
  submodule is replaced without ``recompile()`` and break DataParallel replicas. ``recompile()``
  falls back to torch.fx's ``self.a.b`` text where a fast read could fail: for a dict root (its
  values may be any objects) and when a ``call_module`` target is not reachable through
  ``_modules``. One visible difference remains: calling a GraphModule whose ``call_module`` target
  was deleted *after* the last ``recompile()`` raises ``KeyError`` (torch.fx: ``AttributeError``);
  ``graph.lint()`` reports such targets either way.
  Measured by benchmarks/ir.py: a forward with 128 nested submodule calls runs at 0.8-0.9x eager's
  time and 0.5-0.6x torch.fx's.
  ``torch.jit.script(gm)`` works as for torch.fx: ``__prepare_scriptable__`` hands TorchScript a
  shallow clone whose ``forward`` uses torch.fx's ``self.a.b`` form (TorchScript cannot compile
  ``_modules[...]``); ``gm`` itself keeps its code.
* Tracebacks, as torch.fx: the source is registered in ``linecache`` under torch.fx's file name
  (``<eval_with_key>.fxdist.N from user.py:12 in forward``; torch.fx: ``<eval_with_key>.N ...``,
  see ``_register_source``), so tracebacks and pdb show the generated
  lines; ``gm._lineno_map`` maps a line back to its node; an exception raised by a generated line
  prints torch.fx's "Call using an FX-traced Module, line X of the traced Module's generated
  forward function:" report to stderr and is re-raised without its traceback. The ``__call__``
  wrapper doing this is one Python function (torch.fx: two). Unlike torch.fx, the linecache entry
  is dropped when the module is garbage-collected or recompiled.
* Pickle and ``deepcopy`` keep the graph itself (node list with names, targets, args, types and
  ``stack_trace``), not the generated text: no re-tracing, so graphs that are not re-traceable
  round-trip too.
"""

from __future__ import annotations

import copy
import itertools
import linecache
import sys
import traceback
import weakref
from pathlib import Path
from typing import Any, Callable, ClassVar, cast

import torch
from torch import nn
from torch.nn.modules.module import _addindent

from fxdist._graph_module_io import graph_from_spec, graph_to_spec, pickled_meta, write_folder
from fxdist.codegen import PythonCode
from fxdist.graph import Graph
from fxdist.node import Node

__all__ = ["GraphModule"]

_source_ids = itertools.count()


def _register_source(src: str, co_fields: dict[str, Any] | None) -> str:
    """Put ``src`` in ``linecache`` under a fresh fake filename and return that filename.

    The name is torch.fx's, ``<eval_with_key>.N`` followed by `` from file.py:12 in forward`` (the
    traced function's ``co_filename``/``co_firstlineno``/``co_name``, from ``graph._co_fields``) when
    the tracer recorded them, except that N is ``fxdist.0``, ``fxdist.1``...: torch.fx numbers its
    own modules from 0 in the same ``linecache``, and a shared name would make tracebacks and
    ``torch.jit.script`` read the other library's source. Tools (torch.fx's ``_WrappedCall``, torch's
    structured logging) look for ``eval_with_key`` in the name.
    Source: torch/fx/graph_module.py ``_EvalCacheLoader.cache``.
    """
    filename = f"<eval_with_key>.fxdist.{next(_source_ids)}"
    if co_fields and all(k in co_fields for k in ("co_filename", "co_firstlineno", "co_name")):
        filename += f" from {co_fields['co_filename']}:{co_fields['co_firstlineno']} in {co_fields['co_name']}"
    # mtime None: linecache.checkcache() never evicts the entry; _forget_source drops it with the module.
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    return filename


def _fx_error_message(frame: traceback.FrameSummary) -> str:
    """torch.fx's report for an exception raised by a generated line: the traceback, then the line
    with two lines of context before and after and a ``~~~ <--- HERE`` marker.

    Source: torch/fx/graph_module.py ``_WrappedCall._generate_error_message`` (same text).
    """
    err_lineno = frame.lineno or 0
    line = frame.line or ""
    all_src_lines = linecache.getlines(frame.filename)
    custom_msg = ("Call using an FX-traced Module, "
                  f"line {err_lineno} of the traced Module's generated forward function:")
    before_err = "".join(all_src_lines[err_lineno - 2:err_lineno])
    marker = "~" * len(line) + "~~~ <--- HERE"
    err_and_after_err = "\n".join(all_src_lines[err_lineno:err_lineno + 2])
    return "\n".join([traceback.format_exc(), custom_msg, before_err, marker, err_and_after_err])


def _make_call(impl: type) -> Callable[..., Any]:
    """The ``__call__`` of a per-instance class: when the innermost frame of an exception is generated
    code, print torch.fx's message to stderr and re-raise without the traceback, as torch.fx does.
    ``nn.Module.__call__`` is looked up at each call (the tracer patches it); a ``__call__`` defined by
    a GraphModule subclass is called through ``super()``. One Python frame a call (about 0.2 µs).

    Source: torch/fx/graph_module.py ``_WrappedCall.__call__``.
    """
    if impl.__mro__[1].__call__ is nn.Module.__call__:

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return nn.Module.__call__(self, *args, **kwargs)
            except Exception as e:
                _report_generated_frame(e)
                raise
    else:

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return super(impl, self).__call__(*args, **kwargs)  # type: ignore[arg-type]  # mypy: class names only
            except Exception as e:
                _report_generated_frame(e)
                raise

    return __call__


def _call_restoring_fast_code(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``__call__`` of a clone made for ``torch.jit.script``, once scripting is over: put back the
    usual wrapper and the fast code, then call."""
    cls = type(self)
    cls.__call__ = _make_call(cls)
    self.recompile()
    return self(*args, **kwargs)


def _report_generated_frame(e: Exception) -> None:
    """When ``e`` was raised by a generated line: print torch.fx's report and re-raise ``e`` without
    its traceback (the report shows it), as torch.fx does; otherwise return."""
    top = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ is not None else None
    if top is not None and "eval_with_key" in top.filename:
        print(_fx_error_message(top), file=sys.stderr)
        raise e.with_traceback(None)


def _forget_source(holder: dict[str, str]) -> None:
    linecache.cache.pop(holder.get("filename", ""), None)


def _compile_forward(code: PythonCode, filename: str, func_name: str) -> Callable[..., Any]:
    namespace = dict(code.globals)
    # dont_inherit: our ``from __future__ import annotations`` must not turn annotations into strings.
    exec(compile(code.src, filename, "exec", dont_inherit=True), namespace)  # noqa: S102 - our own codegen
    return namespace[func_name]


def _is_torch_fx(obj: Any) -> bool:
    """Whether ``obj`` is a torch.fx object (GraphModule, Graph...), without importing torch.fx: the
    test each door of fxdist runs before converting with ``fxdist.interop.as_fxdist``."""
    return any(c.__module__.startswith("torch.fx") for c in type(obj).__mro__)


# -- copying attributes from the root ----------------------------------------------------------------
def _copy_attr(from_module: nn.Module, to_module: nn.Module, target: str) -> None:
    """Make ``to_module.<target>`` the same object as ``from_module.<target>``, creating empty
    intermediate modules; tensors that are not Parameters become buffers."""
    *prefix, field = target.split(".")
    for item in prefix:
        src = _get_or_raise(from_module, item, target)
        dst = getattr(to_module, item, None)
        if src is dst:  # a parent was already installed whole, with everything below it
            return
        if dst is None:
            dst = nn.Module()
            setattr(to_module, item, dst)
        from_module, to_module = src, dst
    _install(to_module, field, _get_or_raise(from_module, field, target))


def _get_or_raise(obj: Any, item: str, target: str) -> Any:
    try:
        return getattr(obj, item)
    except AttributeError:
        raise AttributeError(f"GraphModule: the graph references {target!r}, but {type(obj).__name__} has no "
                             f"attribute {item!r}; pass a root that has it (or a dict with key {target!r})") from None


def _assign_attr(value: Any, to_module: nn.Module, target: str) -> None:
    """Install ``value`` at ``to_module.<target>``, creating empty intermediate modules."""
    *prefix, field = target.split(".")
    for item in prefix:
        sub = getattr(to_module, item, None)
        if sub is None:
            sub = nn.Module()
            setattr(to_module, item, sub)
        to_module = sub
    _install(to_module, field, value)


def _install(module: Any, field: str, value: Any) -> None:
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and isinstance(module, nn.Module):
        module.register_buffer(field, value)
    else:
        setattr(module, field, value)


def _compat_python_code(graph: Graph) -> PythonCode:
    """The graph's code with torch.fx's ``self.a.b`` module access (its codegen copied, not changed)."""
    compat = copy.copy(graph._codegen)
    compat.fast_module_access = False
    return compat.gen_python_code(graph.nodes, "self")


def _base_class(cls: type) -> type[GraphModule]:
    """The user-visible class behind a per-instance GraphModule class."""
    for t in cls.__mro__:
        if "_fxdist_per_instance" not in t.__dict__:
            return cast("type[GraphModule]", t)
    raise AssertionError(cls)


def _new_instance(base: type[GraphModule], class_name: str) -> GraphModule:
    gm = base.__new__(base)
    type(gm).__name__ = type(gm).__qualname__ = class_name
    return gm


def _rebuild_graph_module(base: type, class_name: str, body: dict[str, Any], spec: dict[str, Any]) -> GraphModule:
    """Unpickling entry point (referenced by ``GraphModule.__reduce__``)."""
    gm = _new_instance(base, class_name)
    gm.__dict__.update(body)
    gm.graph = graph_from_spec(spec)
    return gm


class GraphModule(nn.Module):
    """An ``nn.Module`` generated from a :class:`~fxdist.graph.Graph`, with ``graph``, ``code`` and
    ``forward`` attributes.

    Args:
        root: an ``nn.Module`` whose submodules/parameters/buffers named by the graph's
            ``get_attr``/``call_module`` targets are shared into this module, or a dict mapping each
            such qualified name to the object to install.
        graph: the graph to generate ``forward`` from; its ``owning_module`` becomes this module. A
            ``torch.fx.Graph`` (from ``make_fx``, ``torch.export``, a torch.fx tracer) is converted
            first with ``fxdist.interop.as_fxdist`` (same nodes, shared ``meta`` dicts).
        class_name: the name of this instance's class (shown by ``repr`` and in errors).

    Raises:
        RuntimeError: ``root`` is neither a Module nor a dict, or a dict lacks a referenced target.
        ValueError: a torch.fx ``graph`` uses a pytree or boxed calling convention.
        AttributeError: a Module ``root`` lacks a referenced target.

    Example::

        >>> import torch, fxdist as fx
        >>> g = fx.Graph()
        >>> x = g.placeholder("x")
        >>> _ = g.output(g.call_function(torch.relu, (x,)))
        >>> print(fx.GraphModule(torch.nn.Module(), g).code.strip())
        def forward(self, x):
            relu = torch.relu(x);  x = None
            return relu

    Source: torch/fx/graph_module.py ``GraphModule``.
    """

    # TorchScript must not compile this property (torch.fx lists the same one).
    __jit_unused_properties__ = ["graph"]
    _fxdist_source: ClassVar[dict[str, Any]]  # set on each per-instance class by _install_code

    def __new__(cls, *args: Any, **kwargs: Any) -> GraphModule:
        base = _base_class(cls)
        impl = type(base.__name__, (base,), {"_fxdist_per_instance": True, "__module__": base.__module__})
        setattr(impl, "__call__", _make_call(impl))  # noqa: B010 (mypy: no assigning to a method)
        return super().__new__(impl)

    def __init__(self, root: nn.Module | dict[str, Any], graph: Graph, class_name: str = "GraphModule") -> None:
        super().__init__()
        if _is_torch_fx(graph):  # the door for torch-built graphs (make_fx, torch.export, torch.fx tracers)
            from fxdist.interop import as_fxdist

            graph = as_fxdist(graph)
        type(self).__name__ = type(self).__qualname__ = class_name
        targets = [cast(str, n.target) for n in graph.nodes if n.op in ("get_attr", "call_module")]  # checked below
        for t in targets:
            if not isinstance(t, str):
                raise TypeError(f"GraphModule: get_attr/call_module target must be a str, got {t!r}")
        if isinstance(root, nn.Module):
            self.training = root.training
            for target in targets:
                _copy_attr(root, self, target)
        elif isinstance(root, dict):
            self._dict_root = True  # values may be any objects: keep torch.fx's attribute access
            missing = [t for t in targets if t not in root]
            if missing:
                raise RuntimeError(f"GraphModule: the graph references {missing}, which the root dict lacks")
            for target in sorted(set(targets), key=lambda t: t.count(".")):  # parents before children
                _assign_attr(root[target], self, target)
        else:
            raise RuntimeError(f"Unsupported type {type(root).__name__} passed for root! (a Module or a dict)")
        self.meta: dict[str, Any] = {}
        self._replace_hooks: list[Callable[..., Any]] = []
        self._create_node_hooks: list[Callable[[Node], Any]] = []
        self._erase_node_hooks: list[Callable[[Node], Any]] = []
        self._deepcopy_hooks: list[Callable[[GraphModule], Any]] = []
        tracer_cls = getattr(graph, "_tracer_cls", None)
        self._tracer_cls = tracer_cls if tracer_cls and "<locals>" not in tracer_cls.__qualname__ else None
        self._tracer_extras = getattr(graph, "_tracer_extras", None) or {}
        self.graph = graph

    # -- graph and code --------------------------------------------------------------------------
    @property
    def graph(self) -> Graph:
        """The underlying graph. Assigning one recompiles ``forward``."""
        return self._graph

    @graph.setter
    def graph(self, g: Graph) -> None:
        """Set the graph (its ``owning_module`` becomes this module) and recompile ``forward``.

        Raises:
            TypeError: ``g`` is not an fxdist ``Graph`` (a torch.fx graph is converted with
                ``fxdist.from_torch_fx``).
        """
        if not isinstance(g, Graph):
            raise TypeError(f"GraphModule.graph must be an fxdist Graph, got {type(g).__name__} "
                            "(convert a torch.fx graph with fxdist.from_torch_fx)")
        self._graph = g
        g.owning_module = self
        self.recompile()

    @property
    def code(self) -> str:
        """The Python source of the generated ``forward``.

        Raises:
            RuntimeError: no code has been generated yet (no graph assigned, ``recompile`` not called).
        """
        if not hasattr(self, "_code"):
            raise RuntimeError("GraphModule.code: no code has been generated yet; assign .graph or call recompile()")
        return self._code

    def recompile(self) -> PythonCode:
        """Regenerate ``forward`` from ``self.graph`` (call it after editing the graph in place).

        Returns:
            The ``PythonCode`` that was compiled.
        """
        codegen = self._graph._codegen
        if hasattr(codegen, "in_spec") and hasattr(codegen, "out_spec"):  # PyTreeCodeGen: read by forward
            self._in_spec, self._out_spec = codegen.in_spec, codegen.out_spec
        python_code = self._python_code()
        self._install_code(python_code)
        for child in self.children():
            if isinstance(child, GraphModule):
                child.recompile()
        return python_code

    def _python_code(self) -> PythonCode:
        """The graph's code; in torch.fx's ``self.a.b`` form when the fast ``_modules[...]`` reads
        could fail: a dict root, or a ``call_module`` target not reachable through ``_modules``."""
        codegen = self._graph._codegen
        if getattr(codegen, "fast_module_access", False) and not self._fast_access_safe():
            return _compat_python_code(self._graph)
        return self._graph.python_code(root_module="self")

    def _fast_access_safe(self) -> bool:
        if self.__dict__.get("_dict_root", False):
            return False
        for node in self._graph.find_nodes(op="call_module", sort=False):
            mod: Any = self
            for part in cast(str, node.target).split("."):
                mod = mod._modules.get(part) if isinstance(mod, nn.Module) else None
                if mod is None:
                    return False
        return True

    def _install_code(self, python_code: PythonCode) -> None:
        """Compile ``python_code`` as this instance's class ``forward`` and record its text."""
        cls = type(self)
        holder = cls.__dict__.get("_fxdist_source")
        if holder is None:
            holder = {}
            cls._fxdist_source = holder
            weakref.finalize(self, _forget_source, holder)
        filename = _register_source(python_code.src, getattr(self._graph, "_co_fields", None))
        try:
            forward = _compile_forward(python_code, filename, getattr(self._graph._codegen, "_func_name", "forward"))
        except BaseException:
            linecache.cache.pop(filename, None)
            raise
        _forget_source(holder)
        holder["filename"] = filename
        cls.forward = forward
        self._code = python_code.src
        self._lineno_map = python_code._lineno_map
        self._prologue_start = python_code._prologue_start

    def __prepare_scriptable__(self) -> GraphModule:
        """``torch.jit.script`` hook: the module to script in place of this one.

        TorchScript cannot compile the ``self._modules['a']`` reads of the default fast module
        access, so this returns a shallow clone (sharing every submodule, parameter and buffer)
        whose ``forward`` is generated in torch.fx's ``self.a.b`` form; ``self`` is left unchanged.
        A module whose codegen already uses that form is returned as is.

        Scripting a *parent* module stores the clone in the parent's ``_modules`` (torch.jit does
        that with whatever this hook returns); the clone computes the same, and its first Python call
        recompiles it to the fast form.

        Source: torch/jit/_script.py ``call_prepare_scriptable_func``.
        """
        if "_modules[" not in self._code:
            return self
        clone = _new_instance(_base_class(type(self)), type(self).__name__)
        clone.__dict__.update(self.__dict__)
        for key in ("_modules", "_parameters", "_buffers"):  # torch.jit replaces prepared children in them
            clone.__dict__[key] = dict(self.__dict__[key])
        clone._install_code(_compat_python_code(self._graph))
        setattr(type(clone), "__call__", _call_restoring_fast_code)  # noqa: B010 (mypy: no assigning to a method)
        return clone

    def print_readable(self, print_output: bool = True, include_stride: bool = False,
                       include_device: bool = False, colored: bool = False) -> str:
        """The verbose code of this module and of its GraphModule children, as a class definition.

        Args:
            print_output: also print it.
            include_stride: show strides in tensor annotations.
            include_device: show devices in tensor annotations.
            colored: accepted for torch.fx compatibility (no colours are emitted).

        Returns:
            The text.
        """
        text = _readable(self, self._get_name(), include_stride, include_device)
        if print_output:
            print(text)
        return text

    def __str__(self) -> str:
        reminder = "# To see more debug info, please use `graph_module.print_readable()`"
        return "\n".join([super().__str__(), self._code, reminder])

    # -- submodules ------------------------------------------------------------------------------
    def add_submodule(self, target: str, m: nn.Module) -> bool:
        """Install ``m`` at dotted path ``target``, creating empty intermediate modules.

        Returns:
            False when some component of the path exists and is not an ``nn.Module``.
        """
        *prefix, field = target.split(".")
        mod: nn.Module = self
        for item in prefix:
            sub = getattr(mod, item, None)
            if sub is None:
                sub = nn.Module()
                mod.add_module(item, sub)
            if not isinstance(sub, nn.Module):
                return False
            mod = sub
        mod.add_module(field, m)
        return True

    def delete_submodule(self, target: str) -> bool:
        """Delete the submodule at dotted path ``target``.

        Returns:
            False when ``target`` does not name a submodule.
        """
        *prefix, field = target.split(".")
        mod: Any = self
        for item in prefix:
            mod = getattr(mod, item, None)
            if not isinstance(mod, nn.Module):
                return False
        if not isinstance(getattr(mod, field, None), nn.Module):
            return False
        delattr(mod, field)
        return True

    def delete_all_unused_submodules(self) -> None:
        """Delete every submodule that no ``call_module``/``get_attr`` target uses (directly, as a
        parent of a used attribute, or as a descendant of a called module)."""
        used: set[str] = set()
        for node in self._graph.nodes:
            if node.op not in ("call_module", "get_attr") or not isinstance(node.target, str):
                continue
            used.update(itertools.accumulate(node.target.split("."), lambda a, b: f"{a}.{b}"))
            if node.op == "call_module":
                try:
                    sub = self.get_submodule(node.target)
                except AttributeError:
                    continue
                used.update(f"{node.target}.{name}" for name, _ in sub.named_modules() if name)
        for name in [name for name, _ in self.named_modules() if name and name not in used]:
            self.delete_submodule(name)

    # -- copying and serialization ----------------------------------------------------------------
    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle the module state and the graph (not the code); see the module docstring."""
        body = {k: v for k, v in self.__dict__.items() if k != "_graph"}
        spec = graph_to_spec(self._graph, pickled_meta)
        return (_rebuild_graph_module, (_base_class(type(self)), type(self).__name__, body, spec))

    def __deepcopy__(self, memo: dict[int, Any]) -> GraphModule:
        res = _new_instance(_base_class(type(self)), type(self).__name__)
        memo[id(self)] = res
        body = copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "_graph"}, memo)
        res.__dict__.update(body)
        spec = graph_to_spec(self._graph, lambda n: copy.copy(n.meta))
        spec["codegen"] = copy.deepcopy(spec["codegen"], memo)
        res.graph = graph_from_spec(spec)
        for hook in getattr(self, "_deepcopy_hooks", ()):
            hook(res)
        return res

    def __copy__(self) -> GraphModule:
        res = _base_class(type(self))(self, self._graph, type(self).__name__)
        res.meta = self.meta
        if self.__dict__.get("_dict_root", False):
            res._dict_root = True
            res.recompile()
        return res

    def _replicate_for_data_parallel(self) -> GraphModule:
        replica = super()._replicate_for_data_parallel()
        type(replica).__name__ = type(self).__name__
        type(replica).forward = type(self).forward
        return replica

    def to_folder(self, folder: str | Path, module_name: str = "FxModule") -> None:
        """Write an importable package: ``from <folder> import <module_name>`` gives a Module
        computing the same as ``self``.

        Writes ``module.py`` (imports, ``__init__`` loading the children and the state, the generated
        ``forward``), ``__init__.py``, ``state_dict.pt``, one ``.pt`` file per child module and, when
        the code uses objects that cannot be imported by name, ``globals.pt``.

        Raises:
            ValueError: ``module_name`` is not an identifier.
        """
        write_folder(self, Path(folder), module_name, self._python_code())

    # -- hooks used by Graph (torch.fx names) -----------------------------------------------------
    def _register_create_node_hook(self, f: Callable[[Node], Any]) -> None:
        self._create_node_hooks.append(f)

    def _unregister_create_node_hook(self, f: Callable[[Node], Any]) -> None:
        self._create_node_hooks.remove(f)

    def _register_erase_node_hook(self, f: Callable[[Node], Any]) -> None:
        self._erase_node_hooks.append(f)

    def _unregister_erase_node_hook(self, f: Callable[[Node], Any]) -> None:
        self._erase_node_hooks.remove(f)

    def _register_deepcopy_hook(self, f: Callable[[GraphModule], Any]) -> None:
        self._deepcopy_hooks.append(f)

    def _unregister_deepcopy_hook(self, f: Callable[[GraphModule], Any]) -> None:
        self._deepcopy_hooks.remove(f)


def _readable(module: GraphModule, name: str, include_stride: bool, include_device: bool) -> str:
    src = module.graph.python_code("self", verbose=True, include_stride=include_stride,
                                   include_device=include_device).src
    text = _addindent(f"class {name}(torch.nn.Module):\n" + src.lstrip("\n"), 4)
    children = [""] + [_readable(child, child_name, include_stride, include_device)
                       for child_name, child in module.named_children() if isinstance(child, GraphModule)]
    return text + _addindent("\n".join(children), 4)
