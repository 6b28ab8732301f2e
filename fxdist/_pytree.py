"""Flattening a value against a traced ``TreeSpec`` by indexing, with a registry of container types.

The generated ``forward`` of a module traced with container-valued ``concrete_args`` starts with
``fx_pytree.tree_flatten_spec([self, x], self._in_spec)`` (see :mod:`fxdist._pytree_codegen`); ``fx_pytree`` is
this module. Each container type registered here is taken apart by a function of ``(value, spec)`` that
indexes it (``d[k]`` for the keys the spec names, ``t[i]`` for positions), so the value may be a Proxy: retracing
such a module gives one ``getitem`` node per leaf. dict, list, tuple, namedtuples (whose spec in torch 2.13 has
type ``collections.namedtuple`` and the class as its context) and ``torch.return_types`` are registered; other
types are flattened with ``torch.utils._pytree`` and must have exactly the traced structure.

Source: torch/fx/_pytree.py (``register_pytree_flatten_spec``, ``tree_flatten_spec``, ``SUPPORTED_NODES``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch.return_types
import torch.utils._pytree as pytree

__all__ = ["register_pytree_flatten_spec", "tree_flatten_spec", "SUPPORTED_NODES", "SUPPORTED_NODES_EXACT_MATCH"]

FlattenFnSpec = Callable[[Any, pytree.TreeSpec], list[Any]]
"""``(value, spec) -> children``: the value's children in the order of ``spec.children()``."""
FlattenFnExactMatchSpec = Callable[[Any, pytree.TreeSpec], bool]
"""``(value, spec) -> bool``: whether the value has exactly as many children as ``spec``."""

SUPPORTED_NODES: dict[Any, FlattenFnSpec] = {}
"""Container type (or ``collections.namedtuple`` for every namedtuple) -> its :data:`FlattenFnSpec`."""
SUPPORTED_NODES_EXACT_MATCH: dict[Any, FlattenFnExactMatchSpec | None] = {}


def register_pytree_flatten_spec(cls: Any, flatten_fn_spec: FlattenFnSpec,
                                 flatten_fn_exact_match_spec: FlattenFnExactMatchSpec | None = None) -> None:
    """Make :func:`tree_flatten_spec` take ``cls`` apart with ``flatten_fn_spec(value, spec)``.

    ``cls`` is the spec's ``type`` (``spec.type``), as ``torch.utils._pytree`` records it: a class registered
    with ``register_pytree_node``, or ``collections.namedtuple`` for namedtuples. Registering a type again
    replaces its functions.

    Source: torch/fx/_pytree.py (``register_pytree_flatten_spec``).
    """
    SUPPORTED_NODES[cls] = flatten_fn_spec
    SUPPORTED_NODES_EXACT_MATCH[cls] = flatten_fn_exact_match_spec


def _deregister_pytree_flatten_spec(cls: Any) -> None:
    """Undo :func:`register_pytree_flatten_spec` for ``cls``.

    Raises:
        KeyError: ``cls`` is not registered.
    """
    del SUPPORTED_NODES[cls]
    del SUPPORTED_NODES_EXACT_MATCH[cls]


def tree_flatten_spec(tree: Any, spec: pytree.TreeSpec) -> list[Any]:
    """The leaves of ``tree`` in the order of ``spec``.

    A registered container is taken apart by its function (indexing: a dict by the keys ``spec`` names, so it
    may hold extra keys; a list/tuple/namedtuple by position), so ``tree`` may be a Proxy. Other container types
    are flattened with ``torch.utils._pytree`` and must have exactly the structure ``spec``.

    Raises:
        KeyError, IndexError: a dict lacks a key or a sequence is too short, as in torch.fx; a note on the
            exception gives the structure expected.
        RuntimeError: ``tree``'s structure differs from ``spec`` (an unregistered container type), naming both,
            as torch.fx's ``tree_flatten_spec``.

    Source: torch/fx/_pytree.py (``tree_flatten_spec``).
    """
    try:
        return _flatten_spec(tree, spec)
    except (KeyError, IndexError) as e:
        e.add_note(f"the inputs do not have the structure the module was traced with: expected {spec}")
        raise


def _flatten_spec(tree: Any, spec: pytree.TreeSpec) -> list[Any]:
    if spec.is_leaf():
        return [tree]
    flatten = SUPPORTED_NODES.get(spec.type)
    if flatten is None and pytree.is_namedtuple_class(spec.type):  # a namedtuple spec of older torch versions
        flatten = SUPPORTED_NODES[collections.namedtuple]
    if flatten is not None:
        children = flatten(tree, spec)
        return [leaf for child, child_spec in zip(children, spec.children()) for leaf in _flatten_spec(child, child_spec)]
    leaves, got = pytree.tree_flatten(tree)
    if got != spec:
        raise RuntimeError(f"Real spec {got} of object {tree} is different from expected spec {spec}")
    return leaves


def _dict_flatten_spec(d: Any, spec: pytree.TreeSpec) -> list[Any]:
    return [d[k] for k in spec.context]


def _sequence_flatten_spec(d: Any, spec: pytree.TreeSpec) -> list[Any]:
    return [d[i] for i in range(spec.num_children)]


def _same_length(d: Any, spec: pytree.TreeSpec) -> bool:
    return len(d) == spec.num_children


for _cls, _fn in ((dict, _dict_flatten_spec), (list, _sequence_flatten_spec), (tuple, _sequence_flatten_spec),
                  (collections.namedtuple, _sequence_flatten_spec),
                  *((cls, _sequence_flatten_spec) for cls in torch.return_types.all_return_types)):
    register_pytree_flatten_spec(_cls, _fn, _same_length)
