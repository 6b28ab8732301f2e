"""The symbolic tracer: run a module's ``forward`` on Proxies and record a Graph.

``Tracer.trace(root)`` creates one ``placeholder`` per argument of ``root.forward``, then, with
``nn.Module.__call__`` and ``nn.Module.__getattr__`` patched (only for the duration of the call, and
restored even when tracing raises), calls ``forward`` with Proxies:

* a call to a *leaf* module (by default the ``torch.nn`` built-ins) becomes ``call_module``; other
  modules are traced through;
* reading a parameter becomes ``get_attr``; other tensor constants are stored on the root as
  ``_tensor_constant0``, ``_tensor_constant1``... and read back with ``get_attr``;
* functions registered with :func:`wrap` or with ``torch.fx.wrap`` (libraries such as torchrec register
  theirs with torch.fx), and everything in ``autowrap_modules`` (``math`` by default), are recorded as
  ``call_function`` instead of being traced through; so are the leaves a GraphModule being retraced
  recorded (``meta["is_wrapped"]``), builtins such as ``len`` included;
* constructing a class made with :class:`ProxyableClassMeta` (fxdist's or torch.fx's) from Proxies is
  recorded as a ``call_function`` to the class;
* while tracing, ``torch.fx._symbolic_trace.is_fx_tracing()`` is True, so library code takes the same
  branches as under torch.fx (``fxdist.interop.enter_torch_fx_trace``).

``concrete_args`` specializes arguments: their value is fixed while tracing (so control flow on them is
static) and guarded in the graph by an assertion; ``PH`` marks parts that stay symbolic.

Source: torch/fx/_symbolic_trace.py (Tracer, symbolic_trace, wrap, PH); torch.fx paper §4.1 and §5.
"""

from __future__ import annotations

import collections
import functools
import inspect
import math
import sys
import warnings
from collections.abc import Callable
from itertools import chain
from types import FunctionType, ModuleType
from typing import Any, cast

import torch
import torch.utils._pytree as pytree

from fxdist._patching import (
    ProxyableClassMeta,
    _autowrap_check,
    _patch_recorded_leaves,
    _patch_wrapped_functions,
    _Patcher,
    _proxyable_classes,
    _TraceState,
    wrap,
)
from fxdist._pytree_codegen import PyTreeCodeGen
from fxdist._stack_trace import register_stack_trace_root
from fxdist.graph import Graph
from fxdist.graph_module import GraphModule
from fxdist.proxy import BASE_TYPES, ParameterProxy, Proxy, Scope, ScopeContextManager, TracerBase

__all__ = ["Tracer", "symbolic_trace", "wrap", "PH", "PHBase", "PHWithMeta", "is_fx_tracing",
           "ProxyableClassMeta"]

_orig_module_call: Callable[..., Any] = torch.nn.Module.__call__
_orig_module_getattr: Callable[..., Any] = torch.nn.Module.__getattr__


def is_fx_tracing() -> bool:
    """True while an fxdist ``Tracer.trace`` is running."""
    return _TraceState.active


class PHBase:
    """Marks a part of ``concrete_args`` that stays a placeholder (is not specialized)."""

    def __repr__(self) -> str:
        return "PH"


PH = PHBase()


class PHWithMeta(PHBase):
    """A ``PH`` whose attributes (e.g. ``ph_key``) are copied onto the placeholder node."""

    def __init__(self, ph_key: str | None = None) -> None:
        super().__init__()
        self.ph_key = ph_key


def _transfer_attrs(fr: object, to: object) -> None:
    for name in dir(fr):
        value = getattr(fr, name)
        if not callable(value) and not name.startswith("__") and not hasattr(to, name):
            setattr(to, name, value)


