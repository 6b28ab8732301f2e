"""One lookup and one push per server per step for many embedding modules: the grouping of
:func:`scheduling.parameter_servers` (``group_tables=True``).

A model with one ``nn.EmbeddingBag`` or ``nn.Embedding`` per feature (Wide & Deep: 53 of them) would send one
request per module and server, each paying the round trip and the server's per-request work. The pass puts
such modules into groups instead; each group is one client on the servers (one table per module) and one
request per server, as torchrec groups the features of an ``EmbeddingBagCollection`` into one
``KeyedJaggedTensor``::

    %a = call_module[emb.a](%ids_a)         %kjt = group_to_kjt(("emb.a", "emb.b"), (...), %ids_a, ..., %ids_b, ...)
    ...                             ->      %ps_lookup = ps_lookup("ps:emb.a+1", 0, %kjt) ... %ps_pool = ps_pool(...)
    %b = call_module[emb.b](%ids_b)         %a = group_output(%ps_pool, 0, 16, %ids_a)
                                            ...
                                            %b = group_output(%ps_pool, 16, 32, %ids_b)

The group's request goes where its first module was called, so every other module's ids must be computable
there. A module joins the first group (in graph order) of its kind (bags with bags, embeddings with embeddings:
a bag count per module that differs little) and trainability (one client pushes for all its tables or none)
where

- it is called once (a module called twice pushes twice a step: it keeps a client of its own);
- the nodes its ids come from, between the group's first call and its own, are side-effect free
  (no module call, no in-place op, no impure call): they move up before that first call;
- nothing in between may modify those ids in place: no in-place op, impure call or module call there whose
  inputs share an ancestor with the ids.

Otherwise it starts a group of its own. Chained modules (one module's output feeding another's ids) are
therefore never in one group.

Source: torchrec ``EmbeddingBagCollection`` / ``KeyedJaggedTensor`` (features of many tables in one input and
one lookup); torch.fx paper §6.2.3 (move a start as early as its inputs allow).
"""

from __future__ import annotations

from typing import Any, cast

from fxdist.graph_module import GraphModule
from fxdist.node import Node
from recsys.embedding import embedding_kind

from ..async_pairs import trace_meta
from ..ps import ops
from . import conversions
from .find import Candidate, call_arguments, is_inplace

__all__ = ["GROUPABLE", "group_candidates", "group_label", "rewrite_group"]

GROUPABLE = ("bag", "embedding")
"""Module kinds that can share a group (``Candidate.kind``)."""


def _ancestors(nodes: list[Any]) -> set[Node]:
    seen: set[Node] = set()
    todo = [n for n in nodes if isinstance(n, Node)]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _writes(node: Node, modules: dict[str, Any]) -> bool:
    """Whether ``node`` may modify a value in place (or do anything else besides computing its output)."""
    if node.op == "call_module":
        module = modules.get(str(node.target))
        return module is None or embedding_kind(module) is None
    return node.op in ("call_function", "call_method") and (node.is_impure() or is_inplace(node, modules))


def _chain(first: Node, call: Node, pos: dict[Node, int], modules: dict[str, Any]) -> list[Node] | None:
    """The nodes between ``first`` and ``call`` that ``call``'s inputs come from (they must move before
    ``first``), in graph order; None when they cannot move or something in between may modify the ids."""
    ids = _ancestors(call.all_input_nodes)
    if first in ids:
        return None
    chain = sorted((n for n in ids if pos[n] > pos[first]), key=pos.__getitem__)
    if any(n.op not in ("call_function", "call_method", "get_attr") or _writes(n, modules) for n in chain):
        return None
    for n in first.graph.nodes:
        if pos[first] < pos[n] < pos[call] and n not in ids and _writes(n, modules):
            if _ancestors(n.all_input_nodes) & ids:
                return None
    return chain


