"""Graph leaves of :func:`scheduling.parameter_servers`: ``nn.EmbeddingBag`` / ``nn.Embedding`` inputs in the
servers' ``KeyedJaggedTensor`` wire format, and the lookups' outputs in the shapes those modules return.

Each is registered with :func:`fxdist.wrap` (one ``call_function`` node when traced again) and is pure.

Shapes:
    ``bag_to_kjt(f, input (B, L))`` or ``bag_to_kjt(f, input (N,), offsets (B,) | (B + 1,))`` -> one key
    ``f`` with ``B`` bags; ``index_to_kjt(f, index (*S))`` -> one key, ``prod(S)`` bags of one id each;
    ``index_output(kt, index (*S))`` -> ``(*S, D)``; ``sequence_to_kjt(kjt, features)`` (torchrec
    ``EmbeddingCollection`` input) -> the same features, each id its own bag, every feature padded with empty bags
    to the longest one's id count ``W``; ``sequence_output(kt (W, F * D), kjt, ...)`` -> ``{name: JaggedTensor}``
    with values ``(N_f, D)``, as ``EmbeddingCollection`` returns; ``group_to_kjt(features, kjt_1, ..., kjt_n)``
    (one-key inputs with ``B_i`` bags each) -> one ``KeyedJaggedTensor`` of ``n`` keys, every key padded with
    empty bags to ``max(B_i)``; ``group_output(kt (max B_i, sum D), kjt_i, start, stop[, index (*S)])`` -> member
    ``i``'s ``(B_i, D_i)`` (``(*S, D_i)`` with ``index``).

The conversion of the same input tensors (same objects, not modified in place since: same ``_version``) gives
the same ``KeyedJaggedTensor`` object again, so a lookup prefetched for the next batch (``PSClient`` matches
prefetched batches by identity) is found when that batch's own step converts it.

Source: ``torch.nn.functional.embedding_bag`` (input/offsets conventions, ``padding_idx``); torchrec
``KeyedJaggedTensor`` (key-major ``lengths``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

import fxdist

from .ps.checks import ids_suspect, raise_embedding_bag_error, raise_embedding_error

__all__ = ["bag_to_kjt", "index_to_kjt", "index_output", "sequence_to_kjt", "sequence_output", "group_to_kjt",
           "group_output"]

_RECENT: dict[str, list[tuple[tuple[Any, ...], Any]]] = {}
_KEEP = 4  # this batch, the next one (prefetch; converted first in a step) and slack


def _stamp(objects: tuple[Any, ...]) -> tuple[Any, ...]:
    """Weak references (and tensors' in-place version counters) of ``objects``; None stays None."""
    return tuple((None, None) if o is None else (weakref.ref(o), getattr(o, "_version", None)) for o in objects)


def _same(stamp: tuple[Any, ...], objects: tuple[Any, ...]) -> bool:
    for (ref, version), o in zip(stamp, objects):
        if ref is None:
            if o is not None:
                return False
        elif ref() is not o or getattr(o, "_version", None) != version:
            return False
    return True


def _cached(key: str, tensors: tuple[Any, ...], make: Any) -> Any:
    recent = _RECENT.setdefault(key, [])
    for stamp, kjt in recent:
        if _same(stamp, tensors):
            return kjt
    kjt = make()
    recent.append((_stamp(tensors), kjt))
    del recent[:-_KEEP]
    return kjt


def _kjt(feature: str, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None,
         padding_idx: int | None) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    values = values.reshape(-1).long()
    if weights is not None:
        weights = weights.reshape(-1)
    if padding_idx is not None:  # padding ids leave their bag (and a mean's count), as in F.embedding_bag
        keep = values != padding_idx
        if not bool(keep.all()):
            bags = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
            lengths = torch.bincount(bags[keep], minlength=lengths.numel())
            values = values[keep]
            weights = weights[keep] if weights is not None else None
    return KeyedJaggedTensor(keys=[feature], values=values, lengths=lengths.int(), weights=weights)


def _bag_suspect(input: Any, offsets: Any, per_sample_weights: Any, mode: str, num_embeddings: int) -> bool:
    """Whether the local ``nn.EmbeddingBag`` might refuse these arguments (cheap tests only)."""
    if not isinstance(input, torch.Tensor) or input.dim() not in (1, 2) or (input.dim() == 2) == (offsets is not None):
        return True
    if per_sample_weights is not None and (mode != "sum" or per_sample_weights.shape != input.shape):
        return True
    if offsets is not None and (offsets.dtype != input.dtype or (offsets.numel() > 0 and int(offsets[0]) != 0)):
        return True
    return ids_suspect(input, num_embeddings)


def bag_to_kjt(feature: str, input: Any, offsets: Any = None, per_sample_weights: Any = None,
               include_last_offset: bool = False, padding_idx: int | None = None, num_embeddings: int | None = None,
               mode: str = "mean") -> Any:
    """``nn.EmbeddingBag``'s ``(input, offsets, per_sample_weights)`` as a one-key ``KeyedJaggedTensor``.

    Returns None when ``input`` is None (a ``next_<input>`` that was not given).

    Raises:
        RuntimeError, ValueError, NotImplementedError, IndexError: with ``num_embeddings`` (the table's rows)
            and ``mode`` given, what the local ``nn.EmbeddingBag(num_embeddings, D, mode=mode, ...)`` raises for
            these arguments, word for word (:mod:`scheduling.ps.checks`): float ids, ids out of range,
            ``per_sample_weights`` with ``mode != "sum"`` or of another shape, offsets with a 2-D input, ...
        ValueError: without ``num_embeddings``: 2-D input with offsets, 1-D input without them, or input of
            another rank, naming ``feature``.
    """
    if input is None:
        return None

    def make() -> Any:
        if num_embeddings is not None and _bag_suspect(input, offsets, per_sample_weights, mode, num_embeddings):
            raise_embedding_bag_error(input, num_embeddings, offsets, mode, per_sample_weights, include_last_offset,
                                      padding_idx)
        if input.dim() == 2:
            if offsets is not None:
                raise ValueError(f"{feature}: offsets must be None when input is 2-D {tuple(input.shape)}")
            lengths = torch.full((input.shape[0],), input.shape[1], dtype=torch.long, device=input.device)
        elif input.dim() == 1:
            if offsets is None:
                raise ValueError(f"{feature}: a 1-D input needs offsets (bag starts)")
            starts = offsets.long()
            ends = starts[1:] if include_last_offset else torch.cat([starts[1:], starts.new_tensor([input.numel()])])
            starts = starts[:-1] if include_last_offset else starts
            lengths = ends - starts
        else:
            raise ValueError(f"{feature}: input must be 1-D (with offsets) or 2-D, got {input.dim()}-D")
        return _kjt(feature, input, lengths, per_sample_weights, padding_idx)

    return _cached(f"{feature}|bag|{include_last_offset}|{padding_idx}", (input, offsets, per_sample_weights), make)


def index_to_kjt(feature: str, index: Any, padding_idx: int | None = None, num_embeddings: int | None = None) -> Any:
    """``nn.Embedding``'s index tensor ``(*S)`` as a one-key ``KeyedJaggedTensor`` of ``prod(S)`` one-id bags
    (a ``padding_idx`` entry becomes an empty bag: a zero row). None when ``index`` is None.

    Raises:
        RuntimeError, IndexError: with ``num_embeddings`` (the table's rows) given, what the local
            ``nn.Embedding(num_embeddings, D)`` raises, word for word: ids not int64/int32 (``RuntimeError``),
            ids outside ``[0, num_embeddings)`` (``IndexError: index out of range in self``).
    """
    if index is None:
        return None

    def make() -> Any:
        if num_embeddings is not None and ids_suspect(index, num_embeddings):
            raise_embedding_error(index, num_embeddings, padding_idx)
        return _kjt(feature, index, torch.ones(index.numel(), dtype=torch.long, device=index.device), None, padding_idx)

    return _cached(f"{feature}|index|{padding_idx}", (index,), make)


def sequence_to_kjt(kjt: Any, features: tuple[str, ...], num_embeddings: tuple[int, ...] | None = None) -> Any:
    """A torchrec ``EmbeddingCollection`` input as one-id bags the servers pool to the rows themselves
    (see the module docstring). None when ``kjt`` is None.

    Raises:
        RuntimeError, IndexError: with ``num_embeddings`` (each feature's table rows) given, what the local
            collection's ``nn.Embedding`` raises for ids that are not int64/int32 or outside its rows.
    """
    if kjt is None:
        return None

    def make() -> Any:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        per_key = kjt.to_dict()
        for feature, rows in zip(features, num_embeddings or ()):
            ids = per_key[feature].values()
            if ids_suspect(ids, rows):
                raise_embedding_error(ids, rows, None)
        counts = [per_key[f].values().numel() for f in features]
        width = max(counts + [1])
        lengths = torch.cat([torch.arange(width, device=kjt.values().device) < n for n in counts]).int()
        values = torch.cat([per_key[f].values().long() for f in features])
        return KeyedJaggedTensor(keys=list(features), values=values, lengths=lengths)

    return _cached(f"{'|'.join(features)}|sequence", (kjt,), make)


def sequence_output(kt: Any, kjt: Any, features: tuple[str, ...], names: tuple[str, ...],
                    need_indices: bool = False) -> dict[str, Any]:
    """The pooled one-id bags of :func:`sequence_to_kjt` as ``EmbeddingCollection`` returns them:
    ``{name: JaggedTensor(values (N_f, D), lengths of the input)}`` (``weights`` = the ids if ``need_indices``)."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    per_key, pooled = kjt.to_dict(), kt.to_dict()
    out = {}
    for feature, name in zip(features, names):
        ids = per_key[feature].values()
        out[name] = JaggedTensor(values=pooled[feature][:ids.numel()], lengths=per_key[feature].lengths(),
                                 weights=ids if need_indices else None)
    return out


def index_output(kt: Any, index: torch.Tensor) -> torch.Tensor:
    """The pooled ``KeyedTensor`` of :func:`index_to_kjt`'s bags as ``nn.Embedding`` returns it: ``(*S, D)``."""
    values = kt.values()
    return values.reshape(*index.shape, values.shape[-1])


def group_to_kjt(features: tuple[str, ...], *kjts: Any) -> Any:
    """The one-key ``KeyedJaggedTensor`` s of several modules as one request: keys ``features`` (one per input,
    in order), values concatenated key-major, every key padded with empty bags to the largest bag count, and
    weights of 1 for the inputs without weights when another has some. None when an input is None (a
    ``next_<input>`` that was not given). The same input objects give the same output object (prefetch)."""
    if any(k is None for k in kjts):
        return None

    def make() -> Any:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        width = max(k.lengths().numel() for k in kjts)
        lengths = torch.cat([torch.nn.functional.pad(k.lengths(), (0, width - k.lengths().numel())) for k in kjts])
        values = torch.cat([k.values().long() for k in kjts])
        weights = None
        if any(k.weights_or_none() is not None for k in kjts):
            weights = torch.cat([k.weights() if k.weights_or_none() is not None
                                 else torch.ones(k.values().numel(), device=values.device) for k in kjts])
        return KeyedJaggedTensor(keys=list(features), values=values, lengths=lengths.int(), weights=weights)

    return _cached(f"{'|'.join(features)}|group", kjts, make)


def group_output(kt: Any, kjt: Any, start: int, stop: int, index: torch.Tensor | None = None) -> torch.Tensor:
    """One member's part of a :func:`group_to_kjt` lookup's pooled ``KeyedTensor``: columns ``start:stop`` of
    the first ``B_i`` rows (``kjt``, the member's own input, has ``B_i`` bags): ``(B_i, D_i)``, or
    ``(*S, D_i)`` shaped as ``index`` (an ``nn.Embedding`` member)."""
    values = kt.values()[:kjt.lengths().numel(), start:stop]
    return values if index is None else values.reshape(*index.shape, stop - start)


bag_to_kjt.fxdist_batch_conversion = True  # type: ignore[attr-defined]  # see scheduling.prefetch
index_to_kjt.fxdist_batch_conversion = True  # type: ignore[attr-defined]
sequence_to_kjt.fxdist_batch_conversion = True  # type: ignore[attr-defined]
fxdist.wrap("bag_to_kjt")
fxdist.wrap("index_to_kjt")
fxdist.wrap("index_output")
fxdist.wrap("sequence_to_kjt")
fxdist.wrap("sequence_output")
fxdist.wrap("group_to_kjt")
fxdist.wrap("group_output")