def _not_a_function(fn: Any) -> AssertionError:
    """torch.fx's error for a root that is neither an nn.Module nor a Python function (a C builtin such
    as ``F.conv2d``, a class...), with a note saying what to trace instead."""
    err = AssertionError(f"Expected FunctionType, got {type(fn)}")
    name = getattr(fn, "__name__", None) or type(fn).__name__
    err.add_note(f"symbolic_trace needs an nn.Module or a Python function (def/lambda); {name} is a "
                 f"{type(fn).__name__}, whose code cannot be run on Proxies. Trace a function that calls it "
                 f"instead, e.g. symbolic_trace(lambda x: {name}(x)): the call becomes one call_function node.")
    return err


def _call_root(fn: Callable[..., Any], args: list[Any]) -> Any:
    """Calls the traced function; the outermost frame recorded in ``node.stack_trace``."""
    return fn(*args)


register_stack_trace_root(_call_root)

# Attribute types skipped quickly when looking for tensor constants on modules.
_PLAIN_TYPES = frozenset({bool, int, float, str, type(None), dict, list, tuple, set,
                          collections.OrderedDict})
_HAS_VARSTUFF = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS


def _patch_function(fn: FunctionType, nargs: int) -> FunctionType:
    """A copy of ``fn`` whose ``*args``/``**kwargs`` are plain positional parameters, so the tracer
    can pass one placeholder for each."""
    co = fn.__code__
    code = co.replace(co_argcount=nargs, co_posonlyargcount=0, co_kwonlyargcount=0,
                      co_flags=co.co_flags & ~_HAS_VARSTUFF)
    return FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


_NoTorchFx = collections.namedtuple("_NoTorchFx", "functions methods proxyable_classes")
_NO_TORCH_FX = _NoTorchFx([], [], {})


def _enter_torch_fx_trace(patcher: _Patcher) -> Any:
    """torch.fx's tracing flag and proxyable classes taken over until ``patcher`` exits, and its
    ``torch.fx.wrap`` registry (leaves for fxdist too). See ``fxdist.interop.enter_torch_fx_trace``.

    The one place the tracer consults torch.fx; fxdist.interop is imported only when torch.fx is
    already loaded (it always is after ``import torch``; the tracer never loads it itself).
    """
    if "torch.fx._symbolic_trace" not in sys.modules:
        return _NO_TORCH_FX
    from fxdist.interop import enter_torch_fx_trace

    return enter_torch_fx_trace(patcher)


def _wrapped_methods(torch_fx_methods: list[tuple[type, str]]) -> list[tuple[type, str]]:
    """``fxdist._symbolic_trace._wrapped_methods_to_patch`` then torch.fx's pairs, each pair once."""
    from fxdist import _symbolic_trace  # imports this module: loaded lazily

    return list(dict.fromkeys([*_symbolic_trace._wrapped_methods_to_patch, *torch_fx_methods]))


def _is_ph(x: Any) -> bool:
    """Whether ``x`` marks a placeholder in ``concrete_args``: fxdist's ``PHBase`` or torch.fx's
    (``torch.fx._symbolic_trace.PHBase``, recognised by class name and module without importing it)."""
    return isinstance(x, PHBase) or any(c.__name__ == "PHBase" and c.__module__ == "torch.fx._symbolic_trace"
                                        for c in type(x).__mro__)


# --------------------------------------------------------------------------------------------------

