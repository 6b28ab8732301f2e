"""Graph leaves of :func:`scheduling.parameter_servers`: ``nn.EmbeddingBag`` / ``nn.Embedding`` inputs in the
servers' ``KeyedJaggedTensor`` wire format, and the lookups' outputs in the shapes those modules return.

Each is registered with :func:`fxdist.wrap` (one ``call_function`` node when traced again) and is pure.

Shapes:
    ``bag_to_kjt(f, input (B, L))`` or ``bag_to_kjt(f, input (N,), offsets (B,) | (B + 1,))`` -> one key
    ``f`` with ``B`` bags; ``index_to_kjt(f, index (*S))`` -> one key, ``prod(S)`` bags of one id each;
    ``index_output(kt, index (*S))`` -> ``(*S, D)``; ``sequence_to_kjt(kjt, features)`` (torchrec
    ``EmbeddingCollection`` input) -> the same features, each id its own bag, every feature padded with empty bags
    to the longest one's id count ``W``; ``sequence_output(kt (W, F * D), kjt, ...)`` -> ``{name: JaggedTensor}``
    with values ``(N_f, D)``, as ``EmbeddingCollection`` returns; ``group_to_kjt(features, members, *tensors)``
    (the inputs of ``n`` bags / embeddings, ``B_i`` bags each) -> one ``KeyedJaggedTensor`` of ``n`` keys, every
    key padded with empty bags to ``max(B_i)``; ``group_output(kt (max B_i, sum D), start, stop, input, ...)`` ->
    module ``i``'s ``(B_i, D_i)`` (``(*S, D_i)`` for an ``nn.Embedding``).

The conversion of the same input tensors (same objects, not modified in place since: same ``_version``) gives
the same ``KeyedJaggedTensor`` object again, so a lookup prefetched for the next batch (``PSClient`` matches
prefetched batches by identity) is found when that batch's own step converts it.

Source: ``torch.nn.functional.embedding_bag`` (input/offsets conventions, ``padding_idx``); torchrec
``KeyedJaggedTensor`` (key-major ``lengths``).
"""

from __future__ import annotations

import weakref
from typing import Any, cast

import torch

import fxdist

from ..ps.checks import bad_id_dtype, ids_suspect, raise_embedding_bag_error, raise_embedding_error

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


