"""recsys.criteo_format: one line's parsing (log transform, hashing, malformed lines by reason), the id hash,
compressed files, the launcher's checks of a data file, the files of a directory or glob."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsys.criteo_format import (
    NUM_DENSE,
    NUM_SPARSE,
    DataError,
    MalformedLine,
    check_data_file,
    data_files,
    hash_ids,
    parse_line,
)
from recsys.criteo_shard import CriteoShard
from tests.recsys._lines import SIZES
from tests.recsys._lines import criteo_line as _line


def test_parse_line_log_transform_and_hashing():
    ints = ["", "-1", "0", "1", "9", *["2"] * (NUM_DENSE - 5)]
    cats = ["", "68fd1e64", *["68fd1e64"] * (NUM_SPARSE - 2)]
    dense, sparse, label = parse_line(_line("0", ints, cats), table_size=1000)
    assert label == 0.0
    assert dense[:5] == [0.0, 0.0, 0.0, math.log(2), math.log(10)]
    assert sparse[0] == 0  # empty categorical -> the "missing" id
    assert all(1 <= s < 1000 for s in sparse[1:])
    # the same value in different tables hashes independently, and hashing is stable across calls
    assert len(set(sparse[1:])) > 1
    assert parse_line(_line("0", ints, cats), table_size=1000)[1] == sparse


@pytest.mark.parametrize(
    "line, reason",
    [
        ("1\t2\t3\n", "field_count"),
        (_line(label="x"), "label"),
        (_line(ints=["1.5"] + ["1"] * (NUM_DENSE - 1)), "integer_feature"),
        # every way one field can be bad: the line is counted by reason, never an OverflowError & co.
        (_line(ints=["9" * 400] + ["1"] * (NUM_DENSE - 1)), "integer_range"),  # was OverflowError in log1p
        (_line(ints=["9" * 5000] + ["1"] * (NUM_DENSE - 1)), "integer_range"),  # past int()'s digit limit
        (_line(ints=[str(2**63)] + ["1"] * (NUM_DENSE - 1)), "integer_range"),
        (_line(ints=["nan"] + ["1"] * (NUM_DENSE - 1)), "integer_feature"),
        (_line(ints=["inf"] + ["1"] * (NUM_DENSE - 1)), "integer_feature"),
        (_line(ints=["-inf"] + ["1"] * (NUM_DENSE - 1)), "integer_feature"),
        (_line(ints=["1_000"] + ["1"] * (NUM_DENSE - 1)), "integer_feature"),  # int() would accept it
        (_line(ints=["\u0661\u0662"] + ["1"] * (NUM_DENSE - 1)), "integer_feature"),  # Arabic-Indic digits
        (_line(ints=[" 3"] + ["1"] * (NUM_DENSE - 1)), "integer_feature"),
        (_line(ints=["-"] + ["1"] * (NUM_DENSE - 1)), "integer_feature"),
        (_line(cats=["68fd1e64zz"] + ["68fd1e64"] * (NUM_SPARSE - 1)), "categorical_feature"),
        (_line(cats=["0" * 17] + ["68fd1e64"] * (NUM_SPARSE - 1)), "categorical_feature"),
        (_line(cats=["68fd 1e64"] + ["68fd1e64"] * (NUM_SPARSE - 1)), "categorical_feature"),
        (_line(cats=["68fd1e64\x00"] + ["68fd1e64"] * (NUM_SPARSE - 1)), "nul_byte"),
        ("\x00" * 50, "nul_byte"),
        (_line(label="\ufffd"), "label"),
    ],
)
def test_malformed_reasons(line, reason):
    with pytest.raises(MalformedLine) as info:
        parse_line(line, 100)
    assert info.value.reason == reason


def test_negative_and_extreme_counts_are_clamped_or_kept_finite():
    # Criteo Kaggle has -1/-2 in I2: clamped to 0 (DLRM's preprocessing); int64 extremes stay finite
    ints = ["-2", str(-(2**63)), str(2**63 - 1), *["0"] * (NUM_DENSE - 3)]
    dense, _, _ = parse_line(_line(ints=ints), 100)
    assert dense[:3] == [0.0, 0.0, math.log1p(2**63 - 1)] and all(math.isfinite(x) for x in dense)
    # ids of 1 to 16 hex digits, either case, are accepted and hashed as text
    _, sparse, _ = parse_line(_line(cats=["A", "0" * 16, *["68FD1E64"] * (NUM_SPARSE - 2)]), 100)
    assert all(1 <= s < 100 for s in sparse)


_FIELD_CHARS = st.sampled_from(list("0123456789abcdefABCDEF-+._ \t\r\n\x00\ufffd\u0661xnaif") + ["\u00e9"])


@settings(max_examples=400, deadline=None)
@given(st.one_of(
    st.text(),  # anything
    st.text(_FIELD_CHARS),  # Criteo-like characters, tabs and line breaks included
    # 40 fields of Criteo-like text: reaches the per-field checks
    st.lists(st.text(_FIELD_CHARS.filter(lambda c: c != "\t"), max_size=24), min_size=40, max_size=40)
    .map(lambda fields: "\t".join(fields)),
))
def test_fuzz_parse_line_raises_only_malformed_line(line):
    try:
        dense, sparse, label = parse_line(line, 1000)
    except MalformedLine as e:
        assert e.reason in {"nul_byte", "field_count", "label", "integer_feature", "integer_range",
                            "categorical_feature"}
        return
    assert len(dense) == NUM_DENSE and len(sparse) == NUM_SPARSE and label in (0.0, 1.0)
    assert all(math.isfinite(x) and x >= 0 for x in dense) and all(0 <= s < 1000 for s in sparse)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["0", "1"]),
    st.lists(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)), min_size=NUM_DENSE, max_size=NUM_DENSE),
    st.lists(st.one_of(st.none(), st.integers(0, 2**32 - 1).map(lambda v: f"{v:08x}")),
             min_size=NUM_SPARSE, max_size=NUM_SPARSE),
)
def test_valid_lines_roundtrip(label, ints, cats):
    line = _line(label, ["" if x is None else str(x) for x in ints], ["" if c is None else c for c in cats])
    dense, sparse, parsed_label = parse_line(line, 997)
    assert parsed_label == float(label)
    assert dense == [0.0 if x is None or x <= 0 else math.log1p(x) for x in ints]
    assert [s == 0 for s in sparse] == [c is None for c in cats]
    # the same value in the same table always gets the same id
    assert parse_line(line.replace("\n", "\r\n"), 997)[1] == sparse


def _write(path, lines, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        f.write("".join(lines))
    return path


@pytest.mark.parametrize("kind", ["gzip", "bz2", "lzma"])
def test_compressed_files_are_read_whatever_their_suffix(tmp_path, kind):
    import importlib

    lines = [_line(str(i % 2)) for i in range(20)]
    plain = CriteoShard(_write(tmp_path / "plain.tsv", lines), 100, eval_fraction=0.0)
    packed = _write(tmp_path / "data.tsv", lines, importlib.import_module(kind).open)  # no .gz suffix
    assert packed.read_bytes()[:2] != plain.path.read_bytes()[:2]
    shard = CriteoShard(packed, 100, eval_fraction=0.0)
    assert len(shard) == 20 and torch.equal(shard.sparse, plain.sparse) and torch.equal(shard.dense, plain.dense)
    assert check_data_file(packed, 100).valid == 1


def test_bad_bytes_are_counted_not_fatal(tmp_path):
    path = tmp_path / "c.tsv"
    good = _line("1").encode()
    path.write_bytes(good + b"\xff\xfe" + good + good.replace(b"00000001", b"0000\x00001") + good)
    shard = CriteoShard(path, 100, eval_fraction=0.0)
    assert len(shard) == 2 and dict(shard.stats.malformed) == {"encoding": 1, "nul_byte": 1}


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: p, r"x: no such file"),
        (lambda p: p.mkdir() or p, r"x: is a directory, expected a Criteo TSV file"),
        (lambda p: p.write_bytes(b"") and p or p, r"x: the file is empty"),
        (lambda p: p.write_bytes(b"\n \n") and p or p, r"x: the file is empty"),
        (lambda p: p.write_text("a\tb\n" * 3) and p or p, r"x: none of the first 3 non-blank lines is a valid "
                                                          r"Criteo line \(malformed: \{'field_count': 3\}"),
        (lambda p: p.write_bytes(b"PK\x03\x04zip") and p or p, r"x: is zip-compressed, which is not supported"),
        (lambda p: p.write_bytes(b"\x1f\x8b\x08\x00broken") and p or p, r"x: cannot be read after line 0"),
    ],
)
def test_check_data_file_reasons(tmp_path, make, match):
    path = make(tmp_path / "x")
    with pytest.raises(DataError, match=match):
        check_data_file(path, 100)
    if path.is_file() and path.stat().st_size:
        with pytest.raises(DataError):
            CriteoShard(path, 100)


def test_truncated_gzip_is_a_data_error(tmp_path):
    import gzip

    path = _write(tmp_path / "c.gz", [_line("1")] * 2000, gzip.open)
    path.write_bytes(path.read_bytes()[:-200])  # cut the end: EOFError inside gzip
    assert check_data_file(path, 100).valid == 1  # the start is fine
    with pytest.raises(DataError, match=r"c.gz: cannot be read after line \d+: EOFError"):
        CriteoShard(path, 100)


def test_files_in_natural_order(tmp_path):
    for name in ("day_10", "day_2", "day_1", ".hidden"):
        (tmp_path / name).write_text(_line())
    assert [p.name for p in data_files(tmp_path)] == ["day_1", "day_2", "day_10"]
    with pytest.raises(DataError, match="the pattern matches no file"):
        data_files(tmp_path / "nothing_*.gz")


def test_hash_spreads_ids_over_each_table():
    values = np.arange(20000, dtype=np.uint64)[:, None].repeat(NUM_SPARSE, axis=1)
    ids = hash_ids(values, np.ones_like(values, dtype=bool), SIZES)
    for j, size in enumerate(SIZES):
        counts = np.bincount(ids[:, j], minlength=size)
        assert counts[0] == 0 and len(counts) == size
        assert counts[1:].min() > 0.5 * 20000 / (size - 1)  # near uniform
