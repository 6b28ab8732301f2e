"""The request and answer bodies of ``fxdist serve``: JSON in, the model's inputs; the model's outputs, JSON out.

``POST /predict`` takes one JSON object:

- the built-in DLRM: ``{"rows": ["<Criteo TSV line>", ...]}``: each row a Criteo line, with its label (40
  tab-separated fields) or without it (39: ``I1..I13, C1..C26``). The rows are parsed by the job's own reader
  (:func:`recsys.criteo_parse.parse_chunk`, then :func:`recsys.criteo_format.hash_ids` into the run's table
  sizes, :func:`jobs.table_sizes.reader_sizes`), so a row gets exactly the features the trainers saw: ``dense (B,
  13) float32`` and ``ids (B, 26) int64``, then :func:`jobs.criteo.to_kjt`;
- your model (``[model] factory``): ``{"inputs": [input_1, ..., input_n]}``: ``forward``'s positional inputs in the
  structure of the run's ``sample_input.pt`` (:func:`jobs.launcher.model_export.load_sample_input`): a tensor as a
  nested list (its dtype and number of dimensions those of the sample's, the batch size free), a torchrec
  ``KeyedJaggedTensor`` as ``{"keys": [...], "values": [...], "lengths": [...]}`` (``"weights"`` too when the
  sample has them), tuples and lists as lists, dicts as objects with the same keys, numbers and strings as they are.

Whatever does not fit raises :class:`RequestError` naming the place (``rows[3]``, ``inputs[0].lengths``) and what was
wrong; the deployment answers it with HTTP 400. Outputs go back as JSON with :func:`to_json` (tensors as nested
lists of Python floats or ints: a float32 value converts to a double exactly, so a client reading it back as
float32 gets the model's bits).

Source: the Criteo Kaggle format (:mod:`recsys.criteo_format`); torchrec ``KeyedJaggedTensor`` (keys, values,
lengths, weights); ``torch.utils._pytree`` for output structures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from recsys.criteo_format import NUM_FIELDS, MalformedLine, hash_ids, parse_fields
from recsys.criteo_parse import parse_chunk

__all__ = ["RequestError", "MAX_ROWS", "criteo_rows", "decode_inputs", "to_json"]

MAX_ROWS = 65_536
"""The most rows (or batch entries) one request may carry."""


class RequestError(ValueError):
    """A ``POST /predict`` body the served model cannot take: not JSON, a missing field, a malformed Criteo row, an
    input of the wrong structure, type or number of dimensions (the message names which). Answered with HTTP 400.

    See docs/troubleshooting.md#requesterror.
    """


def _label_first(i: int, row: Any) -> str:
    if not isinstance(row, str):
        raise RequestError(f"rows[{i}]: a Criteo line must be a string, got {type(row).__name__}")
    line = row.rstrip("\r\n")
    if "\n" in line or "\r" in line:
        raise RequestError(f"rows[{i}]: one Criteo line per row (this one has a line break inside)")
    if not line.strip():
        raise RequestError(f"rows[{i}]: an empty line")
    return line if line.count("\t") == NUM_FIELDS - 1 else "0\t" + line  # no label: any label, it is not used


def criteo_rows(rows: Any, sizes: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Criteo lines (label optional) as the job's reader makes them: ``(dense (B, 13) float32, ids (B, 26) int64)``.

    Args:
        rows: a list of strings, one Criteo line each (with or without the label column).
        sizes: the 26 tables' sizes the reader hashes into (:func:`jobs.table_sizes.reader_sizes`; 0 = raw ids of a
            dynamic table).

    Raises:
        RequestError: ``rows`` is not a non-empty list of at most :data:`MAX_ROWS` strings, or a row is not a valid
            Criteo line (the message names the row and the reason: ``field_count``, ``integer_feature``...).
    """
    if not isinstance(rows, list) or not rows:
        raise RequestError(f"'rows' must be a non-empty list of Criteo lines, got {type(rows).__name__}")
    if len(rows) > MAX_ROWS:
        raise RequestError(f"'rows': {len(rows)} rows, at most {MAX_ROWS} a request")
    lines = [_label_first(i, row) for i, row in enumerate(rows)]
    parsed = parse_chunk("\n".join(lines).encode("utf-8", "surrogatepass"))
    if len(parsed) != len(lines):
        good = set(parsed.lines.tolist())
        for i, line in enumerate(lines):
            if i not in good:
                try:
                    parse_fields(line)
                except MalformedLine as e:
                    raise RequestError(f"rows[{i}]: {e.reason}: {e.detail}") from None
                raise RequestError(f"rows[{i}]: not a valid Criteo line (encoding)")
    ids = hash_ids(parsed.values, parsed.present, list(sizes))
    return torch.from_numpy(parsed.dense).float(), torch.from_numpy(ids)


def _tensor(value: Any, like: torch.Tensor, where: str) -> torch.Tensor:
    """``value`` (a nested list, or a number for a 0-d sample) as a tensor of ``like``'s dtype and dimensions."""
    if isinstance(value, (dict, str)) or value is None:
        raise RequestError(f"{where}: expected a nested list of numbers (a {like.dim()}-d {like.dtype} tensor), got "
                           f"{type(value).__name__}")
    try:
        parsed = torch.tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise RequestError(f"{where}: not a rectangular nested list of numbers ({e})") from None
    if parsed.dim() != like.dim():
        raise RequestError(f"{where}: expected {like.dim()} dimensions (the sample's shape is {tuple(like.shape)}), "
                           f"got shape {tuple(parsed.shape)}")
    if parsed.dim() and parsed.shape[0] > MAX_ROWS:
        raise RequestError(f"{where}: {parsed.shape[0]} rows, at most {MAX_ROWS} a request")
    if parsed.is_floating_point() and not (like.is_floating_point() or like.is_complex()):
        raise RequestError(f"{where}: expected {like.dtype} values (integers), got numbers with a fraction")
    if parsed.dtype == torch.bool and like.dtype != torch.bool:
        raise RequestError(f"{where}: expected {like.dtype} values, got booleans")
    return parsed.to(like.dtype)


