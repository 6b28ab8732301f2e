"""``Graph``: the IR, a circular doubly linked list of :class:`~fxdist.node.Node` s.

Source: torch/fx/graph.py (torch 2.13): the node list, insertion points, code generation, lint. A sentinel
``_root`` node (op ``"root"``) closes the ring: ``_root._next`` is the first node and ``_root._prev`` the last,
so insertion and erasure are O(1). ``graph.nodes`` iterates in either direction and tolerates erasing the current node.
New nodes go to the insert point (the end, unless ``inserting_before``/``inserting_after`` says
otherwise); a side table keyed by ``(op, target)`` serves ``find_nodes`` without scanning.

Differences from torch.fx 2.13 (everything else, names, ``str(graph)`` and sort keys included, is
identical; see tests/fx/test_graph.py):

1. ``lint`` also checks use-def consistency and arg structure, and its errors name the node, suggest a
   fix and carry the graph with the culprit marked as an exception note (same key phrases).
2. ``Node.is_impure`` (so DCE) also keeps in-place calls, ``torch.distributed`` RPC/collectives,
   dropout in training and ``meta["impure"]`` nodes; a ``call_module`` without owning module is pure.
3. ``all_input_nodes`` is always in first-appearance order (torch.fx's ``insert_arg`` appends).
4. Errors where torch.fx asserts are ValueError/TypeError/RuntimeError that are also AssertionError.
5. A ``Graph`` pickles as a flat node list (no recursion limit); a pickled or deep-copied ``Node`` comes
   back as its counterpart in one copy of its graph; ``reversed(graph.nodes)`` is a view.
6. A node is never named ``self`` or ``operator``; assigning ``node.name`` reserves that name in the
   graph's namespace; ``print_tabular`` prints torch.fx's table through ``tabulate`` when it is
   installed and the same layout from its own formatter when not (torch.fx raises ImportError).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import re
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal

import torch

from fxdist._graph_lint import lint_graph
from fxdist._graph_state import graph_getstate, graph_setstate
from fxdist._namespace import Namespace
from fxdist.node import (
    Argument,
    Node,
    Target,
    _CompatRuntimeError,
    _CompatTypeError,
    _CompatValueError,
    _legal_ops,
    map_arg,
)

if TYPE_CHECKING:
    from fxdist.codegen import CodeGen, PythonCode

__all__ = ["Graph"]


def _is_magic(x: str) -> bool:
    return x.startswith("__") and x.endswith("__")


# a lowercase letter followed by an uppercase one: "pascalCase" -> "pascal_Case"
_snake_case_sub = functools.partial(re.compile(r"(?<=[a-z])([A-Z])").sub, r"_\1")


def _snake_case(s: str) -> str:
    """``mod.pascalCase`` -> ``mod.pascal_case``; ``ALL_CAPS`` -> ``all_caps``."""
    return _snake_case_sub(s).lower()


def _new_codegen() -> CodeGen:
    from fxdist.codegen import CodeGen
    return CodeGen()


class _InsertPoint:
    """Context manager restoring the graph's previous insert point on exit (setting it is immediate)."""

    def __init__(self, graph: Graph, new_insert: Callable[[Node], None]) -> None:
        self.graph = graph
        self.orig_insert, graph._insert = graph._insert, new_insert

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        self.graph._insert = self.orig_insert


def _iter_next(root: Node) -> Iterator[Node]:
    cur = root._next
    while cur is not root:
        if not cur._erased:
            yield cur
        cur = cur._next


def _iter_prev(root: Node) -> Iterator[Node]:
    cur = root._prev
    while cur is not root:
        if not cur._erased:
            yield cur
        cur = cur._prev