class Tracer(TracerBase):
    """Tracer(autowrap_modules=(math,), autowrap_functions=())

    Implements :func:`symbolic_trace`; ``symbolic_trace(m)`` is ``GraphModule(m, Tracer().trace(m))``.
    Subclass it and override ``is_leaf_module``, ``call_module``, ``create_proxy``, ``create_arg``,
    ``create_args_for_root``, ``path_of_module`` or ``getattr`` to change what gets recorded.

    Unlike torch.fx, ``record_stack_traces`` is on by default: every node gets
    ``meta["stack_trace"]`` with the user's frames (torch.fx format). Set it to False to skip that.

    Source: torch/fx/_symbolic_trace.py ``Tracer``.
    """

    record_stack_traces: bool = True

    def __init__(
        self,
        autowrap_modules: tuple[ModuleType, ...] = (math,),
        autowrap_functions: tuple[Callable[..., Any], ...] = (),
        param_shapes_constant: bool = False,
    ) -> None:
        """
        Args:
            autowrap_modules: modules whose public functions are recorded as leaf calls
                (``math.sqrt(x)`` and ``from math import sqrt`` alike), without :func:`wrap`.
            autowrap_functions: more functions to record as leaf calls.
            param_shapes_constant: answer ``shape``/``size()``/``dim()`` of parameters from the real
                parameter instead of recording them.
        """
        super().__init__()
        self._autowrap_function_ids: set[int] = {
            id(value)
            for name, value in chain.from_iterable(m.__dict__.items() for m in autowrap_modules)
            if not name.startswith("_") and callable(value)
        }
        self._autowrap_function_ids.update(id(f) for f in autowrap_functions)
        self._autowrap_search: list[ModuleType] = list(autowrap_modules)
        self.param_shapes_constant = param_shapes_constant
        self.submodule_paths: dict[torch.nn.Module, str] | None = None
        self.root_module_name = ""
        self.scope = Scope("", None)
        self.module_stack = collections.OrderedDict()
        self.num_calls: dict[str, int] = {}
        self.node_name_to_scope = {}
        self._qualname_counter: dict[str, int] = collections.defaultdict(int)

    def __deepcopy__(self, memo: dict[int, Any]) -> Tracer:
        # modules in _autowrap_search cannot be deep-copied; share them
        import copy

        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            new.__dict__[k] = copy.copy(v) if k == "_autowrap_search" else copy.deepcopy(v, memo)
        return new

    def get_fresh_qualname(self, prefix: str) -> str:
        """A name ``prefix<i>`` that is not yet an attribute of the root module."""
        if not hasattr(self.root, f"{prefix}0"):
            self._qualname_counter[prefix] = 0
            return f"{prefix}0"
        i = self._qualname_counter[prefix]
        while hasattr(self.root, f"{prefix}{i}"):
            i += 1
        self._qualname_counter[prefix] = i + 1
        return f"{prefix}{i}"

    def create_arg(self, a: Any) -> Any:
        """Lower a traced value into a graph argument.

        Parameters, buffers and submodules of the root become ``get_attr`` nodes; a NamedTuple becomes
        a ``call_function`` to its class; any other tensor is stored on the root as
        ``_tensor_constant<i>`` and read with ``get_attr``. Everything else as ``TracerBase``.

        Raises:
            NameError: a Parameter that is not a member of the root module.
        """
        if isinstance(a, torch.Tensor):
            if isinstance(a, torch.nn.Parameter):
                name = self._attr_names()[0].get(id(a))
                if name is None:
                    raise NameError("parameter is not a member of this module")
                return self.create_node("get_attr", name, (), {})
            name = self._attr_names()[1].get(id(a))
            if name is not None:
                return self.create_node("get_attr", name, (), {})
            return self._constant(a, "_tensor_constant")
        if isinstance(a, torch.nn.Module):
            for name, mod in self.root.named_modules():
                if a is mod:
                    return self.create_node("get_attr", name, (), {})
        if isinstance(a, tuple) and hasattr(a, "_fields"):
            args = tuple(self.create_arg(e) for e in a)
            return self.create_node("call_function", type(a), args, {})
        if isinstance(a, (torch.ScriptObject, pytree.TreeSpec)):
            prefix = "_torchbind_obj" if isinstance(a, torch.ScriptObject) else "_tree_spec_constant"
            return self._constant(a, prefix)
        if type(a) in _proxyable_classes or type(a) in self.__dict__.get("_foreign_proxyable_classes", ()):
            # an instance whose construction was not traced: a constant attribute of the root
            qualname = self.get_fresh_qualname(f"_{type(a).__name__}_constant_")
            setattr(self.root, qualname, a)
            return self.create_node("get_attr", qualname, (), {})
        return super().create_arg(a)

    def _constant(self, value: Any, prefix: str) -> Any:
        """``get_attr`` of a non-parameter constant, stored on the root under a fresh name if new."""
        qualname = self.tensor_attrs.get(value)
        if qualname is None:
            qualname = self.get_fresh_qualname(prefix)
            self.tensor_attrs[value] = qualname
            setattr(self.root, qualname, value)
        return self.create_node("get_attr", qualname, (), {})

    def _attr_names(self) -> tuple[dict[int, str], dict[int, str]]:
        """id -> qualified name of the root's parameters and buffers (first name of shared ones)."""
        cache = self.__dict__.get("_attr_name_cache")
        if cache is None or cache[0] is not self.root:
            params = {id(p): n for n, p in reversed(list(self.root.named_parameters()))}
            buffers = {id(b): n for n, b in reversed(list(self.root.named_buffers()))}
            cache = self._attr_name_cache = (self.root, params, buffers)
        return cache[1], cache[2]

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        """Whether ``m`` is recorded as one ``call_module`` node instead of being traced through.

        By default: modules defined in ``torch.nn`` / ``torch.ao.nn``, except ``nn.Sequential``.

        Args:
            m: the module being called.
            module_qualified_name: its path from the root, e.g. ``layer1.0.conv1``.
        """
        return (m.__module__.startswith("torch.nn") or m.__module__.startswith("torch.ao.nn")) \
            and not isinstance(m, torch.nn.Sequential)

    def path_of_module(self, mod: torch.nn.Module) -> str:
        """The qualified name of ``mod`` in the root's module hierarchy (``"foo.bar"``).

        Raises:
            NameError: ``mod`` is not a submodule of the root.
        """
        if self.submodule_paths:
            path = self.submodule_paths.get(mod)
            if path is None:
                raise NameError(f"module {type(mod).__name__} is not installed as a submodule")
            return path
        for name, sub in self.root.named_modules():
            if sub is mod:
                return name
        raise NameError(f"module {type(mod).__name__} is not installed as a submodule")

    def call_module(self, m: torch.nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        """Record a call to ``m``: ``call_module`` for a leaf, otherwise trace ``forward`` through.

        Pushes ``path`` (``path@n`` for the n-th repeated call) onto ``module_stack`` meanwhile, which
        becomes the nodes' ``meta["nn_module_stack"]``.
        """
        path = self.path_of_module(m)
        with ScopeContextManager(self.scope, Scope(path, type(m))) as scope:
            num_calls = self.num_calls.get(path, 0)
            key = f"{scope.module_path}@{num_calls}" if num_calls > 0 else scope.module_path
            self.module_stack[key] = (path, scope.module_type)
            self.num_calls[path] = num_calls + 1
            try:
                if self.is_leaf_module(m, path):
                    return self.create_proxy("call_module", path, args, kwargs)
                return forward(*args, **kwargs)
            finally:
                self.module_stack.pop(key, None)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Proxy]) -> Any:
        """What reading ``module.attr`` yields while tracing: a ``get_attr`` Proxy for parameters
        (and for buffers when ``proxy_buffer_attributes``), cached per name; the value otherwise."""
        if isinstance(attr_val, torch.nn.Parameter):
            name = self._attr_names()[0].get(id(attr_val))
        elif self.proxy_buffer_attributes and isinstance(attr_val, torch.Tensor):
            name = self._attr_names()[1].get(id(attr_val))
        else:
            return attr_val
        if name is None:
            return attr_val
        if name not in parameter_proxy_cache:
            kwargs: dict[str, Any] = {}
            if self._create_proxy_takes_factory():
                kwargs["proxy_factory_fn"] = (
                    (lambda node: ParameterProxy(self, node, name, attr_val))
                    if self.param_shapes_constant and isinstance(attr_val, torch.nn.Parameter)
                    else None)
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {}, **kwargs)
        return parameter_proxy_cache[name]

    def _create_proxy_takes_factory(self) -> bool:
        cached = self.__dict__.get("_takes_factory")
        if cached is None:
            cached = self._takes_factory = "proxy_factory_fn" in inspect.signature(self.create_proxy).parameters
        return cached

    def create_args_for_root(self, root_fn: Callable[..., Any], is_module: bool,
                             concrete_args: dict[str, Any] | tuple[Any, ...] | None = None,
                             ) -> tuple[Callable[..., Any], list[Any]]:
        """Create one ``placeholder`` per parameter of ``root_fn`` (``*args``/``**kwargs`` included).

        Returns:
            The function to call (patched to take ``*args``/``**kwargs`` positionally if it has
            them) and the arguments to call it with (the root module first for a method).

        Raises:
            RuntimeError: a tuple ``concrete_args`` whose length does not match the parameters.
        """
        fn = inspect.unwrap(root_fn)
        co = fn.__code__
        total_args = co.co_argcount + co.co_kwonlyargcount
        names_iter = iter(co.co_varnames)
        args: list[Any] = []
        skip = 0
        if is_module:
            if total_args == 0:
                raise RuntimeError("``self`` argument cannot be part of *args expansion!")
            skip = 1
            next(names_iter)
            args.append(self.root)
        sig = inspect.signature(fn)
        if (isinstance(concrete_args, tuple) and concrete_args and co.co_flags & _HAS_VARSTUFF
                and total_args == 1):
            for i, value in enumerate(concrete_args):
                out = self.create_proxy("placeholder", f"input_{i}", (), {})
                if _is_ph(value) and value is not PH:
                    _transfer_attrs(value, out.node)
                args.append(out)
            return root_fn, args
        arg_names = [next(names_iter) for _ in range(skip, total_args)]
        if isinstance(concrete_args, tuple):
            if len(arg_names) != len(concrete_args):
                raise RuntimeError(f"Tracing expected {len(arg_names)} arguments but got "
                                   f"{len(concrete_args)} concrete arguments")
            concrete_args = dict(zip(arg_names, concrete_args))
        args.extend(self._proxy_placeholder(n, concrete_args, sig, fn) for n in arg_names)
        if co.co_kwonlyargcount > 0 or co.co_flags & _HAS_VARSTUFF:
            if co.co_flags & inspect.CO_VARARGS:
                args.append(self._proxy_placeholder("*" + next(names_iter), concrete_args, sig, fn))
            if co.co_flags & inspect.CO_VARKEYWORDS:
                args.append(self._proxy_placeholder("**" + next(names_iter), concrete_args, sig, fn))
            root_fn = _patch_function(cast(FunctionType, root_fn), len(args))
        flat_args, in_spec = pytree.tree_flatten(tuple(args))
        if all(child.is_leaf() for child in in_spec.children()):
            return root_fn, args
        if co.co_flags & _HAS_VARSTUFF:
            raise NotImplementedError("container-valued concrete_args on a function with *args/**kwargs")
        return self._flattened_root(root_fn, list(co.co_varnames[:total_args]), in_spec), flat_args

    def _flattened_root(self, root_fn: Callable[..., Any], orig_args: list[str],
                        in_spec: pytree.TreeSpec) -> Callable[..., Any]:
        """Wrap ``root_fn`` to take and return flat leaves; the graph's PyTreeCodeGen restores the
        original signature and output structure in the generated code."""
        codegen = PyTreeCodeGen(orig_args, in_spec)
        self.graph._codegen = codegen

        def flatten_fn(*flat):  # unannotated: would become forward's
            out_leaves, codegen.out_spec = pytree.tree_flatten(root_fn(*pytree.tree_unflatten(list(flat), in_spec)))
            return out_leaves

        return flatten_fn

    def _proxy_placeholder(self, name: str, concrete_args: dict[str, Any] | None,
                           sig: inspect.Signature, fn: Callable[..., Any]) -> Any:
        """The argument for parameter ``name``: a placeholder Proxy, or the specialized value."""
        if concrete_args is not None and name in concrete_args:
            return self._specialize(name, concrete_args[name], sig)
        default: tuple[Any, ...] = ()
        if name[0] != "*":
            param = sig.parameters[name]
            if param.default is not inspect.Parameter.empty:
                default = (param.default,)
        return self.create_proxy("placeholder", name, default, {},
                                 type_expr=fn.__annotations__.get(name, None))

    def _specialize(self, name: str, value: Any, sig: inspect.Signature) -> Any:
        """Placeholders ``name_1``, ``name_2``... for the leaves of a concrete argument, each guarded
        by an assertion that the runtime value equals the one traced with (``PH`` leaves stay
        symbolic). Unlike torch.fx, a guarded placeholder defaults to the traced value (when it can be a
        graph constant), so the GraphModule can be called without it."""
        count = 0
        param = sig.parameters[name]

        def replace(x: Any) -> Any:
            nonlocal count
            count += 1
            if _is_ph(x):
                default = () if param.default is inspect.Parameter.empty else (param.default,)
                out = self.create_proxy("placeholder", f"{name}_{count}", default, {})
                if x is not PH:
                    _transfer_attrs(x, out.node)
                return out
            try:
                out = self.create_proxy("placeholder", f"{name}_{count}", (x,), {})
            except NotImplementedError:  # not a graph constant (e.g. a function): no default, as torch.fx
                out = self.create_proxy("placeholder", f"{name}_{count}", (), {})
            message = f"{name} has been specialized to have value {x} but got another value"
            if type(x) is bool or (type(x) in BASE_TYPES and type(x) is not torch.Tensor):
                torch._assert(out == x, message)
            elif x is None:
                self.create_proxy("call_function", _assert_is_none, (out, message), {})
            else:
                warnings.warn("Was not able to add assertion to guarantee "  # noqa: B028 (torch.fx's stacklevel)
                              f"correct input {name} to specialized function. It is up to the user to make "
                              "sure that your inputs match the inputs you specialized the function with.")
            return x

        return pytree.tree_map(replace, value)

    def trace(self, root: torch.nn.Module | Callable[..., Any],
              concrete_args: dict[str, Any] | None = None) -> Graph:
        """Trace ``root`` (a module's ``forward``, or a plain function) into a Graph.

        For a function, ``self.root`` becomes a fresh ``nn.Module`` that holds its constants.

        Args:
            root: the module or function.
            concrete_args: argument name -> value to specialize on (see :func:`symbolic_trace`).

        Returns:
            The recorded Graph (also ``self.graph``).

        Raises:
            TraceError: the code needs a concrete value (control flow, iteration, ``len``), with a
                note naming the user's file, line and source.
        """
        was_tracing, _TraceState.active = _TraceState.active, True
        self._stack_cache: dict[int, Any] = {}  # see fxdist._stack_trace.user_frames
        try:
            if isinstance(root, torch.nn.Module):
                self.root = root
                fn = getattr(type(root), self.traced_func_name, None)
                if fn is None:  # AssertionError, as torch.fx
                    raise AssertionError(f"traced_func_name={self.traced_func_name} doesn't exist in "
                                         f"{type(root).__name__}")
                self.root_module_name = root._get_name()
                self.submodule_paths = {mod: name for name, mod in root.named_modules()}
            else:
                self.root = torch.nn.Module()
                fn = root
            self.graph = Graph(tracer_cls=type(self))
            if hasattr(fn, "__code__"):
                code = fn.__code__
                self.graph._co_fields = {"co_name": code.co_name, "co_filename": code.co_filename,
                                         "co_firstlineno": code.co_firstlineno}
            self.tensor_attrs: dict[Any, str] = {}
            self._collect_tensor_attrs(self.root, [])
            self.__dict__.pop("_attr_name_cache", None)
            if not isinstance(fn, FunctionType):
                raise _not_a_function(fn)
            fn_globals = fn.__globals__
            fn, args = self.create_args_for_root(fn, isinstance(root, torch.nn.Module), concrete_args)
            with _Patcher() as patcher:
                self._patch_module_hooks(patcher)
                hooks = _enter_torch_fx_trace(patcher)
                self._foreign_proxyable_classes = hooks.proxyable_classes
                _patch_wrapped_functions(patcher, hooks.functions, _wrapped_methods(hooks.methods))
                _autowrap_check(patcher, fn_globals, self._autowrap_function_ids)
                if isinstance(root, GraphModule):
                    _patch_recorded_leaves(patcher, fn_globals, root.graph.nodes)
                for module in self._autowrap_search:
                    _autowrap_check(patcher, module.__dict__, self._autowrap_function_ids)
                result = _call_root(fn, args)
                ann = inspect.get_annotations(inspect.unwrap(fn))
                self.create_node("output", "output", (self.create_arg(result),), {},
                                 type_expr=ann.get("return", None))
            self.submodule_paths = None
        finally:
            _TraceState.active = was_tracing
            self._stack_cache = {}  # release the frames it holds
        return self.graph

    def _collect_tensor_attrs(self, m: torch.nn.Module, prefix: list[str]) -> None:
        for k, v in m.__dict__.items():
            if type(v) in _PLAIN_TYPES:
                continue
            if isinstance(v, (torch.Tensor, torch.ScriptObject)):
                self.tensor_attrs[v] = ".".join([*prefix, k])
        for k, child in m.named_children():
            self._collect_tensor_attrs(child, [*prefix, k])

    def _patch_module_hooks(self, patcher: _Patcher) -> None:
        """Route ``nn.Module.__getattr__`` through :meth:`getattr` and ``nn.Module.__call__`` through
        :meth:`call_module` until ``patcher`` exits."""
        parameter_proxy_cache: dict[str, Proxy] = {}
        ids = self._autowrap_function_ids

        @functools.wraps(_orig_module_getattr)
        def module_getattr_wrapper(mod: torch.nn.Module, attr: str) -> Any:
            return self.getattr(attr, _orig_module_getattr(mod, attr), parameter_proxy_cache)

        @functools.wraps(_orig_module_call)
        def module_call_wrapper(mod: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            def forward(*args: Any, **kwargs: Any) -> Any:
                return _orig_module_call(mod, *args, **kwargs)

            _autowrap_check(patcher, getattr(getattr(mod, "forward", mod), "__globals__", {}), ids)
            if isinstance(mod, GraphModule):
                _patch_recorded_leaves(patcher, getattr(mod.forward, "__globals__", {}), mod.graph.nodes)
            return self.call_module(mod, forward, args, kwargs)

        patcher.patch_method(torch.nn.Module, "__getattr__", module_getattr_wrapper, deduplicate=False)
        patcher.patch_method(torch.nn.Module, "__call__", module_call_wrapper, deduplicate=False)


def symbolic_trace(root: torch.nn.Module | Callable[..., Any],
                   concrete_args: dict[str, Any] | None = None) -> GraphModule:
    """Trace ``root`` and wrap the recorded Graph in a GraphModule.

    ``concrete_args`` partially specializes the inputs, e.g. to remove static control flow::

        def f(a, b):
            return a if b else a * 2

        gm = fxdist.symbolic_trace(f, concrete_args={"b": False})  # asserts b == False at run time

    Args:
        root: an ``nn.Module`` or a plain function.
        concrete_args: argument name -> value to specialize on; ``PH`` keeps a part symbolic.

    Returns:
        GraphModule: a module whose ``forward`` runs the recorded operations.

    Raises:
        TraceError: see :meth:`Tracer.trace`.

    Source: torch/fx/_symbolic_trace.py ``symbolic_trace``.
    """
    tracer = Tracer()
    graph = tracer.trace(root, concrete_args)
    name = type(root).__name__ if isinstance(root, torch.nn.Module) else root.__name__
    return GraphModule(tracer.root, graph, name)


@wrap
def _assert_is_none(value: Any, msg: str) -> None:
    if value is not None:
        raise AssertionError(msg)
