"""jobs.launcher.serving_inputs: request bodies into model inputs, outputs into JSON; every refusal names its place."""

from __future__ import annotations

import json

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from jobs.launcher.serving_inputs import MAX_ROWS, RequestError, criteo_rows, decode_inputs, to_json
from recsys.criteo_format import parse_line
from tests.jobs._serving import ROWS

SIZES = [50] * 26


def test_criteo_rows_are_the_readers_features():
    dense, ids = criteo_rows(ROWS, SIZES)
    assert dense.dtype == torch.float32 and dense.shape == (3, 13) and ids.shape == (3, 26)
    for i, row in enumerate(ROWS):
        want_dense, want_ids, _ = parse_line(row, SIZES)
        assert torch.equal(dense[i], torch.tensor(want_dense, dtype=torch.float32))
        assert ids[i].tolist() == want_ids
    assert ids[2].tolist() == [0] * 26  # every categorical missing
    raw = criteo_rows(ROWS[:1], [0] * 26)[1]  # dynamic tables: raw 63-bit ids
    assert raw[0].tolist() == parse_line(ROWS[0], [0] * 26)[1] and int(raw.max()) > 50


@pytest.mark.parametrize(("rows", "message"), [
    ([], "non-empty list"), ("a line", "non-empty list"), ([3], r"rows\[0\]: a Criteo line must be a string"),
    ([ROWS[0], ""], r"rows\[1\]: an empty line"), ([ROWS[0] + "\nmore"], "line break"),
    (["2" + ROWS[0][1:]], r"rows\[0\]: label"), ([ROWS[1].replace("\t32\t", "\t3.5\t")], "integer_feature"),
    ([ROWS[0] + "\textra"], "field_count")])
def test_bad_rows_are_refused_by_name(rows, message):
    with pytest.raises(RequestError, match=message):
        criteo_rows(rows, SIZES)


def test_too_many_rows_are_refused():
    with pytest.raises(RequestError, match=f"at most {MAX_ROWS}"):
        criteo_rows([ROWS[0]] * (MAX_ROWS + 1), SIZES)


def _kjt(weights: bool = False) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 0, 1],
                             dtype=torch.int32), weights=torch.ones(3) if weights else None)


def test_inputs_follow_the_samples_structure():
    sample = (torch.zeros(2, 3), {"ids": torch.zeros(2, dtype=torch.int64), "kjt": _kjt()}, [1.0, None, "x"])
    body = json.loads(json.dumps([[[1, 2, 3]], {"ids": [4], "kjt": {"keys": ["b", "a"], "values": [9, 8],
                                                                    "lengths": [1, 0, 1, 0]}}, [2, None, "y"]]))
    dense, named, rest = decode_inputs(body, sample)
    assert dense.dtype == torch.float32 and dense.tolist() == [[1.0, 2.0, 3.0]]
    assert named["ids"].dtype == torch.int64 and named["ids"].tolist() == [4]
    kjt = named["kjt"]
    assert kjt.keys() == ["b", "a"] and kjt.lengths().dtype == torch.int32 and kjt.values().tolist() == [9, 8]
    assert rest == [2.0, None, "y"]


@pytest.mark.parametrize(("inputs", "message"), [
    ({"x": 1}, "must be a list of the model's 2 positional inputs"),
    ([[1.0], [1]], r"inputs\[0\]: expected 2 dimensions"),
    ([[[1.0]], [1.5]], r"inputs\[1\]: expected torch.int64 values \(integers\)"),
    ([[[1.0], [2.0, 3.0]], [1]], r"inputs\[0\]: not a rectangular"),
    ([[[1.0]], "7"], r"inputs\[1\]: expected a nested list")])
def test_bad_inputs_are_refused_by_place(inputs, message):
    with pytest.raises(RequestError, match=message):
        decode_inputs(inputs, (torch.zeros(1, 1), torch.zeros(1, dtype=torch.int64)))


@pytest.mark.parametrize(("value", "message"), [
    ({"keys": ["a", "b"], "values": [1]}, "keys"),
    ({"keys": ["a", "c"], "values": [1], "lengths": [1, 0]}, r"\.keys: expected the features"),
    ({"keys": ["a", "b"], "values": [1], "lengths": [1, 1]}, "adding up to len"),
    ({"keys": ["a", "b"], "values": [1, 2, 3], "lengths": [3]}, "one non-negative count per key"),
    ({"keys": ["a", "b"], "values": [-1], "lengths": [1, 0]}, "non-negative")])
def test_bad_jagged_inputs_are_refused(value, message):
    with pytest.raises(RequestError, match=message):
        decode_inputs([value], (_kjt(),))


def test_weighted_jagged_inputs_need_their_weights():
    kjt = decode_inputs([{"keys": ["a", "b"], "values": [5], "lengths": [0, 1], "weights": [0.5]}], (_kjt(True),))[0]
    assert kjt.weights().tolist() == [0.5]
    with pytest.raises(RequestError, match="weights"):
        decode_inputs([{"keys": ["a", "b"], "values": [5], "lengths": [0, 1]}], (_kjt(True),))


def test_outputs_as_json_keep_float32_bits():
    x = torch.randn(3, dtype=torch.float32)
    out = to_json({"a": (x, torch.tensor([1, 2])), "b": 2.5, "c": float("nan")})
    back = json.loads(json.dumps(out))
    assert torch.equal(torch.tensor(back["a"][0], dtype=torch.float32), x) and back["a"][1] == [1, 2]
    assert back["b"] == 2.5 and back["c"] is None
    assert to_json(torch.tensor([1.0, float("inf")])) == [1.0, None]
    with pytest.raises(TypeError, match="serving answers tensors"):
        to_json(object())
