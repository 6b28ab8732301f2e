"""Immutable ``list``/``dict`` used for a node's ``args``/``kwargs``, so they can only change by assigning
``node.args``/``node.kwargs`` (which keeps use-def data exact).

Source: torch/fx/immutable_collections.py. Both are registered as pytree nodes (with key paths).
"""

from __future__ import annotations

import typing
from typing import Any

import torch.utils._pytree as _pytree

__all__ = ["ImmutableMutationError", "immutable_dict", "immutable_list"]

_HELP_MUTATION = (
    "If you are attempting to modify the kwargs or args of a Node object, instead create a new copy "
    "of it and assign the copy to the node:\n\n    new_args = ...  # copy and mutate args\n"
    "    node.args = new_args"
)


class ImmutableMutationError(TypeError, NotImplementedError):
    """Raised on an attempt to mutate a node's ``args``/``kwargs`` in place.

    A ``TypeError`` like torch.fx 2.13's, and a ``NotImplementedError`` like older torch.fx's.

    See docs/troubleshooting.md#immutablemutationerror.
    """


def _no_mutation(self: Any, *args: Any, **kwargs: Any) -> typing.NoReturn:
    raise ImmutableMutationError(f"{type(self).__name__!r} object does not support mutation. {_HELP_MUTATION}")


class immutable_list(list):  # noqa: N801 - torch.fx name
    """A ``list`` that refuses mutation (``append``, ``x[i] = v``, ...) with ImmutableMutationError."""

    __delitem__ = __iadd__ = __imul__ = __setitem__ = _no_mutation
    append = clear = extend = insert = pop = remove = reverse = sort = _no_mutation

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (tuple(self),))


class immutable_dict(dict):  # noqa: N801 - torch.fx name
    """A ``dict`` that refuses mutation (``d[k] = v``, ``update``, ...) with ImmutableMutationError."""

    __delitem__ = __ior__ = __setitem__ = _no_mutation
    clear = pop = popitem = setdefault = update = _no_mutation

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (tuple(self.items()),))


def _unflatten_list(values: Any, ctx: Any) -> immutable_list:
    return immutable_list(_pytree._list_unflatten(values, ctx))


def _unflatten_dict(values: Any, ctx: Any) -> immutable_dict:
    return immutable_dict(_pytree._dict_unflatten(values, ctx))


_pytree.register_pytree_node(
    immutable_list, _pytree._list_flatten, _unflatten_list, flatten_with_keys_fn=_pytree._list_flatten_with_keys,
    serialized_type_name="fxdist.immutable_collections.immutable_list")
_pytree.register_pytree_node(
    immutable_dict, _pytree._dict_flatten, _unflatten_dict, flatten_with_keys_fn=_pytree._dict_flatten_with_keys,
    serialized_type_name="fxdist.immutable_collections.immutable_dict")
