"""recsys.criteo_arrow: Arrow's CSV reader as the fast path of the Criteo chunk parser.

Differential: wherever the fast path answers, it gives the strict numpy parser's arrays bit for bit; wherever a
line is not valid (or could be read differently by Arrow's own conversion rules), it declines."""

from __future__ import annotations

import random

import numpy as np
import pytest

pytest.importorskip("pyarrow.csv")

from recsys.criteo_arrow import parse_clean_chunk  # noqa: E402
from recsys.criteo_parse import parse_chunk  # noqa: E402

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st


def _line(rng: random.Random, *, hex_len: tuple[int, int] = (8, 8)) -> str:
    label = rng.choice("01")
    ints = [rng.choice(["", str(rng.randint(-3, 10**rng.randint(0, 12))), "007", "-0"]) for _ in range(13)]
    cats = ["" if rng.random() < 0.1 else "".join(rng.choice("0123456789abcdefABCDEF")
                                                  for _ in range(rng.randint(*hex_len))) for _ in range(26)]
    return "\t".join([label, *ints, *cats])


def _chunk(lines: list[str], final_newline: bool = True) -> bytes:
    return ("\n".join(lines) + ("\n" if final_newline else "")).encode()


def _same_as_strict(buf: bytes) -> None:
    strict = parse_chunk(buf, engine="numpy")
    fast = parse_clean_chunk(buf)
    if fast is None:
        return
    assert len(strict) == strict.line_count, "the fast path answered for a chunk with an invalid line"
    for got, want in zip(fast, (strict.dense, strict.values, strict.present, strict.labels)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("hex_len", [(8, 8), (1, 16)])
@pytest.mark.parametrize("final_newline", [True, False])
def test_clean_chunks_take_the_fast_path_and_match(hex_len, final_newline):
    rng = random.Random(7)
    buf = _chunk([_line(rng, hex_len=hex_len) for _ in range(500)], final_newline)
    assert parse_clean_chunk(buf) is not None
    _same_as_strict(buf)


def test_a_column_empty_on_every_line():
    rng = random.Random(1)
    lines = []
    for _ in range(20):
        fields = _line(rng).split("\t")
        fields[3] = fields[20] = ""
        lines.append("\t".join(fields))
    buf = _chunk(lines)
    fast = parse_clean_chunk(buf)
    assert fast is not None and not fast[2][:, 20 - 14].any() and (fast[0][:, 2] == 0).all()
    _same_as_strict(buf)


@pytest.mark.parametrize("bad", [
    ("int", "0x1"), ("int", " 3"), ("int", "+3"), ("int", "1a"), ("int", "-"), ("int", "9223372036854775808"),
    ("int", "1.5"), ("cat", "a" * 17), ("cat", "-1"), ("cat", "xyz"), ("label", "00"), ("label", ""),
    ("label", "2"), ("line", ""), ("line", "\r"), ("tabs", "-1"), ("tabs", "+1"), ("line", "\x00"),
])
def test_anything_not_valid_goes_back_to_the_strict_parser(bad):
    rng = random.Random(3)
    lines = [_line(rng) for _ in range(50)]
    fields = lines[17].split("\t")
    kind, value = bad
    if kind == "int":
        fields[5] = value
    elif kind == "cat":
        fields[30] = value
    elif kind == "label":
        fields[0] = value
    elif kind == "tabs":
        fields = fields[:-1] if value == "-1" else fields + ["0a"]
    lines[17] = value if (kind == "line" and value == "") else "\t".join(fields) + (value if kind == "line" else "")
    buf = _chunk(lines)
    assert parse_clean_chunk(buf) is None
    assert parse_chunk(buf).line_count == 50
    assert sum(parse_chunk(buf).malformed.values()) == (0 if bad in (("line", ""), ("line", "\r")) else 1)  # "\r": stripped


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(list("0123456789abcdefAF-\t\n x+")), min_size=0, max_size=40),
       st.integers(0, 2**32), st.integers(0, 4))
def test_corrupted_chunks_never_disagree(noise, seed, line):
    rng = random.Random(seed)
    lines = [_line(rng, hex_len=(1, 16)) for _ in range(5)]
    text = "\n".join(lines)
    at = rng.randint(0, len(text))
    buf = (text[:at] + "".join(noise) + text[at:] + "\n").encode()
    _same_as_strict(buf)


@pytest.mark.parametrize("corrupt", [False, True])
def test_parse_chunk_gives_the_same_chunk_with_either_engine(corrupt):
    rng = random.Random(11)
    lines = [_line(rng, hex_len=(1, 16)) for _ in range(300)]
    if corrupt:
        lines[6] = lines[6].replace("\t", " ", 1)
        lines[99] = ""
    buf = _chunk(lines)
    select = lambda idx: idx % 3 != 1  # noqa: E731 - a trainer's share, as the streaming reader asks
    auto, strict = parse_chunk(buf, select, engine="auto"), parse_chunk(buf, select, engine="numpy")
    for name in ("dense", "values", "present", "labels", "lines"):
        np.testing.assert_array_equal(getattr(auto, name), getattr(strict, name))
    assert (auto.line_count, auto.malformed, auto.malformed_lines) == (
        strict.line_count, strict.malformed, strict.malformed_lines)
    assert strict.line_count == 300 and len(strict) == 200 - 2 * corrupt and sum(strict.malformed.values()) == corrupt


def test_an_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="engine must be one of"):
        parse_chunk(b"", engine="polars")
