"""Input checks of moved embedding modules: the errors the local modules raise, raised on the trainer.

A table on the parameter servers must refuse what the local module refuses, with the same exception class and
message, before any request leaves the trainer (so nothing is sent and the servers' rows stay as they were):
float or int16 ids, ids outside ``[0, num_embeddings)``, ``per_sample_weights`` with ``mode="mean"`` or of
another shape than the ids, offsets with a 2-D input, a weighted ``EmbeddingBagCollection`` given a
``KeyedJaggedTensor`` without weights.

How: a few cheap tests of the batch (dtype, min and max per table); only when one of them fails (or the
conversion itself fails) is torch's own function run on the same ids with a one-column weight of the table's
rows, so the error raised is torch's own, word for word. That weight is allocated on the error path only.
Ids on a GPU are checked on a CPU copy of them (on the error path only): a local module on CUDA would stop
the process with a device-side assert for an id out of range; here the CPU kernel's error is raised instead.

Source: ``torch.nn.functional.embedding`` / ``embedding_bag`` argument checks (torch/nn/functional.py and
aten's ``embedding_bag``); torchrec ``EmbeddingBagCollection.forward`` (one ``nn.EmbeddingBag`` per table,
``per_sample_weights=features.weights()`` when weighted) and ``JaggedTensor.weights()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .device import to_host

__all__ = ["bad_id_dtype", "ids_suspect", "raise_embedding_error", "raise_embedding_bag_error", "check_kjt"]

_ID_DTYPES = (torch.int64, torch.int32)


def bad_id_dtype(ids: torch.Tensor) -> bool:
    """Whether ``ids`` are of a dtype the local embedding modules refuse (not int64/int32)."""
    return ids.dtype not in _ID_DTYPES


def ids_suspect(ids: torch.Tensor, num_embeddings: int) -> bool:
    """Whether ``ids`` (any shape) might make the local module raise: not int64/int32, or out of range."""
    if bad_id_dtype(ids):
        return True
    return ids.numel() > 0 and bool((ids.min() < 0) | (ids.max() >= num_embeddings))


def _weight(num_embeddings: int) -> torch.Tensor:
    return torch.zeros(num_embeddings, 1)


def raise_embedding_error(index: torch.Tensor, num_embeddings: int, padding_idx: int | None) -> None:
    """Run ``F.embedding`` on ``index`` as the local ``nn.Embedding(num_embeddings, D)`` would; raises its
    error (``RuntimeError`` for the dtype, ``IndexError`` out of range). Returns if it finds nothing."""
    F.embedding(to_host(index), _weight(num_embeddings), padding_idx)


def raise_embedding_bag_error(input: torch.Tensor, num_embeddings: int, offsets: Any = None, mode: str = "mean",
                              per_sample_weights: Any = None, include_last_offset: bool = False,
                              padding_idx: int | None = None) -> None:
    """Run ``F.embedding_bag`` on the arguments as the local ``nn.EmbeddingBag`` would; raises its error
    (``RuntimeError``, ``ValueError``, ``NotImplementedError``). Returns if it finds nothing."""
    F.embedding_bag(to_host(input), _weight(num_embeddings), to_host(offsets), mode=mode,
                    per_sample_weights=to_host(per_sample_weights),
                    include_last_offset=include_last_offset, padding_idx=padding_idx)


def check_kjt(kjt: Any, tables: Sequence[Any], weighted: bool | None) -> None:
    """Check an ``EmbeddingBagCollection`` input as the local collection would.

    Args:
        kjt: the ``KeyedJaggedTensor``.
        tables: the collection's ``TableSpec``s (``num_embeddings``, ``feature_names``, ``pooling``, ``dynamic``:
            a dynamic table's ids are raw, not checked against its rows).
        weighted: the collection's ``is_weighted()`` (None: not known, weights not checked).

    Raises:
        AssertionError: ``weighted`` and ``kjt`` has no weights (torchrec's message).
        RuntimeError: ids of another dtype than int64/int32 or outside a table's rows (torch's message).
    """
    if weighted and kjt.weights_or_none() is None:
        kjt.weights()  # torchrec's own AssertionError: "This (Keyed)JaggedTensor doesn't have weights."
        raise AssertionError("This (Keyed)JaggedTensor doesn't have weights.")
    values, keys = kjt.values(), kjt.keys()
    suspect = bad_id_dtype(values)
    if not suspect:
        bounds = _bag_bounds(kjt, keys, tables)
        if bounds is not None:   # the usual case: one test of the ids against bounds cached per layout
            if not _out_of_bounds(values, kjt.lengths(), *bounds):
                return
        elif not _any_out_of_range(values, keys, kjt.length_per_key(), _rows(tables)):
            return
    rows = _rows(tables)
    start = 0
    for key, n in zip(keys, kjt.length_per_key()):
        if suspect or (key in rows and ids_suspect(values[start:start + n], rows[key])):
            _raise_feature_error(kjt, key, rows.get(key, 1), {f: t.pooling for t in tables for f in t.feature_names},
                                 bool(weighted))
        start += n


def _rows(tables: Sequence[Any]) -> dict[str, int]:
    """Feature -> rows of its table, for the tables whose ids are checked (not dynamic)."""
    return {f: t.num_embeddings for t in tables if t.dynamic is None for f in t.feature_names}


_BOUNDS: dict[tuple, tuple[Any, torch.Tensor | None, torch.Tensor | int]] = {}
_BOUNDS_MAX = 64


def _bag_bounds(kjt: Any, keys: Sequence[str], tables: Sequence[Any],
                ) -> tuple[torch.Tensor | None, torch.Tensor | int] | None:
    """Per bag (``(F * B,)``, key-major), the ids' lower bound (None: 0 for every bag) and upper bound (exclusive;
    an int when it is the same for every bag and the lower bound 0) for a KJT of ``keys`` with the same number of
    bags per key; cached per ``(tables, keys, B, device)``, so a batch of a layout seen before costs no Python per
    key. None for a variable number of bags per key."""
    lengths = kjt.lengths()
    if not keys or lengths.numel() % len(keys) or kjt.variable_stride_per_key():
        return None
    stride = lengths.numel() // len(keys)
    key = (id(tables), tuple(keys), stride, lengths.device)
    cached = _BOUNDS.get(key)
    if cached is not None and cached[0] is tables:
        return cached[1], cached[2]
    rows, limit = _rows(tables), torch.iinfo(torch.int64)
    per_key = torch.tensor([rows.get(k, limit.max) for k in keys], dtype=torch.int64)
    lo = None if all(k in rows for k in keys) else torch.tensor([0 if k in rows else limit.min for k in keys])
    uniform = lo is None and len({rows[k] for k in keys}) == 1
    hi: torch.Tensor | int = rows[keys[0]] if uniform else per_key.repeat_interleave(stride).to(lengths.device)
    lo = None if lo is None else lo.repeat_interleave(stride).to(lengths.device)
    if len(_BOUNDS) >= _BOUNDS_MAX:
        _BOUNDS.clear()
    _BOUNDS[key] = (tables, lo, hi)
    return lo, hi


def _out_of_bounds(values: torch.Tensor, lengths: torch.Tensor, lo: torch.Tensor | None, hi: torch.Tensor | int,
                   ) -> bool:
    """Whether an id lies outside its bag's ``[lo, hi)`` (``lo`` None: 0; ``hi`` an int: the same for all);
    ``values`` ``(N,)``, ``lengths`` the bags' id counts."""
    n = values.numel()
    if n == 0:
        return False
    if isinstance(hi, int):   # every table of the same rows: the smallest and the largest id say it all
        low, high = torch.aminmax(values.detach())
        return int(low) < 0 or int(high) >= hi   # integer ids (the dtype is checked first): two item() reads
    ids, repeats = values.detach().long(), lengths.long()
    try:
        upper = hi.repeat_interleave(repeats)
    except RuntimeError:   # negative lengths: the per-key test says what is wrong
        return True
    if upper.numel() != n:   # lengths that do not add up to the ids: likewise
        return True
    low = ids < 0 if lo is None else ids < lo.repeat_interleave(repeats)
    return bool((low | (ids >= upper)).any())