class _node_list:  # noqa: N801 - torch.fx name
    """A live view of a graph's nodes: ``len``, iteration, ``reversed``. Erased nodes are skipped, so a
    loop may erase the node it stands on."""

    def __init__(self, graph: Graph, direction: Literal["_prev", "_next"] = "_next") -> None:
        if direction not in ("_next", "_prev"):
            raise ValueError(f"direction must be '_next' or '_prev', got {direction!r}")
        self.graph = graph
        self.direction = direction

    def __len__(self) -> int:
        return self.graph._len

    def __iter__(self) -> Iterator[Node]:
        return (_iter_next if self.direction == "_next" else _iter_prev)(self.graph._root)

    def __reversed__(self) -> _node_list:
        # a view again (torch/fx/graph.py ``_node_list``), so reversed(graph.nodes) also has len() and can be
        # reversed back
        return _node_list(self.graph, "_prev" if self.direction == "_next" else "_next")


class _FindNodesLookupTable:
    """Nodes by op and by ``(op, target)``, kept in sync by insert/erase and by assignments to a node's
    ``op``/``target``; each bucket is an insertion-ordered dict, so every query is a lookup, not a scan."""

    def __init__(self) -> None:
        self.by_op: dict[str, dict[Node, None]] = defaultdict(dict)
        self.by_target: dict[tuple[str, Any], dict[Node, None]] = defaultdict(dict)

    @staticmethod
    def _key(op: str, target: Any) -> tuple[str, Any]:
        try:
            hash(target)
        except TypeError:  # an unhashable callable: key it by identity
            return (op, ("<unhashable>", id(target)))
        return (op, target)

    def __contains__(self, node: Node) -> bool:
        return node in self.by_target.get(self._key(node.op, node.target), ()) and node in self.by_op[node.op]

    def insert(self, node: Node) -> None:
        self.by_op[node.op][node] = None
        self.by_target[self._key(node.op, node.target)][node] = None

    def remove(self, node: Node) -> None:
        self.by_op[node.op].pop(node, None)
        self.by_target[self._key(node.op, node.target)].pop(node, None)

    def find_nodes(self, *, op: str, target: Target | None = None) -> list[Node]:
        if target is None:
            if op == "call_function":
                raise _CompatValueError("find_nodes(op='call_function') needs target= (the function)")
            return [*self.by_op.get(op, ())]
        return [*self.by_target.get(self._key(op, target), ())]


