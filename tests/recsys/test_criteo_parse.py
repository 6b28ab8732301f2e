"""recsys.criteo_parse: the vectorised chunk parser gives parse_line's rows, ids and reasons (differential)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from recsys.criteo_format import NUM_DENSE, NUM_SPARSE, MalformedLine, hash_ids, parse_line
from recsys.criteo_parse import parse_chunk

SIZES = [50 + 7 * j for j in range(NUM_SPARSE)]


def _line(label="1", ints=None, cats=None):
    ints = ints if ints is not None else [str(i) for i in range(NUM_DENSE)]
    cats = cats if cats is not None else [f"{j:08x}" for j in range(NUM_SPARSE)]
    return "\t".join([label, *ints, *cats]) + "\n"


def _reference(raw: bytes):
    """parse_line's verdict on one line: None (blank), a reason, or (dense, ids, label)."""
    if not raw.strip():
        return None
    try:
        return parse_line(raw.decode("utf-8"), SIZES)
    except UnicodeDecodeError:
        return "encoding"
    except MalformedLine as e:
        return e.reason


def _assert_same_as_parse_line(buf: bytes) -> None:
    parsed = parse_chunk(buf, examples=10**9)
    ids = hash_ids(parsed.values, parsed.present, SIZES)
    raws = buf.split(b"\n") if buf else []
    if buf.endswith(b"\n"):
        raws = raws[:-1]
    assert parsed.line_count == len(raws)
    expected_bad = {}
    rows = iter(range(len(parsed)))
    for i, raw in enumerate(raws):
        ref = _reference(raw)
        if isinstance(ref, str):
            expected_bad[i] = ref
        elif ref is not None:
            k = next(rows)
            assert parsed.lines[k] == i
            dense, sparse, label = ref
            np.testing.assert_allclose(parsed.dense[k], np.float32(dense), rtol=1e-6)
            assert ids[k].tolist() == sparse and parsed.labels[k] == label
    assert next(rows, None) is None
    assert parsed.malformed_lines == sorted(expected_bad)
    assert dict(parsed.malformed) == {r: list(expected_bad.values()).count(r) for r in set(expected_bad.values())}


_CHARS = st.sampled_from(list("0123456789abcdefABCDEF-+._ \r\x00x") + ["\u00e9", "\u0661", "\t"])
_FIELD = st.one_of(st.text(_CHARS.filter(lambda c: c != "\t"), max_size=22), st.just(""),
                   st.integers(-(2**63), 2**63 - 1).map(str), st.integers(0, 2**64 - 1).map(lambda v: f"{v:x}"),
                   st.integers(0, 2**70).map(str))
_LINE = st.one_of(
    st.lists(_FIELD, min_size=40, max_size=40).map(lambda f: "\t".join(f)),
    st.lists(_FIELD, min_size=38, max_size=41).map(lambda f: "\t".join(f)),
    st.builds(lambda label, ints, cats: _line(label, ints, cats).rstrip("\n"), st.sampled_from(["0", "1", "2"]),
              st.lists(st.one_of(st.just(""), st.integers(-5, 10**12).map(str)), min_size=13, max_size=13),
              st.lists(st.one_of(st.just(""), st.integers(0, 2**32 - 1).map(lambda v: f"{v:08x}")),
                       min_size=26, max_size=26)),
    st.text(max_size=30),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_LINE, min_size=1, max_size=12), st.booleans())
def test_vectorised_parse_matches_parse_line(lines, trailing_newline):
    text = "\n".join(line.replace("\n", " ") for line in lines) + ("\n" if trailing_newline else "")
    _assert_same_as_parse_line(text.encode("utf-8", "surrogatepass"))


def test_vectorised_parse_on_edge_lines():
    lines = [_line("0", ["", "-1", "0", "1", "9", "-", "+3", *["2"] * 6]), _line(), "\n", " \t \r\n",
             _line(ints=["9" * 19] + ["1"] * 12), _line(ints=["9" * 18] + ["1"] * 12),
             _line(cats=["0" * 16] + ["A"] * 25), _line(cats=["0" * 17] + ["A"] * 25), _line().replace("\n", "\r\r\n"),
             _line(label="1\x00"), "x" * 5 + "\n", _line(cats=["68fd1e64"] * 25 + ["\u00e9"])]
    _assert_same_as_parse_line("".join(lines).encode())
    _assert_same_as_parse_line(b"")
    _assert_same_as_parse_line(_line().encode() + b"\xff\xfe\n" + _line().encode())