def _any_out_of_range(values: torch.Tensor, keys: Sequence[str], lengths: Sequence[int], rows: dict[str, int]) -> bool:
    """Whether an id of a checked key (one of ``rows``) lies outside ``[0, rows[key])``: one vectorized test of
    the whole batch (``values`` ``(N,)``, key-major, ``lengths[i]`` ids for ``keys[i]``) instead of a min and a
    max per key; keys outside ``rows`` pass."""
    if values.numel() == 0:
        return False
    limit = torch.iinfo(torch.int64)
    per_key = torch.tensor([[0, rows[k]] if k in rows else [limit.min, limit.max] for k in keys], dtype=torch.int64,
                           device=values.device)
    repeats = torch.tensor(lengths, device=values.device)
    bounds = per_key.repeat_interleave(repeats, dim=0, output_size=values.numel())   # (N, 2)
    ids = values.detach().long()
    return bool(((ids < bounds[:, 0]) | (ids >= bounds[:, 1])).any())


def _raise_feature_error(kjt: Any, key: str, num_embeddings: int, pooling: dict[str, str], weighted: bool) -> None:
    """The local collection's call for feature ``key`` (``include_last_offset=True``, as torchrec builds its
    bags), run on a one-column weight: raises torch's error; else an ``IndexError`` naming the feature."""
    feature = kjt.to_dict()[key]
    raise_embedding_bag_error(feature.values(), num_embeddings, feature.offsets(), mode=pooling.get(key, "sum"),
                              per_sample_weights=feature.weights() if weighted else None, include_last_offset=True)
    raise IndexError(f"feature {key!r}: an id is outside [0, {num_embeddings})")