class Graph:
    """The fxdist IR: a list of nodes forming one Python function. Source: torch/fx/graph.py ``Graph``.

    >>> import operator, torch
    >>> g = Graph()
    >>> x = g.placeholder("x")
    >>> r = g.call_function(torch.relu, (g.call_function(operator.add, (x, 1)),))
    >>> _ = g.output(r)
    >>> print(g)
    graph():
        %x : [num_users=1] = placeholder[target=x]
        %add : [num_users=1] = call_function[target=operator.add](args = (%x, 1), kwargs = {})
        %relu : [num_users=1] = call_function[target=torch.relu](args = (%add,), kwargs = {})
        return relu
    """

    def __init__(self, owning_module: Any | None = None, tracer_cls: type | None = None,
                 tracer_extras: dict[str, Any] | None = None) -> None:
        self._find_nodes_lookup_table = _FindNodesLookupTable()
        self._root: Node = Node(self, "", "root", "", (), {})
        self._insert: Callable[[Node], None] = self._root.prepend
        self._len = 0
        self._graph_namespace = Namespace()
        self._owning_module = owning_module
        self._tracer_cls = tracer_cls
        self._tracer_extras = tracer_extras
        self._co_fields: dict[str, Any] = {}
        self._codegen_obj: CodeGen | None = None

    @property
    def _codegen(self) -> CodeGen:
        if self._codegen_obj is None:
            self._codegen_obj = _new_codegen()
        return self._codegen_obj

    @_codegen.setter
    def _codegen(self, codegen: CodeGen) -> None:
        self._codegen_obj = codegen

    @property
    def owning_module(self) -> Any | None:
        """The ``GraphModule`` this graph belongs to (set by ``GraphModule.graph``), or None."""
        return self._owning_module

    @owning_module.setter
    def owning_module(self, mod: Any | None) -> None:
        self._owning_module = mod

    @property
    def nodes(self) -> _node_list:
        """The nodes in order; ``reversed(graph.nodes)`` walks backwards. Safe to mutate while iterating."""
        return _node_list(self)

    def output_node(self) -> Node:
        """The last node, which must be the ``output`` node.

        Raises:
            RuntimeError: the graph does not end with an output node (also an AssertionError).
        """
        last = self._root._prev
        if last is self._root or last.op != "output":
            raise _CompatRuntimeError(f"Graph.output_node: the last node is {last.name or '(none)'!r}, "
                                      f"not an output; add one with graph.output(value)")
        return last

    def find_nodes(self, *, op: str, target: Target | None = None, sort: bool = True) -> list[Node]:
        """Nodes with this ``op`` (and ``target``; required for ``call_function``), from the side table.

        Args:
            op: the opcode.
            target: the target to match; for ``call_function`` compared by the function object.
            sort: return them in graph order (else in insertion order).

        Returns:
            A new list, so the graph may be mutated while walking it.

        Raises:
            ValueError: ``op == "call_function"`` and no ``target``.
        """
        found = self._find_nodes_lookup_table.find_nodes(op=op, target=target)
        return sorted(found) if sort else found

    # -- building -----------------------------------------------------------------------------------
    def create_node(self, op: str, target: Target, args: tuple[Argument, ...] | None = None,
                    kwargs: dict[str, Argument] | None = None, name: str | None = None,
                    type_expr: Any | None = None) -> Node:
        """Create a node at the current insert point.

        Args:
            op: one of the six opcodes.
            target: callable for ``call_function``, str otherwise.
            args: positional arguments (a tuple).
            kwargs: keyword arguments (a dict).
            name: preferred name; made unique (``add`` -> ``add_1``). Default: derived from ``target``.
            type_expr: the Python type of the value, used for annotations.

        Raises:
            TypeError: ``args`` is not a tuple or ``kwargs`` not a dict.
            ValueError: bad ``op``/``target`` combination (see :class:`Node`).
        """
        if not args:
            args = ()
        elif not isinstance(args, tuple):
            raise _CompatTypeError(
                f"create_node({op!r}, {target!r}): args must be a tuple, got {type(args).__name__}")
        if not kwargs:
            kwargs = {}
        elif not isinstance(kwargs, dict):
            raise _CompatTypeError(
                f"create_node({op!r}, {target!r}): kwargs must be a dict, got {type(kwargs).__name__}")
        candidate = name if name is not None else self._target_to_str(target)
        name = self._graph_namespace.create_name(candidate, None)
        n = Node(self, name, op, target, args, kwargs, type_expr)
        for hook in getattr(self.owning_module, "_create_node_hooks", None) or ():
            hook(n)
        self._graph_namespace.associate_name_with_obj(name, n)
        self._insert(n)
        self._find_nodes_lookup_table.insert(n)
        self._len += 1
        return n

    def placeholder(self, name: str, type_expr: Any | None = None,
                    default_value: Any = inspect.Signature.empty) -> Node:
        """Add a function input named ``name``; ``default_value`` (if given) becomes ``args[0]``."""
        args = () if default_value is inspect.Signature.empty else (default_value,)
        return self.create_node("placeholder", name, args=args, type_expr=type_expr)

    def get_attr(self, qualified_name: str, type_expr: Any | None = None) -> Node:
        """Add a fetch of the parameter/buffer/submodule at dotted path ``qualified_name``.

        Warns (UserWarning) when an owning module is set and has no such parameter, buffer or submodule.
        """
        root = self.owning_module
        if root is not None and not _attr_reference_exists(root, qualified_name):
            warnings.warn(
                f"Attempted to insert a get_attr Node with no underlying reference in the owning GraphModule "
                f"({qualified_name!r})! Call GraphModule.add_submodule to add the necessary submodule, "
                f"GraphModule.add_parameter to add the necessary Parameter, or nn.Module.register_buffer "
                f"to add the necessary buffer", stacklevel=2)
        return self.create_node("get_attr", qualified_name, type_expr=type_expr)

    def call_module(self, module_name: str, args: tuple[Argument, ...] | None = None,
                    kwargs: dict[str, Argument] | None = None, type_expr: Any | None = None) -> Node:
        """Add a call of the submodule at dotted path ``module_name`` (args exclude ``self``).

        Warns (UserWarning) when an owning module is set and has no such submodule.
        """
        root = self.owning_module
        if root is not None:
            try:
                root.get_submodule(module_name)
            except AttributeError:
                warnings.warn(
                    f"Attempted to insert a call_module Node with no underlying reference in the owning "
                    f"GraphModule ({module_name!r})! Call GraphModule.add_submodule to add the necessary "
                    f"submodule", stacklevel=2)
        return self.create_node("call_module", module_name, args, kwargs, type_expr=type_expr)

    def call_method(self, method_name: str, args: tuple[Argument, ...] | None = None,
                    kwargs: dict[str, Argument] | None = None, type_expr: Any | None = None) -> Node:
        """Add a call of method ``method_name`` on ``args[0]``."""
        return self.create_node("call_method", method_name, args, kwargs, type_expr=type_expr)

    def call_function(self, the_function: Callable[..., Any], args: tuple[Argument, ...] | None = None,
                      kwargs: dict[str, Argument] | None = None, type_expr: Any | None = None,
                      name: str | None = None) -> Node:
        """Add a call of the free function ``the_function``."""
        return self.create_node("call_function", the_function, args, kwargs, name=name, type_expr=type_expr)

    def output(self, result: Argument, type_expr: Any | None = None) -> Node:
        """Add the ``output`` node returning ``result``."""
        return self.create_node(op="output", target="output", args=(result,), type_expr=type_expr)

    def node_copy(self, node: Node, arg_transform: Callable[[Node], Argument] = lambda x: x) -> Node:
        """Copy ``node`` (possibly of another graph) into this graph at the insert point.

        Args:
            node: the node to copy; its name is kept if free here.
            arg_transform: maps each ``Node`` in ``node``'s args/kwargs to its counterpart in this graph.

        Returns:
            The new node, with a shallow copy of ``node.meta``.
        """
        args = map_arg(node.args, arg_transform)
        kwargs = map_arg(node.kwargs, arg_transform)
        result = self.create_node(node.op, node.target, tuple(args), dict(kwargs), node.name, node.type)
        result.meta = copy.copy(node.meta)
        return result

    def graph_copy(self, g: Graph, val_map: dict[Node, Node], return_output_node: bool = False) -> Any:
        """Copy every node of ``g`` except its output into this graph.

        Args:
            g: the source graph.
            val_map: filled with source node -> new node; entries already there are not copied (use it to
                substitute values).
            return_output_node: also return ``g``'s output node.

        Returns:
            The value ``g`` returns, mapped into this graph (``(value, output_node)`` if
            ``return_output_node``), or None when ``g`` has no output node.
        """
        for node in g.nodes:
            if node in val_map:
                continue
            if node.op == "output":
                rv = map_arg(node.args[0], lambda n: val_map[n])
                return (rv, node) if return_output_node else rv
            val_map[node] = self.node_copy(node, lambda n: val_map[n])
        return None

    def __deepcopy__(self, memo: dict[Any, Any] | None = None) -> Graph:
        """Copy node by node (no recursion along the list). ``memo`` also receives old node -> new node,
        so ``copy.deepcopy(node)`` can return the node's counterpart (see ``Node.__deepcopy__``)."""
        memo = {} if memo is None else memo
        g = Graph(tracer_cls=self._tracer_cls)
        memo[id(self)] = g
        out = g.graph_copy(self, val_map=memo, return_output_node=True)
        if self._codegen_obj is not None:
            g._codegen = copy.deepcopy(self._codegen_obj)
        if out is not None:
            value, old_output = out
            new_output = g.output(value, type_expr=getattr(old_output, "type", None))
            new_output.meta = copy.copy(old_output.meta)
            memo[old_output] = new_output
        return g

    def __getstate__(self) -> dict[str, Any]:
        return graph_getstate(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        Graph.__init__(self)
        graph_setstate(self, state)

    # -- insert point and erasure -------------------------------------------------------------------
    def inserting_before(self, n: Node | None = None) -> _InsertPoint:
        """Insert new nodes just before ``n`` (the start of the graph if None) until the ``with`` ends.

        Raises:
            ValueError: ``n`` belongs to another graph.
        """
        if n is None:
            return self.inserting_after(self._root)
        self._check_own(n, "inserting_before")
        return _InsertPoint(self, n.prepend)

    def inserting_after(self, n: Node | None = None) -> _InsertPoint:
        """Insert new nodes just after ``n`` (the end of the graph if None) until the ``with`` ends.

        Each new node goes right after ``n``, so several inserts end up in reverse creation order
        (torch.fx behaviour); use ``inserting_before(n.next)`` to keep creation order.

        Raises:
            ValueError: ``n`` belongs to another graph.
        """
        if n is None:
            return self.inserting_before(self._root)
        self._check_own(n, "inserting_after")
        return _InsertPoint(self, n.append)

    def _check_own(self, n: Node, what: str) -> None:
        if n.graph is not self:
            raise _CompatValueError(f"Graph.{what}({n.name}): node {n.name} is not in this graph")

    def erase_node(self, to_erase: Node) -> None:
        """Remove ``to_erase``, which must have no users; its inputs lose it as a user.

        Raises:
            RuntimeError: the node still has users (named in the message) or belongs to another graph.
        """
        if to_erase.users:
            users = ", ".join(u.name for u in to_erase.users)
            raise RuntimeError(
                f"Tried to erase Node {to_erase} but it still had {len(to_erase.users)} users in the graph: "
                f"{to_erase.users}! Users: {users}. Call {to_erase}.replace_all_uses_with(new_node) "
                f"(or erase the users first).")
        if to_erase.graph is not self:
            raise RuntimeError(f"Attempting to remove {to_erase} from wrong graph!")
        if to_erase._erased:
            warnings.warn(f"erase_node({to_erase}) on an already erased node", stacklevel=2)
            return
        for hook in getattr(self.owning_module, "_erase_node_hooks", None) or ():
            hook(to_erase)
        self._find_nodes_lookup_table.remove(to_erase)
        to_erase._remove_from_list()
        to_erase._erased = True
        self._len -= 1
        to_erase._update_args_kwargs(map_arg(to_erase._args, lambda n: None),
                                     map_arg(to_erase._kwargs, lambda n: None))

    def _clear_nodes(self) -> None:
        for node in reversed(self.nodes):
            node.meta.clear()
            self.erase_node(node)

    # -- names, code, printing ----------------------------------------------------------------------
    def _target_to_str(self, target: Target | None) -> str:
        if callable(target):
            op = getattr(target, "__name__", None) or type(target).__name__
        else:
            if not isinstance(target, str):
                raise _CompatValueError(f"node target must be a callable (call_function) or a str, got "
                                        f"{type(target).__name__} {target!r}")
            op = target[2:-2] if _is_magic(target) else target
        return _snake_case(op)

    def python_code(self, root_module: str, *, verbose: bool = False, **options: Any) -> PythonCode:
        """Generate the Python source of ``forward`` for this graph (delegates to ``CodeGen``).

        Args:
            root_module: the name qualified targets are looked up on, usually ``"self"``.
            verbose: annotate each line with its node's provenance.
        """
        return self._codegen.gen_python_code(self.nodes, root_module, verbose=verbose, **options)

    def set_codegen(self, codegen: CodeGen) -> None:
        """Use ``codegen`` for ``python_code``."""
        self._codegen = codegen

    def on_generate_code(self, make_transformer: Callable[[Any], Callable[[list[str]], list[str]]]) -> Any:
        """Install ``make_transformer(current)`` as the codegen's body transformer (a function over the
        list of generated body lines). Returns a context manager that restores the previous one; the new
        transformer stays installed if it is not used in a ``with``.
        """
        codegen = self._codegen
        previous = getattr(codegen, "_body_transformer", None)
        codegen._body_transformer = make_transformer(previous)

        @contextlib.contextmanager
        def restore() -> Iterator[None]:
            try:
                yield
            finally:
                codegen._body_transformer = previous

        return restore()

    def process_inputs(self, *args: Any) -> Any:
        return self._codegen.process_inputs(*args)

    def process_outputs(self, out: Any) -> Any:
        return self._codegen.process_outputs(out)

    def __str__(self) -> str:
        # torch.fx passes an empty list (so placeholders print as lines) and no return-type slot
        placeholder_names: list[str] = []
        lines = [n.format_node(placeholder_names) for n in self.nodes]
        s = f"graph({', '.join(placeholder_names)}):"
        return s + "".join("\n    " + line for line in lines if line)

    def print_tabular(self) -> None:
        """Print the nodes as a table with columns opcode, name, target, args, kwargs.

        With the ``tabulate`` package installed the text is torch.fx's (it calls ``tabulate`` the same
        way). Without it, torch.fx prints an install hint and raises ``ImportError``; fxdist prints the
        same ``simple`` layout from its own formatter (identical for cells without newlines or
        numbers-only columns). Source: torch/fx/graph.py ``Graph.print_tabular``.
        """
        node_specs = [[n.op, n.name, n.target, n.args, n.kwargs] for n in self.nodes]
        headers = ["opcode", "name", "target", "args", "kwargs"]
        try:
            from tabulate import tabulate
        except ImportError:
            print(_tabulate([[str(c) for c in row] for row in node_specs], headers))
            return
        print(tabulate(node_specs, headers=headers))

    # -- checks and cleanup -------------------------------------------------------------------------
    def lint(self) -> None:
        """Check the graph is well formed (torch/fx/graph.py ``Graph.lint``).

        Checks: every opcode is legal; every node (and every input) belongs to this graph; inputs are
        defined before use (topological order) and not erased; names are unique; args is a tuple and
        kwargs a dict with str keys, and ``users``/``all_input_nodes`` agree with them; and, when an
        owning module is set, ``get_attr``/``call_module`` targets exist in it.

        Raises:
            RuntimeError: naming the node, the fault and a fix; a note shows the graph with the culprit
                marked.
        """
        lint_graph(self, _legal_ops)

    def eliminate_dead_code(self, is_impure_node: Callable[[Node], bool] | None = None) -> bool:
        """Erase nodes that have no users and no side effects, last to first.

        Args:
            is_impure_node: decides which nodes to keep even when unused (default ``Node.is_impure``:
                placeholders, output, in-place/RPC/random calls, ``meta["impure"]``, ...).

        Returns:
            Whether any node was erased (here or in a GraphModule child referenced by ``get_attr``).

        Raises:
            RuntimeError: the graph does not lint (DCE needs topological order).
        """
        self.lint()
        impure = is_impure_node if is_impure_node is not None else Node.is_impure
        changed = False
        for node in reversed(self.nodes):
            if not node.users and not impure(node):
                self.erase_node(node)
                changed = True
        root = self.owning_module
        if root is not None:
            referenced = {n.target for n in self.find_nodes(op="get_attr")}
            for child_name, child in root.named_children():
                if child_name in referenced and isinstance(getattr(child, "graph", None), Graph):
                    changed |= child.graph.eliminate_dead_code()
                    child.recompile()
        return changed


def _attr_reference_exists(mod: torch.nn.Module, qualified_name: str) -> bool:
    module_path, _, name = qualified_name.rpartition(".")
    try:
        submod = mod.get_submodule(module_path)
    except AttributeError:
        return False
    if not hasattr(submod, name):
        return False
    res = getattr(submod, name)
    return isinstance(res, (torch.nn.Module, torch.nn.Parameter)) or name in submod._buffers


def _tabulate(rows: list[list[str]], headers: list[str]) -> str:
    """A plain-text table in the layout of ``tabulate``'s default ("simple") format: columns
    left-aligned, at least 2 wider than their header, 2 spaces apart, trailing spaces stripped."""
    widths = [max([len(h) + 2] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*headers), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)

