"""Node-by-node execution of a Graph (``Interpreter``) and symbolic re-tracing into a new one (``Transformer``).

An analysis that needs values is an ``Interpreter`` subclass overriding one opcode method (``ShapeProp``
overrides ``run_node``); a local rewrite is a ``Transformer`` subclass overriding ``call_function`` or
``call_method`` and returning Proxies built from its arguments.

Source: torch/fx/interpreter.py (API and semantics); torch.fx paper §5 (Interpreter).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import torch

from fxdist.graph import Graph
from fxdist.graph_module import GraphModule, _is_torch_fx
from fxdist.node import Argument, Node, Target, map_aggregate, map_arg
from fxdist.proxy import Proxy
from fxdist.tracer import Tracer

__all__ = ["Interpreter", "Transformer"]

# meta keys computed from values (ShapeProp, make_fx); a rewrite may change them, so Transformer
# does not copy them onto the nodes it creates.
_VALUE_META = frozenset({"val", "tensor_meta", "type", "example_value"})


def _last_uses(graph: Graph) -> dict[Node, list[Node]]:
    """Map each node to the values whose last use it is (the values to free right after it runs).

    One reverse walk: the first user met going backwards is the last user in execution order. A value
    nobody uses is freed right after it is computed (its own last use).
    """
    seen: set[Node] = set()
    last_uses: dict[Node, list[Node]] = {}
    for user in reversed(graph.nodes):
        if not user.users and user.op != "output":
            last_uses.setdefault(user, []).append(user)
        for value in user.all_input_nodes:
            if value not in seen:
                seen.add(value)
                last_uses.setdefault(user, []).append(value)
    return last_uses


class Interpreter:
    """Executes an FX graph node by node.

    Override any method to customize execution; the call hierarchy is::

        run()
            +-- run_node()
                +-- placeholder() / get_attr() / call_function() / call_method() / call_module() / output()

    Example (swap ``torch.neg`` and ``torch.sigmoid``, including their Tensor-method forms):

    >>> import torch, fxdist as fx
    >>> class NegSigmSwapInterpreter(fx.Interpreter):
    ...     def call_function(self, target, args, kwargs):
    ...         if target is torch.sigmoid:
    ...             return torch.neg(*args, **kwargs)
    ...         return super().call_function(target, args, kwargs)
    ...     def call_method(self, target, args, kwargs):
    ...         if target == "neg":
    ...             call_self, *args_tail = args
    ...             return call_self.sigmoid(*args_tail, **kwargs)
    ...         return super().call_method(target, args, kwargs)
    >>> gm = fx.symbolic_trace(lambda x: torch.sigmoid(x).neg())
    >>> x = torch.randn(3, 4)
    >>> torch.equal(NegSigmSwapInterpreter(gm).run(x), torch.neg(x).sigmoid())
    True

    Args:
        module: The module whose state (parameters, submodules) the graph refers to; usually the
            GraphModule that owns ``graph``.
        garbage_collect_values: Drop each value from ``self.env`` right after its last use (default).
            Pass False to inspect every intermediate value in ``self.env`` after ``run``.
        graph: The graph to execute; defaults to ``module.graph``. A torch.fx Graph (also that of a
            torch.fx GraphModule ``module``: ``make_fx``, ``torch.export``'s ``graph_module``) is
            converted first (``fxdist.interop.as_fxdist``): ``self.graph`` is then an fxdist Graph
            whose nodes share the torch.fx nodes' ``meta`` dicts, and ``self.module`` stays ``module``.

    Attributes:
        env: Node -> value computed so far in the current ``run``.

    Raises:
        TypeError: ``module`` has no ``.graph`` and no ``graph`` is given.

    Source: torch/fx/interpreter.py.
    """

    def __init__(self, module: torch.nn.Module, garbage_collect_values: bool = True, graph: Graph | None = None):
        self.module = module
        self.submodules = dict(module.named_modules())
        if graph is None:
            graph = getattr(module, "graph", None)
            if graph is None:
                raise TypeError(
                    f"Interpreter: {type(module).__name__} has no .graph; pass graph= or a GraphModule"
                )
        if _is_torch_fx(graph):  # the door for torch-built graphs (make_fx, torch.export, torch.fx tracers)
            from fxdist.interop import as_fxdist

            graph = as_fxdist(graph)
        self.graph: Graph = graph
        self.env: dict[Node, Any] = {}
        self.name = "Interpreter"
        self.garbage_collect_values = garbage_collect_values
        self.extra_traceback = True
        self.user_to_last_uses = _last_uses(graph) if garbage_collect_values else {}

    def run(self, *args: Any, initial_env: dict[Node, Any] | None = None, enable_io_processing: bool = True) -> Any:
        """Run the graph on ``args`` and return the value of its output node.

        Args:
            *args: Values for the placeholders, in order.
            initial_env: Node -> value to pre-populate; those nodes are not executed (partial evaluation).
            enable_io_processing: Pass inputs/outputs through the graph's codegen
                ``process_inputs``/``process_outputs`` (identity for the default codegen).

        Returns:
            The output node's value, or None if the graph has no output node.

        Raises:
            Exception: whatever a node raises, with a note ``While executing %name : ... = op[target=...](...)``
                (and the node's recorded stack trace, if any).
        """
        self.env = initial_env if initial_env is not None else {}
        if enable_io_processing:
            args = self.graph.process_inputs(*args)
        self.args_iter: Iterator[Any] = iter(args)
        for node in self.graph.nodes:
            if node in self.env:
                continue
            try:
                self.env[node] = self.run_node(node)
            except Exception as e:
                if self.extra_traceback:
                    self._add_node_note(e, node)
                raise
            if self.garbage_collect_values:
                for value in self.user_to_last_uses.get(node, ()):
                    del self.env[value]
            if node.op == "output":
                result = self.env[node]
                return self.graph.process_outputs(result) if enable_io_processing else result
        return None

    @staticmethod
    def _add_node_note(e: BaseException, node: Node) -> None:
        note = f"While executing {node.format_node()}"
        stack_trace = node.meta.get("stack_trace")
        if stack_trace:
            note += f"\nOriginal traceback:\n{stack_trace}"
        e.add_note(note)

    def boxed_run(self, args_list: list[Any]) -> Any:
        """Run with the "boxed" calling convention: ``args_list`` is cleared so inputs can be freed early.

        Raises:
            RuntimeError: ``len(args_list)`` differs from the number of placeholders.
        """
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        if len(args_list) != len(placeholders):  # torch.fx's message, word for word
            detail = "extra arguments" if len(args_list) > len(placeholders) else "missing arguments"
            raise RuntimeError(
                f"Interpreter.boxed_run expected {len(placeholders)} arguments for placeholders "
                f"but received {len(args_list)} ({detail})"
            )
        env = dict(zip(placeholders, args_list))
        args_list.clear()
        return self.run(initial_env=env)

    def run_node(self, n: Node) -> Any:
        """Execute node ``n``: fetch its argument values, then dispatch on ``n.op``."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        return getattr(self, n.op)(n.target, args, kwargs)

    # ---- the six opcodes -------------------------------------------------------------------------

    def placeholder(self, target: Target, args: tuple[Argument, ...], kwargs: dict[str, Any]) -> Any:
        """Return the next positional input (all remaining ones for ``*args``), else the default.

        Raises:
            RuntimeError: no input is left and the placeholder has no default.
        """
        assert isinstance(target, str)
        if target.startswith("*"):
            return list(self.args_iter)
        try:
            return next(self.args_iter)
        except StopIteration as stop:
            if args:
                return args[0]
            raise RuntimeError(
                f"Expected positional argument for parameter {target}, but one was not passed in!"
            ) from stop

    def get_attr(self, target: Target, args: tuple[Argument, ...], kwargs: dict[str, Any]) -> Any:
        """Return the attribute ``target`` (a dotted path) of ``self.module``."""
        assert isinstance(target, str)
        return self.fetch_attr(target)

    def call_function(self, target: Target, args: tuple[Argument, ...], kwargs: dict[str, Any]) -> Any:
        """Return ``target(*args, **kwargs)``."""
        assert not isinstance(target, str), f"call_function target must be callable, got {target!r}"
        return target(*args, **kwargs)

    def call_method(self, target: Target, args: tuple[Argument, ...], kwargs: dict[str, Any]) -> Any:
        """Return ``args[0].<target>(*args[1:], **kwargs)``."""
        assert isinstance(target, str)
        self_obj, *args_tail = args
        return getattr(self_obj, target)(*args_tail, **kwargs)

    def call_module(self, target: Target, args: tuple[Argument, ...], kwargs: dict[str, Any]) -> Any:
        """Return ``self.module.<target>(*args, **kwargs)``."""
        assert isinstance(target, str)
        return self.fetch_attr(target)(*args, **kwargs)

    def output(self, target: Target, args: tuple[Argument, ...], kwargs: dict[str, Any]) -> Any:
        """Return the value the output node refers to."""
        return args[0]

    # ---- helpers ----------------------------------------------------------------------------------

    def fetch_attr(self, target: str) -> Any:
        """Return the attribute at dotted path ``target`` under ``self.module``.

        Raises:
            RuntimeError: naming the first missing component of the path.
        """
        obj: Any = self.module
        atoms = target.split(".")
        for i, atom in enumerate(atoms):
            if not hasattr(obj, atom):
                raise RuntimeError(f"Node referenced nonexistent target {'.'.join(atoms[: i + 1])}")
            obj = getattr(obj, atom)
        return obj

    def fetch_args_kwargs_from_env(self, n: Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Return ``n.args`` and ``n.kwargs`` with every Node replaced by its value in ``self.env``."""
        args = self.map_nodes_to_values(n.args, n)
        kwargs = self.map_nodes_to_values(n.kwargs, n)
        assert isinstance(args, tuple) and isinstance(kwargs, dict)
        return args, kwargs

    def map_nodes_to_values(self, args: Argument, n: Node) -> Argument:
        """Replace every Node in the nested structure ``args`` by its value in ``self.env``.

        Raises:
            RuntimeError: an input of ``n`` has no value (not computed yet, or freed already).
        """

        def load(arg: Node) -> Any:
            try:
                return self.env[arg]
            except KeyError:
                raise RuntimeError(
                    f"Node {n} referenced nonexistent value {arg}! Run Graph.lint() to diagnose such issues"
                ) from None

        return map_arg(args, load)


class _TransformerTracer(Tracer):
    """Appends to ``graph``; every submodule is a leaf. Tensors that overrides pass as arguments
    become ``get_attr`` nodes (parameters and buffers by their path; other tensors as new
    ``_tensor_constant<i>`` attributes of the root), as when tracing."""

    record_stack_traces = False  # nodes inherit the stack trace of the node they come from

    def __init__(self, graph: Graph, root: torch.nn.Module) -> None:
        super().__init__()
        self.graph = graph
        self.root = root
        self.tensor_attrs: dict[Any, str] = {}
        self.submodule_paths = {mod: name for name, mod in root.named_modules()}

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return True


class Transformer(Interpreter):
    """Re-traces a GraphModule symbolically into a new Graph; ``transform()`` returns the new module.

    Every opcode method receives Proxies (over the new graph) instead of values, so an override can
    build its replacement with ordinary torch calls:

    >>> import torch, fxdist as fx
    >>> class NegSigmSwapXformer(fx.Transformer):
    ...     def call_function(self, target, args, kwargs):
    ...         if target is torch.sigmoid:
    ...             return torch.neg(*args, **kwargs)
    ...         return super().call_function(target, args, kwargs)
    ...     def call_method(self, target, args, kwargs):
    ...         if target == "neg":
    ...             call_self, *args_tail = args
    ...             return call_self.sigmoid(*args_tail, **kwargs)
    ...         return super().call_method(target, args, kwargs)
    >>> gm = fx.symbolic_trace(lambda x: torch.sigmoid(x).neg())
    >>> print(NegSigmSwapXformer(gm).transform().code.strip())
    def forward(self, x):
        neg = torch.neg(x);  x = None
        sigmoid = neg.sigmoid();  neg = None
        return sigmoid

    Placeholders keep their names and defaults; ``get_attr`` and ``call_module`` nodes are kept as
    they are (submodules are never traced through); each new node inherits the meta of the node it
    was produced from (stack trace, module stack...; not the value-derived ``val``/``tensor_meta``,
    and without overwriting keys the override set).

    Args:
        module: The GraphModule to transform.

    Source: torch/fx/interpreter.py (Transformer).
    """

    def __init__(self, module: GraphModule) -> None:
        super().__init__(module)  # converts a torch.fx graph: use self.graph below
        self.new_graph = Graph()
        self.new_graph.set_codegen(self.graph._codegen)  # keeps a pytree signature, for example
        self.tracer = _TransformerTracer(self.new_graph, module)

    def run_node(self, n: Node) -> Any:
        last_before = next(iter(reversed(self.new_graph.nodes)), None)
        result = super().run_node(n)
        for new in reversed(self.new_graph.nodes):  # the nodes this call appended, newest first
            if new is last_before:
                break
            for key, value in n.meta.items():
                if key not in _VALUE_META:
                    new.meta.setdefault(key, value)
        return result

    def placeholder(self, target: Target, args: tuple[Argument, ...], kwargs: dict[str, Any]) -> Proxy:
        """Insert a placeholder with the same target and default into the new graph."""
        assert isinstance(target, str)
        default = args[0] if args else inspect.Signature.empty
        return Proxy(self.new_graph.placeholder(target, default_value=default), self.tracer)

    def get_attr(self, target: Target, args: tuple[Argument, ...], kwargs: dict[str, Any]) -> Proxy:
        """Insert a ``get_attr`` node with the same target into the new graph."""
        assert isinstance(target, str)
        return self.tracer.create_proxy("get_attr", target, args, kwargs)

    def call_module(self, target: Target, args: tuple[Argument, ...], kwargs: dict[str, Any]) -> Any:
        """Insert a ``call_module`` node with the same target (``self.tracer`` decides leaves: all are)."""
        assert isinstance(target, str)
        submod = self.fetch_attr(target)
        return self.tracer.call_module(submod, submod.forward, args, kwargs)

    def call_function(self, target: Target, args: tuple[Argument, ...], kwargs: dict[str, Any]) -> Proxy:
        """Insert a ``call_function`` node (the function is recorded, not run on the Proxies)."""
        return self.tracer.create_proxy("call_function", target, args, kwargs)

    def call_method(self, target: Target, args: tuple[Argument, ...], kwargs: dict[str, Any]) -> Proxy:
        """Insert a ``call_method`` node (the method is recorded, not looked up on the Proxy)."""
        return self.tracer.create_proxy("call_method", target, args, kwargs)

    def transform(self) -> GraphModule:
        """Run the Transformer over ``self.module`` and return the new GraphModule.

        The new module shares the original's submodules and attributes that the new graph refers to.
        """
        result = super().run(enable_io_processing=False)
        if result is not None:
            out = self.new_graph.output(map_aggregate(result, lambda a: a.node if isinstance(a, Proxy) else a))
            old_out = next(iter(reversed(self.graph.nodes)))
            assert old_out.op == "output", f"graph must end with an output node, found {old_out.format_node()}"
            out.meta.update(old_out.meta)
        return GraphModule(self.module, self.new_graph)
