"""Folding a regroup of a moved collection's output back into its values (part of the ``parameter_servers`` pass).

torchrec's ``SparseArch`` (and code like it) turns an ``EmbeddingBagCollection``'s ``KeyedTensor`` into one tensor by
splitting it into its features and concatenating them again::

    %kt = ps_pool("ps:...", %kjt, ...)            ->      %kt = ps_pool("ps:...", %kjt, ...)
    %d = call_method[to_dict](%kt)                        %cat = call_method[values](%kt)
    %a = getitem(%d, "f1"); %b = getitem(%d, "f2")
    %cat = torch.cat([%a, %b], dim=1)

When the concatenation takes every feature of the pooled output once, in the output's own key order, along the
feature dim, it equals ``kt.values()``: the split into views and the copy back (and, in backward, the split of the
gradient and its copy back) are dropped, values and gradients unchanged. Anything else (another order, a subset, a
feature used elsewhere, another dim) is left as it is.

Source: torchrec ``KeyedTensor`` (``values()`` is the features' columns in ``keys()`` order, ``length_per_key``
wide each) and ``torchrec/models/dlrm.py`` ``SparseArch.forward``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fxdist.graph import Graph
from fxdist.node import Node

__all__ = ["fold_regroups"]


def _concatenated_features(cat: Node) -> tuple[list[Node], int] | None:
    """The nodes ``torch.cat`` joins and its dim, when it is a plain ``torch.cat(list, dim)`` call."""
    if cat.op != "call_function" or cat.target is not torch.cat or not cat.args:
        return None
    items = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if len(cat.args) > 2 or set(cat.kwargs) - {"dim"} or not isinstance(items, (list, tuple)):
        return None
    if not isinstance(dim, int) or not all(isinstance(n, Node) for n in items):
        return None
    return list(items), dim


def _fold_one(graph: Graph, pooled: Node, keys: Sequence[str]) -> bool:
    """Fold ``to_dict`` + ``getitem``s + ``cat`` after ``pooled`` (a ``ps_pool`` of ``keys``); whether it did."""
    if len(pooled.users) != 1:
        return False
    to_dict = next(iter(pooled.users))
    if to_dict.op != "call_method" or to_dict.target != "to_dict" or to_dict.args != (pooled,) or to_dict.kwargs:
        return False
    items = list(to_dict.users)
    if len(items) != len(keys) or not all(
            n.op == "call_function" and n.target is operator.getitem and len(n.args) == 2 and n.args[0] is to_dict
            and len(n.users) == 1 for n in items):
        return False
    cat = next(iter(items[0].users))
    found = _concatenated_features(cat)
    if found is None or found[1] not in (1, -1):
        return False
    joined = found[0]
    if [n.args[1] for n in joined] != list(keys) or set(joined) != set(items) or len(joined) != len(items):
        return False
    with graph.inserting_before(cat):
        values = graph.call_method("values", (pooled,))
    values.meta.update(cat.meta)
    cat.replace_all_uses_with(values)
    for node in [cat, *items, to_dict]:
        graph.erase_node(node)
    return True


def fold_regroups(graph: Graph, pool_target: Callable[..., Any], keys_of: Callable[[str], Sequence[str]]) -> int:
    """Replace each ``torch.cat`` of all of a pooled ``KeyedTensor``'s features, in its key order along dim 1, by
    the ``KeyedTensor``'s ``values()`` (see the module docstring).

    Args:
        graph: the graph, changed in place (recompile its module afterwards).
        pool_target: the function whose ``call_function`` nodes make the ``KeyedTensor``s (``ps_pool``); its first
            argument is the client's name.
        keys_of: client name -> the ``KeyedTensor``'s keys, in order (``PSClient.feature_names``).

    Returns:
        How many concatenations were folded.

    Raises:
        KeyError: ``keys_of`` does not know a client named by a ``pool_target`` node.
    """
    folded = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is pool_target and node.args and isinstance(node.args[0], str):
            folded += _fold_one(graph, node, keys_of(node.args[0]))
    return folded
