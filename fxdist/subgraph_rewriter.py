"""Find every non-overlapping occurrence of a pattern graph and replace it with a replacement graph.

The rewrite runs in four steps, one function each (tests print the graph after each step):

1. **Match** (``SubgraphMatcher.match``): walk backwards from each pattern *anchor* (a returned node)
   over use-def edges, pairing pattern nodes with graph nodes: a pattern placeholder matches any node
   or literal; any other pattern node matches a graph node with the same op and target whose inputs
   match recursively (literal arguments must be equal). A match is kept only if every user of an
   internal matched node is itself in the match and it shares no node with an earlier match.
2. **Copy** (``_copy_replacement``): copy the replacement graph into the graph, its placeholders
   bound to the matched inputs, just before the first user of the matched outputs.
3. **Rewire** (``_rewire``): redirect every use of a matched output to the copied output.
4. **Erase** (``_erase_matched``): erase the matched nodes, now without users, last one first.

Source: torch/fx/subgraph_rewriter.py and torch/fx/passes/utils/matcher_utils.py (semantics);
the ``add -> mul`` example of ``replace_pattern``'s docstring (torch/fx/subgraph_rewriter.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import torch

from fxdist.graph import Graph
from fxdist.graph_module import GraphModule, _is_torch_fx
from fxdist.node import Node

__all__ = [
    "InternalMatch",
    "Match",
    "ReplacedPatterns",
    "SubgraphMatcher",
    "replace_pattern",
    "replace_pattern_with_filters",
]


class Match(NamedTuple):
    """A replaced occurrence.

    Attributes:
        anchor: The pattern node matching started from (its first anchor), as in torch.fx 2.13.
        nodes_map: Pattern node -> graph node it matched (a literal for a placeholder bound to one);
            the matched compute nodes have been erased from the graph by the time this is returned.
    """

    anchor: Node
    nodes_map: dict[Node, Node]


@dataclass
class ReplacedPatterns:
    """A replaced occurrence, with the nodes the replacement added (``replacements``)."""

    anchor: Node
    nodes_map: dict[Node, Node]
    replacements: list[Node]


@dataclass
class InternalMatch:
    """One occurrence found by ``SubgraphMatcher``; what ``match_filters`` receive.

    Attributes:
        anchors: The pattern's anchors (returned nodes with no other user).
        nodes_map: Pattern node -> graph node (a literal where a pattern placeholder matched one).
        placeholder_nodes: Graph values bound to the pattern placeholders, in placeholder order.
        returning_nodes: Graph nodes matched to the pattern's returned nodes, in output order.
    """

    anchors: list[Node]
    nodes_map: dict[Node, Any] = field(default_factory=dict)
    placeholder_nodes: list[Any] = field(default_factory=list)
    returning_nodes: list[Node] = field(default_factory=list)
    name_node_map: dict[str, Node] = field(default_factory=dict)


def _is_compute(pn: Node) -> bool:
    return pn.op not in ("placeholder", "output")


class SubgraphMatcher:
    """Finds occurrences of a pattern graph in a graph (step 1).

    Args:
        pattern: The pattern graph; every node but the output must be used (no dead code).
        match_output: Also match the pattern's output node to the graph's output node.
        match_placeholder: Match pattern placeholders only to graph placeholders (else: wildcards).
        remove_overlapping_matches: Keep only the first of matches that share a compute node.
        ignore_literals: Treat literal arguments as wildcards.

    Raises:
        ValueError: the pattern is empty, has no output, or has dead code.

    Source: torch/fx/passes/utils/matcher_utils.py (``SubgraphMatcher``).
    """

    def __init__(
        self,
        pattern: Graph,
        match_output: bool = False,
        match_placeholder: bool = False,
        remove_overlapping_matches: bool = True,
        ignore_literals: bool = False,
    ) -> None:
        self.pattern = pattern
        self.match_output = match_output
        self.match_placeholder = match_placeholder
        self.remove_overlapping_matches = remove_overlapping_matches
        self.ignore_literals = ignore_literals
        nodes = list(pattern.nodes)
        if not nodes or nodes[-1].op != "output":
            raise ValueError("SubgraphMatcher: the pattern graph must be non-empty and end with an output node")
        for pn in nodes[:-1]:
            if not pn.users and not pn.is_impure():
                raise ValueError(
                    f"SubgraphMatcher: pattern node {pn.format_node()} is dead code (no users); "
                    "remove it or return it from the pattern"
                )
        output = nodes[-1]
        self.pattern_placeholder_nodes = [pn for pn in nodes if pn.op == "placeholder"]
        self.pattern_returning_nodes: list[Node] = output.all_input_nodes
        if match_output:
            self.pattern_anchors = [output]
        else:
            self.pattern_anchors = [pn for pn in self.pattern_returning_nodes if len(pn.users) == 1]

    # ---- node-level matching -----------------------------------------------------------------

    def _nodes_are_equal(self, pn: Node, gn: Node) -> bool:
        if pn.op == "placeholder" and not self.match_placeholder:
            return True
        if pn.op != gn.op:
            return False
        if pn.op in ("placeholder", "output"):
            return True
        if pn.op == "get_attr":
            return self._attributes_match(pn, gn)
        return pn.target == gn.target

    @staticmethod
    def _attributes_match(pn: Node, gn: Node) -> bool:
        """A pattern ``get_attr`` matches one whose value has the same type (any tensor matches a tensor)."""

        def value(n: Node) -> Any:
            obj: Any = n.graph.owning_module
            if obj is None:
                raise ValueError(f"cannot match {n.format_node()}: its graph has no owning module")
            for atom in str(n.target).split("."):
                obj = getattr(obj, atom)
            return obj

        pv, gv = value(pn), value(gn)
        return type(pv) is type(gv) or (isinstance(pv, torch.Tensor) and isinstance(gv, torch.Tensor))

    def _match_literal(self, pa: Any, ga: Any, match: InternalMatch) -> bool:
        if isinstance(pa, Node):  # only a pattern placeholder may stand for a literal
            if pa.op != "placeholder" or self.match_placeholder:
                return False
            if pa in match.nodes_map:
                return _same(match.nodes_map[pa], ga)
            match.nodes_map[pa] = ga
            return True
        if isinstance(ga, Node):
            return False
        return self.ignore_literals or (type(pa) is type(ga) and _same(pa, ga))

    def _match_args(self, pargs: Sequence[Any], gargs: Sequence[Any], match: InternalMatch) -> bool:
        if len(pargs) != len(gargs):
            return False
        for pa, ga in zip(pargs, gargs):
            if isinstance(pa, Node) and isinstance(ga, Node):
                ok = self._match_nodes(pa, ga, match)
            elif isinstance(pa, (list, tuple)) and isinstance(ga, (list, tuple)):
                ok = self._match_args(pa, ga, match)
            else:
                ok = self._match_literal(pa, ga, match)
            if not ok:
                return False
        return True

    def _match_nodes(self, pn: Node, gn: Node, match: InternalMatch) -> bool:
        """Pair ``pn`` with ``gn`` and, recursively, their inputs. On failure ``match`` is restored."""
        if pn in match.nodes_map:
            return match.nodes_map[pn] is gn
        if any(v is gn for v in match.nodes_map.values()) or not self._nodes_are_equal(pn, gn):
            return False
        saved = dict(match.nodes_map)
        match.nodes_map[pn] = gn
        if pn.op == "placeholder":
            return True
        same_keys = list(pn.kwargs) == list(gn.kwargs) or isinstance(pn.target, torch._ops.OpOverload)
        ok = same_keys and self._match_args(_comparable_args(pn), _comparable_args(gn), match)
        if not ok:
            match.nodes_map.clear()
            match.nodes_map.update(saved)
        return ok

    # ---- graph-level matching ----------------------------------------------------------------

    def match(self, graph: Graph) -> list[InternalMatch]:
        """Return the occurrences of the pattern in ``graph``, in graph order of their first anchor.

        Each returned match is self-contained (only returned nodes have users outside it), would not
        form a cycle if fused, and (with ``remove_overlapping_matches``) shares no compute node with
        an earlier one.
        """
        candidates = [
            (anchor, [gn for gn in graph.nodes if self._nodes_are_equal(anchor, gn)]) for anchor in self.pattern_anchors
        ]
        found: list[InternalMatch] = []
        if candidates:
            self._backtrack(candidates, 0, InternalMatch(anchors=self.pattern_anchors), found)
        found = [m for m in found if self._is_contained(m) and not _forms_cycle(m, self._compute_nodes(m))]
        if self.remove_overlapping_matches:
            found = self._without_overlaps(found)
        return found

    def _backtrack(
        self, candidates: list[tuple[Node, list[Node]]], index: int, match: InternalMatch, found: list[InternalMatch]
    ) -> None:
        if index == len(candidates):
            done = InternalMatch(anchors=match.anchors, nodes_map=dict(match.nodes_map))
            done.placeholder_nodes = [done.nodes_map[pn] for pn in self.pattern_placeholder_nodes]
            done.returning_nodes = [done.nodes_map[pn] for pn in self.pattern_returning_nodes]
            found.append(done)
            return
        anchor, graph_nodes = candidates[index]
        saved = dict(match.nodes_map)
        for gn in graph_nodes:
            if self._match_nodes(anchor, gn, match):
                self._backtrack(candidates, index + 1, match, found)
            match.nodes_map = dict(saved)

    def _compute_nodes(self, match: InternalMatch) -> list[Node]:
        return [gn for pn, gn in match.nodes_map.items() if _is_compute(pn)]

    def _is_contained(self, match: InternalMatch) -> bool:
        inside = {gn for pn, gn in match.nodes_map.items() if _is_compute(pn)}
        returned = set(self.pattern_returning_nodes)
        for pn, gn in match.nodes_map.items():
            if _is_compute(pn) and pn not in returned and any(user not in inside for user in gn.users):
                return False
        return True

    def _without_overlaps(self, matches: list[InternalMatch]) -> list[InternalMatch]:
        taken: set[Node] = set()
        kept = []
        for m in matches:
            nodes = self._compute_nodes(m)
            if not any(gn in taken for gn in nodes):
                kept.append(m)
                taken.update(nodes)
        return kept


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Node) or isinstance(b, Node):
        return a is b
    try:
        return bool(a == b)
    except Exception:  # e.g. tensors with several elements
        return a is b


def _comparable_args(n: Node) -> list[Any]:
    """Arguments of ``n`` in a canonical order: positional then keyword values; for an ATen
    ``OpOverload``, one entry per schema argument (defaults filled in)."""
    target = n.target
    if n.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        out = []
        for i, arg in enumerate(target._schema.arguments):
            if arg.name in n.kwargs:
                out.append(n.kwargs[arg.name])
            elif not arg.kwarg_only and i < len(n.args):
                out.append(n.args[i])
            else:
                out.append(arg.default_value)
        return out
    return [*n.args, *n.kwargs.values()]


def _forms_cycle(match: InternalMatch, compute: list[Node]) -> bool:
    """Whether a path leaves the matched nodes and re-enters them (fusing them would make a cycle)."""
    if len(match.returning_nodes) < 2:
        return False  # every matched node is an ancestor of the single returned node: no way back in
    inside = set(compute)
    frontier = [u for gn in compute for u in gn.users if u not in inside]
    seen: set[Node] = set()
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u in inside:
                return True
            frontier.append(u)
    return False


# ---- rewriting ---------------------------------------------------------------------------------


def _as_graph(obj: Callable[..., Any] | Graph | GraphModule, role: str) -> Graph:
    if _is_torch_fx(obj):  # a torch.fx GraphModule or Graph (make_fx, torch.export, symbolic_trace)
        from fxdist.interop import as_fxdist

        obj = as_fxdist(obj)
    if isinstance(obj, GraphModule):
        return obj.graph
    if isinstance(obj, Graph):
        return obj
    if callable(obj):
        from fxdist.tracer import symbolic_trace

        return symbolic_trace(obj).graph
    raise TypeError(f"replace_pattern: {role} must be a callable, a Graph or a GraphModule, got {type(obj).__name__}")


def _placeholders(graph: Graph) -> list[Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def _check_arity(pattern_graph: Graph, replacement_graph: Graph) -> None:
    n_pattern, n_replacement = len(_placeholders(pattern_graph)), len(_placeholders(replacement_graph))
    if n_pattern != n_replacement:
        raise ValueError(
            f"replace_pattern: the pattern has {n_pattern} placeholders "
            f"{[p.target for p in _placeholders(pattern_graph)]} but the replacement has {n_replacement} "
            f"{[p.target for p in _placeholders(replacement_graph)]}; give both the same parameters "
            "(a replacement may ignore some)"
        )


def _insert_point(graph: Graph, returning: list[Node]) -> Node:
    """The first user (in graph order) of the matched outputs, else the node after the last of them."""
    users = {u for n in returning for u in n.users}
    if len(users) == 1:
        return next(iter(users))
    if users:
        return next(n for n in graph.nodes if n in users)
    after = None
    for n in reversed(graph.nodes):
        if n in returning:
            break
        after = n
    assert after is not None, "a matched output cannot be the graph's last node (the output node)"
    return after


def _copy_replacement(
    graph: Graph, match: InternalMatch, replacement_graph: Graph, changed: dict[Node, Node]
) -> tuple[tuple[Any, ...] | list[Any], list[Node]]:
    """Step 2: copy ``replacement_graph`` before the insert point; return (copied outputs, new nodes).

    ``changed`` maps graph nodes replaced by earlier matches to their replacements; inputs bound to
    them are redirected (and ``match`` updated) so the copy never refers to an erased node.
    """
    val_map: dict[Node, Any] = {}
    for i, (rn, gn) in enumerate(zip(_placeholders(replacement_graph), match.placeholder_nodes)):
        if isinstance(gn, Node) and gn in changed:
            new = changed[gn]
            for pn, v in match.nodes_map.items():
                if v is gn:
                    match.nodes_map[pn] = new
            match.placeholder_nodes[i] = gn = new
        val_map[rn] = gn
    insert_at = _insert_point(graph, match.returning_nodes)
    before = insert_at.prev
    with graph.inserting_before(insert_at):
        copied = graph.graph_copy(replacement_graph, val_map)
    new_nodes = list(_nodes_between(before, insert_at))
    return (copied if isinstance(copied, (tuple, list)) else (copied,)), new_nodes


def _nodes_between(start: Node, stop: Node) -> Iterator[Node]:
    n = start.next
    while n is not stop:
        yield n
        n = n.next


def _rewire(match: InternalMatch, copied: Sequence[Any], changed: dict[Node, Node]) -> None:
    """Step 3: every use of a matched output now uses the corresponding copied output."""
    if len(copied) != len(match.returning_nodes):
        raise ValueError(
            f"replace_pattern: the pattern returns {len(match.returning_nodes)} values "
            f"but the replacement returns {len(copied)}"
        )
    for gn, new in zip(match.returning_nodes, copied):
        gn.replace_all_uses_with(new)
        changed[gn] = new


def _erase_matched(graph: Graph, match: InternalMatch, pattern_graph: Graph) -> None:
    """Step 4: erase the matched compute nodes, last first (each has no users by now)."""
    for pn in reversed(pattern_graph.nodes):
        if _is_compute(pn):
            graph.erase_node(match.nodes_map[pn])


def _copy_attributes(gm: GraphModule, replacement: torch.nn.Module) -> None:
    """Give ``gm`` the submodules/attributes that copied ``call_module``/``get_attr`` nodes refer to."""
    gm.delete_all_unused_submodules()
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "get_attr"):
            continue
        target = cast(str, node.target)  # get_attr and call_module targets are names
        if _lookup(gm, target) is not None:
            continue
        value = _lookup(replacement, target)
        if value is None:
            raise RuntimeError(
                f"replace_pattern: {node.format_node()} refers to {node.target!r}, "
                "which exists neither in the module nor in the replacement"
            )
        value = copy.deepcopy(value)
        if isinstance(value, torch.nn.Module):
            gm.add_submodule(target, value)
        else:
            owner_path, _, attr = target.rpartition(".")
            setattr(gm.get_submodule(owner_path) if owner_path else gm, attr, value)
    gm.graph.lint()


def _lookup(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for atom in target.split("."):
        obj = getattr(obj, atom, None)
        if obj is None:
            return None
    return obj


def replace_pattern(
    gm: GraphModule, pattern: Callable[..., Any] | GraphModule, replacement: Callable[..., Any] | GraphModule
) -> list[Match]:
    """Replace every non-overlapping occurrence of ``pattern`` in ``gm.graph`` with ``replacement``.

    Matching follows use-def edges, not names; the pattern's parameters are wildcards and its return
    value need not be the graph's. ``gm`` is recompiled afterwards.

    Example (``replace_pattern``'s docstring in torch/fx/subgraph_rewriter.py: ``add -> mul``):

    >>> import torch, fxdist as fx
    >>> gm = fx.symbolic_trace(lambda x, y: torch.relu(x + y))
    >>> [m.anchor.name for m in fx.replace_pattern(gm, lambda a, b: a + b, lambda a, b: a * b)]
    ['add']
    >>> print(gm.code.strip())
    def forward(self, x, y):
        mul = x * y;  x = y = None
        relu = torch.relu(mul);  mul = None
        return relu

    Args:
        gm: The module to rewrite in place. A torch.fx GraphModule (``symbolic_trace``, ``make_fx``,
            ``torch.export``'s ``graph_module``) is rewritten too: an fxdist copy is rewritten and ``gm``
            gets its graph; the returned matches then name the copy's nodes.
        pattern: A callable (traced with ``fxdist.symbolic_trace``), Graph or GraphModule (fxdist's or
            torch.fx's).
        replacement: Same kinds; it must take as many parameters as ``pattern``.

    Returns:
        One ``Match(anchor, nodes_map)`` per replaced occurrence (empty if none).

    Raises:
        ValueError: pattern and replacement have different numbers of placeholders (checked before
            anything is changed), or the pattern has dead code.
    """
    replaced = _replace_pattern(gm, pattern, replacement)
    return [Match(anchor=r.anchor, nodes_map=r.nodes_map) for r in replaced]


def replace_pattern_with_filters(
    gm: GraphModule,
    pattern: Callable[..., Any] | Graph | GraphModule,
    replacement: Callable[..., Any] | Graph | GraphModule | None = None,
    match_filters: list[Callable[[InternalMatch, Graph, Graph], bool]] | None = None,
    ignore_literals: bool = False,
    replacement_callback: Callable[[InternalMatch, Graph, Graph], Graph] | None = None,
) -> list[ReplacedPatterns]:
    """``replace_pattern`` with filters; returns ``ReplacedPatterns`` (with the added nodes).

    Args:
        match_filters: Functions ``(match, original_graph, pattern_graph) -> bool``; a match is
            replaced only if all return True.
        ignore_literals: Treat literal arguments as wildcards when matching.
        replacement_callback: ``(match, original_graph, pattern_graph) -> Graph`` building the
            replacement per match, instead of ``replacement``.
    """
    return _replace_pattern(gm, pattern, replacement, match_filters, ignore_literals, replacement_callback)


def _replace_pattern(
    gm: GraphModule,
    pattern: Callable[..., Any] | Graph | GraphModule,
    replacement: Callable[..., Any] | Graph | GraphModule | None,
    match_filters: list[Callable[[InternalMatch, Graph, Graph], bool]] | None = None,
    ignore_literals: bool = False,
    replacement_callback: Callable[[InternalMatch, Graph, Graph], Graph] | None = None,
) -> list[ReplacedPatterns]:
    if _is_torch_fx(gm):  # the door: rewrite an fxdist copy, then give the torch.fx module its graph
        from fxdist.interop import as_fxdist, write_back

        converted = as_fxdist(gm)
        replaced = _replace_pattern(converted, pattern, replacement, match_filters, ignore_literals,
                                    replacement_callback)
        write_back(cast(Any, gm), converted)  # a torch.fx GraphModule: only interop names torch.fx
        if isinstance(replacement, torch.nn.Module):
            gm.delete_all_unused_submodules()  # as _copy_attributes did on the copy (torch.fx does too)
        return replaced
    graph = gm.graph
    pattern_graph = _as_graph(pattern, "pattern")
    if replacement is None and replacement_callback is None:
        raise ValueError("replace_pattern_with_filters: give a replacement or a replacement_callback")
    common = _as_graph(replacement, "replacement") if replacement is not None else None
    if common is not None and replacement_callback is None:
        _check_arity(pattern_graph, common)
    matcher = SubgraphMatcher(pattern_graph, ignore_literals=ignore_literals)
    matches = [
        m for m in matcher.match(graph) if all(f(m, graph, pattern_graph) for f in (match_filters or ()))
    ]
    changed: dict[Node, Node] = {}
    replaced = []
    for match in matches:
        replacement_graph = (_as_graph(replacement_callback(match, graph, pattern_graph), "replacement")
                             if replacement_callback else cast(Graph, common))  # one is given: checked above
        if replacement_callback is not None:
            _check_arity(pattern_graph, replacement_graph)
        copied, new_nodes = _copy_replacement(graph, match, replacement_graph, changed)
        _rewire(match, copied, changed)
        _erase_matched(graph, match, pattern_graph)
        replaced.append(ReplacedPatterns(anchor=match.anchors[0], nodes_map=match.nodes_map, replacements=new_nodes))
    gm.recompile()
    if isinstance(replacement, torch.nn.Module):
        _copy_attributes(gm, replacement)
    return replaced