def group_candidates(gm: GraphModule, found: list[Candidate], trainable: dict[str, bool]) -> list[list[Candidate]]:
    """``found`` split into groups (see the module docstring); each group in graph order, modules that cannot
    share a request alone in theirs. ``trainable``: qualname -> whether its tables train."""
    modules = dict(gm.named_modules())
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups: list[list[Candidate]] = []
    for c in sorted(found, key=lambda c: pos[c.nodes[0]]):
        home = None
        if c.kind in GROUPABLE and len(c.nodes) == 1:
            for k, g in enumerate(groups):
                lead = g[0]
                if (lead.kind, trainable[lead.qualname], len(lead.nodes)) != (c.kind, trainable[c.qualname], 1):
                    continue
                if _chain(lead.nodes[0], c.nodes[0], pos, modules) is not None:
                    home = k
                    break
        if home is None:
            groups.append([c])
        else:
            groups[home].append(c)
    return groups


def group_label(members: list[Candidate]) -> str:
    """The name a group goes by (its clients' names, messages): ``"a"`` alone, ``"a+52"`` for a group led by
    ``a`` with 52 other modules."""
    return members[0].qualname + (f"+{len(members) - 1}" if len(members) > 1 else "")


def _move_chain(members: list[Candidate]) -> None:
    """Move the nodes every member's ids come from above the group's first call (graph order kept)."""
    first = members[0].nodes[0]
    graph = first.graph
    modules = dict(cast(Any, graph.owning_module).named_modules())  # a traced GraphModule's graph: owned
    for c in members[1:]:
        pos = {n: i for i, n in enumerate(graph.nodes)}
        chain = _chain(first, c.nodes[0], pos, modules)
        assert chain is not None, f"group member {c.qualname} cannot move before {first.name}"
        for n in chain:
            first.prepend(n)


def _member(c: Candidate) -> tuple[tuple, tuple[Any, ...]]:
    """A member's static description for :func:`~scheduling.conversions.group_to_kjt` and its input nodes."""
    m = c.module
    args = tuple(call_arguments(m, c.nodes[0]))
    if c.kind == "embedding":
        return ("embedding", m.num_embeddings, m.padding_idx), args[:1]
    return ("bag", m.num_embeddings, m.mode, m.include_last_offset, m.padding_idx), args[:3]


def rewrite_group(gm: GraphModule, members: list[Candidate], client: Any, trainable: bool) -> None:
    """Replace the members' calls by one lookup per server (+ backward pushes), the pooling, and each member's
    slice of it (:func:`scheduling.conversions.group_output`); the caller drops the modules."""
    graph = gm.graph
    _move_chain(members)
    first = members[0].nodes[0]
    keep = trace_meta(first)
    label = group_label(members)
    described = [_member(c) for c in members]
    tensors = tuple(a for _, args in described for a in args)
    # the conversion goes right after its inputs, so that async_rpc can start the lookup that early
    pos = {n: i for i, n in enumerate(graph.nodes)}
    after = max([a for a in tensors if isinstance(a, Node)] + [n for n in graph.nodes if n.op == "placeholder"],
                key=pos.__getitem__)
    with graph.inserting_after(after):
        kjt = graph.call_function(conversions.group_to_kjt, (tuple(c.qualname for c in members),
                                                              tuple(d for d, _ in described), *tensors))
    anchor = first.prev
    with graph.inserting_before(first):
        ids = client.servers_for()
        parts = [graph.call_function(ops.ps_lookup, (client.name, s, kjt)) for s in ids]
        if trainable:
            parts = [graph.call_function(ops.ps_push_in_backward, (client.name, s, kjt, p)) for s, p in zip(ids, parts)]
        pooled = graph.call_function(ops.ps_pool, (client.name, kjt, *parts))
    for new in [kjt, *_between(anchor, first)]:
        new.meta.update(keep)
        new.meta["parameter_servers"] = label
    start = 0
    for c, (_, args) in zip(members, described):
        node, dim = c.nodes[0], c.module.embedding_dim
        extra: dict[str, Any] = {"embedding": True} if c.kind == "embedding" else {
            "offsets": args[1], "include_last_offset": c.module.include_last_offset}
        with graph.inserting_before(node):
            out = graph.call_function(conversions.group_output, (pooled, start, start + dim, args[0]), extra)
        out.meta.update(trace_meta(node))
        out.meta["parameter_servers"] = c.qualname
        start += dim
        node.replace_all_uses_with(out)
        graph.erase_node(node)


def _between(anchor: Node, stop: Node) -> list[Node]:
    out, node = [], anchor.next
    while node is not stop:
        out.append(node)
        node = node.next
    return out