def _kjt(value: Any, like: Any, where: str) -> Any:
    """``{"keys", "values", "lengths"[, "weights"]}`` as a ``KeyedJaggedTensor`` like the sample's ``like``."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    fields = {"keys", "values", "lengths"} | ({"weights"} if like.weights_or_none() is not None else set())
    if not isinstance(value, dict) or set(value) != fields:
        got = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise RequestError(f"{where}: a KeyedJaggedTensor is an object with keys {sorted(fields)}, got {got}")
    keys = value["keys"]
    if not isinstance(keys, list) or sorted(keys) != sorted(like.keys()) or len(set(keys)) != len(keys):
        raise RequestError(f"{where}.keys: expected the features {list(like.keys())} (any order), got {keys!r}")
    values = _tensor(value["values"], like.values(), f"{where}.values")
    lengths = _tensor(value["lengths"], like.lengths(), f"{where}.lengths")
    if len(lengths) % len(keys) or bool((lengths < 0).any()) or int(lengths.sum()) != len(values):
        raise RequestError(f"{where}: lengths must be one non-negative count per key and bag ({len(keys)} keys x B "
                           f"bags) adding up to len(values) = {len(values)}; got {len(lengths)} lengths summing to "
                           f"{int(lengths.sum())}")
    weights = _tensor(value["weights"], like.weights(), f"{where}.weights") if "weights" in fields else None
    if weights is not None and len(weights) != len(values):
        raise RequestError(f"{where}.weights: one weight per value ({len(values)}), got {len(weights)}")
    if bool((values < 0).any()):
        raise RequestError(f"{where}.values: ids must be non-negative")
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)


def _decode(value: Any, like: Any, where: str) -> Any:
    if isinstance(like, torch.Tensor):
        return _tensor(value, like, where)
    if type(like).__name__ == "KeyedJaggedTensor":
        return _kjt(value, like, where)
    if isinstance(like, (tuple, list)):
        if not isinstance(value, list) or len(value) != len(like):
            raise RequestError(f"{where}: expected a list of {len(like)} items, got "
                               f"{len(value) if isinstance(value, list) else type(value).__name__}")
        items = [_decode(v, t, f"{where}[{i}]") for i, (v, t) in enumerate(zip(value, like, strict=True))]
        return tuple(items) if isinstance(like, tuple) else items
    if isinstance(like, dict):
        if not isinstance(value, dict) or set(value) != set(like):
            got = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise RequestError(f"{where}: expected an object with keys {sorted(like)}, got {got}")
        return {k: _decode(value[k], like[k], f"{where}.{k}") for k in like}
    if like is None:
        if value is not None:
            raise RequestError(f"{where}: expected null")
        return None
    kind: Any = (int, float) if type(like) is float else type(like)  # JSON writes 2.0 as 2
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise RequestError(f"{where}: expected a {type(like).__name__}, got {type(value).__name__}")
    return float(value) if type(like) is float else value


def decode_inputs(inputs: Any, sample: Sequence[Any]) -> tuple[Any, ...]:
    """A request's ``inputs`` as ``forward``'s positional arguments, in the structure of ``sample``.

    Args:
        inputs: the JSON value of the request's ``"inputs"``: a list with one item per positional input.
        sample: the run's sample inputs (:func:`jobs.launcher.model_export.load_sample_input`): their structure,
            dtypes and numbers of dimensions are what a request must match.

    Raises:
        RequestError: a structure, type, number of dimensions or size that does not fit (the message names where,
            e.g. ``inputs[1].lengths``).
    """
    if not isinstance(inputs, list) or len(inputs) != len(sample):
        got = f"{len(inputs)} items" if isinstance(inputs, list) else type(inputs).__name__
        raise RequestError(f"'inputs' must be a list of the model's {len(sample)} positional inputs, got {got}")
    return tuple(_decode(v, s, f"inputs[{i}]") for i, (v, s) in enumerate(zip(inputs, sample, strict=True)))


def to_json(output: Any) -> Any:
    """A model's output as JSON values: tensors as (nested) lists, tuples as lists, dicts with their keys,
    numbers as they are; a non-finite float becomes None (JSON has no NaN).

    Raises:
        TypeError: an output leaf of another type (named).
    """
    if isinstance(output, torch.Tensor):
        out = output.detach().cpu()
        if out.is_floating_point() and not bool(torch.isfinite(out).all()):
            return to_json(out.tolist())
        return out.tolist()
    if isinstance(output, (tuple, list)):
        return [to_json(v) for v in output]
    if isinstance(output, dict):
        return {str(k): to_json(v) for k, v in output.items()}
    if isinstance(output, float):
        return output if math.isfinite(output) else None
    if output is None or isinstance(output, (bool, int, str)):
        return output
    raise TypeError(f"model output of type {type(output).__module__}.{type(output).__qualname__}: serving answers "
                    "tensors, tuples, lists, dicts and numbers")