def _drop_padding(values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None,
                  padding_idx: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Padding ids leave their bag (and a mean's count), as in ``F.embedding_bag``."""
    if padding_idx is not None:
        keep = values != padding_idx
        if not bool(keep.all()):
            bags = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
            lengths = torch.bincount(bags[keep], minlength=lengths.numel())
            values = values[keep]
            weights = weights[keep] if weights is not None else None
    return values, lengths, weights


def _kjt(feature: str, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None,
         padding_idx: int | None) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    values, lengths, weights = _drop_padding(values.reshape(-1).long(), lengths,
                                             weights.reshape(-1) if weights is not None else None, padding_idx)
    return KeyedJaggedTensor(keys=[feature], values=values, lengths=lengths.int(), weights=weights)


def _bag_suspect(input: Any, offsets: Any, per_sample_weights: Any, mode: str, num_embeddings: int | None) -> bool:
    """Whether the local ``nn.EmbeddingBag`` might refuse these arguments (cheap tests only; the ids' range
    too unless ``num_embeddings`` is None, where only their dtype is tested)."""
    if not isinstance(input, torch.Tensor) or input.dim() not in (1, 2) or (input.dim() == 2) == (offsets is not None):
        return True
    if per_sample_weights is not None and (mode != "sum" or per_sample_weights.shape != input.shape):
        return True
    if offsets is not None and (offsets.dtype != input.dtype or (offsets.numel() > 0 and int(offsets[0]) != 0)):
        return True
    if num_embeddings is None:
        return bad_id_dtype(input)
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
        values, lengths = _bag_parts(feature, input, offsets, include_last_offset)
        return _kjt(feature, values, lengths, per_sample_weights, padding_idx)

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


def _bag_parts(feature: str, input: torch.Tensor, offsets: Any, include_last_offset: bool,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values (N,), lengths (B,))`` of ``nn.EmbeddingBag``'s ``input`` (2-D, or 1-D with ``offsets``)."""
    if input.dim() == 2:
        if offsets is not None:
            raise ValueError(f"{feature}: offsets must be None when input is 2-D {tuple(input.shape)}")
        return input.reshape(-1), torch.full((input.shape[0],), input.shape[1], dtype=torch.long,
                                             device=input.device)
    if input.dim() != 1:
        raise ValueError(f"{feature}: input must be 1-D (with offsets) or 2-D, got {input.dim()}-D")
    if offsets is None:
        raise ValueError(f"{feature}: a 1-D input needs offsets (bag starts)")
    starts = offsets.long()
    ends = starts[1:] if include_last_offset else torch.cat([starts[1:], starts.new_tensor([input.numel()])])
    return input, ends - (starts[:-1] if include_last_offset else starts)


def _member_parts(feature: str, member: tuple, tensors: tuple) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """One group member's ``(values, lengths, weights)``, after the local module's cheap structural checks
    (ids' range is checked for the whole group at once)."""
    if member[0] == "embedding":
        (index,), (_, rows, padding_idx) = tensors, member
        if bad_id_dtype(index):
            raise_embedding_error(index, rows, padding_idx)
        return index.reshape(-1), torch.ones(index.numel(), dtype=torch.long, device=index.device), None
    (input, offsets, weights), (_, rows, mode, include_last_offset, padding_idx) = tensors, member
    if _bag_suspect(input, offsets, weights, mode, None):
        raise_embedding_bag_error(input, rows, offsets, mode, weights, include_last_offset, padding_idx)
    values, lengths = _bag_parts(feature, input, offsets, include_last_offset)
    return values, lengths, (weights.reshape(-1) if weights is not None else None)


def _check_group_range(features: tuple[str, ...], members: tuple, tensors: list[tuple], values: list) -> None:
    """Every id in ``[0, rows)`` of its member's table, in one pass; else the member's local error."""
    flat = torch.cat(values)
    if flat.numel() == 0:
        return
    rows = torch.tensor([m[1] for m in members], device=flat.device)
    limit = rows.repeat_interleave(torch.tensor([v.numel() for v in values], device=flat.device))
    if not bool(((flat < 0) | (flat >= limit)).any()):
        return
    for feature, member, ts, v in zip(features, members, tensors, values):
        if ids_suspect(v, member[1]):
            if member[0] == "embedding":
                raise_embedding_error(ts[0], member[1], member[2])
            raise_embedding_bag_error(ts[0], member[1], ts[1], member[2], ts[2], member[3], member[4])
            raise IndexError(f"{feature}: an id is outside [0, {member[1]})")


def group_to_kjt(features: tuple[str, ...], members: tuple, *tensors: Any) -> Any:
    """The inputs of several ``nn.EmbeddingBag`` / ``nn.Embedding`` modules as one ``KeyedJaggedTensor``.

    Args:
        features: one key per module, in order.
        members: per module ``("bag", num_embeddings, mode, include_last_offset, padding_idx)`` or
            ``("embedding", num_embeddings, padding_idx)``.
        tensors: per bag ``(input, offsets, per_sample_weights)``, per embedding ``(index,)``, in order.

    Returns:
        keys ``features``, values concatenated key-major, every key padded with empty bags to the largest bag
        count, weights of 1 for the modules without ``per_sample_weights`` when another has them (padding ids
        leave their bag, as in :func:`bag_to_kjt`); None when an input is None (a ``next_<input>`` that was
        not given). The same tensors give the same object again (prefetch).

    Raises:
        RuntimeError, ValueError, NotImplementedError, IndexError: what the first module that refuses its
            arguments raises locally, word for word (see :func:`bag_to_kjt`).
    """
    per_member, k = [], 0
    for member in members:
        n = 1 if member[0] == "embedding" else 3
        per_member.append(tensors[k:k + n])
        k += n
    if any(ts[0] is None for ts in per_member):
        return None

    def make() -> Any:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        parts = [_member_parts(f, m, ts) for f, m, ts in zip(features, members, per_member)]
        _check_group_range(features, members, per_member, [v for v, _, _ in parts])
        weighted = any(w is not None for _, _, w in parts)
        if weighted:
            parts = [(v, n, torch.ones(v.numel(), device=v.device) if w is None else w) for v, n, w in parts]
        kjts = [_drop_padding(v.long(), n, w, m[-1]) for (v, n, w), m in zip(parts, members)]
        width = max(n.numel() for _, n, _ in kjts)
        lengths = torch.cat([torch.nn.functional.pad(n, (0, width - n.numel())) for _, n, _ in kjts])
        # weighted: every part has weights (ones filled in above)
        weights = torch.cat([cast(torch.Tensor, w) for _, _, w in kjts]) if weighted else None
        return KeyedJaggedTensor(keys=list(features), values=torch.cat([v for v, _, _ in kjts]),
                                 lengths=lengths.int(), weights=weights)

    return _cached(f"{'|'.join(features)}|group", tensors, make)


def group_output(kt: Any, start: int, stop: int, input: torch.Tensor, offsets: Any = None,
                 include_last_offset: bool = False, embedding: bool = False) -> torch.Tensor:
    """One module's part of a :func:`group_to_kjt` lookup's pooled ``KeyedTensor`` ``(max B, sum D)``: columns
    ``start:stop`` of its own bags' rows: ``(B, D)`` for an ``nn.EmbeddingBag`` (``B`` from its ``input`` /
    ``offsets``), ``(*S, D)`` for an ``nn.Embedding`` (``embedding=True``, ``input`` its index ``(*S)``)."""
    if embedding:
        rows = input.numel()
    elif input.dim() == 2:
        rows = input.shape[0]
    else:
        rows = offsets.numel() - (1 if include_last_offset else 0)
    values = kt.values()[:rows, start:stop]
    return values.reshape(*input.shape, stop - start) if embedding else values


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
