"""Synthetic Criteo-format data, the project's one generator: ``fxdist data synth --lines N --out DIR``, and the
job's data when it finds none (:func:`write_synthetic_criteo`).

Each line has Criteo Kaggle's 40 tab-separated fields (label, ``I1..I13``, ``C1..C26``; see
:mod:`recsys.criteo_format`), drawn so that the data behaves like the real logs where the job's costs depend on it:

- categorical feature ``j`` takes Zipf-distributed values (exponent ``zipf_a``, the heavy head real click
  logs have) over ``cardinality[j]`` distinct ids, Criteo Kaggle's per-feature counts by default
  (:data:`CRITEO_KAGGLE_CARDINALITIES`, capped at ``max_cardinality``), written as 8 hex digits;
- integer features are exponential counts with Criteo's missing-value rate (about 4 %, one in ten for some);
- the click label is drawn from a logistic model of a few categorical and dense features (each id of the
  first 8 categorical features has a fixed effect derived from a hash of the id), so AUC means something:
  a model that learns the effects reaches AUC well above 0.5, a constant scorer gets 0.5.

Lines are written in chunks (numpy draws, one Python ``join`` per line): 1M lines take well under a minute
here. The output is ``DIR/train_0.tsv`` ... (``--files``), each a plain TSV (or ``.gz`` with ``--gzip``),
the layout of Criteo's ``day_0 .. day_23``. :func:`write_synthetic_criteo` writes one plain file with small
vocabularies (:data:`SMALL_CARDINALITIES`), so that a few hundred lines already repeat ids a model can learn.

Source: Criteo Kaggle Display Advertising Challenge (field layout); the per-feature cardinalities of its 26
categorical features as used by the DLRM and torchrec Criteo examples.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from recsys.criteo_format import NUM_DENSE, NUM_SPARSE

__all__ = ["CRITEO_KAGGLE_CARDINALITIES", "SMALL_CARDINALITIES", "SynthSpec", "write_synthetic",
           "write_synthetic_criteo"]

CRITEO_KAGGLE_CARDINALITIES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
                               27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
"""Distinct values of ``C1..C26`` in Criteo Kaggle (45M lines)."""

_DENSE_MEANS = (3.5, 105.0, 26.9, 7.3, 18538.0, 116.1, 16.3, 12.5, 106.1, 0.6, 2.7, 1.0, 8.2)
"""Rough means of ``I1..I13`` in Criteo Kaggle (the scale of each count)."""
_DENSE_MISSING = (0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.77, 0.22)
"""Share of empty ``I1..I13`` fields in Criteo Kaggle."""
SMALL_CARDINALITIES = tuple(50 + 40 * j for j in range(NUM_SPARSE))
"""Distinct ids per feature of :func:`write_synthetic_criteo`: 50 to 1050."""


@dataclass(frozen=True)
class SynthSpec:
    """What :func:`write_synthetic` draws."""

    cardinalities: tuple[int, ...] = CRITEO_KAGGLE_CARDINALITIES
    """Distinct ids per categorical feature (26 of them)."""
    max_cardinality: int = 10_000_000
    """Cap on each feature's distinct ids."""
    zipf_a: float = 1.1
    """Zipf exponent of the categorical ids (rank ``k`` has probability ~ ``k**-a``)."""
    cat_missing: float = 0.04
    """Share of empty categorical fields."""
    dense_missing: tuple[float, ...] = _DENSE_MISSING
    """Share of empty fields of each of ``I1..I13`` (Criteo Kaggle's by default)."""
    base_ctr: float = 0.25
    """Click rate the labels are centred on (Criteo Kaggle's is about 0.26)."""
    seed: int = 0
    """Seed of every draw (the same spec and seed write the same files)."""
    effects: tuple[float, ...] = field(default=(1.2, 1.0, 0.9, 0.8, 0.8, 0.7, 0.6, 0.5))
    """Spread of the per-id label effects of the first categorical features."""


def _zipf_ids(rng: np.random.Generator, n: int, cardinality: int, a: float) -> np.ndarray:
    """``n`` ids in ``[0, cardinality)``, rank-Zipf: id ``k`` with probability about ``(k + 1) ** -a``
    (rejection-free: a Zipf draw beyond the cardinality wraps around, which keeps the head heavy)."""
    draws = rng.zipf(a, size=n) - 1
    return np.remainder(draws, cardinality)


def _hex_ids(feature: int, ids: np.ndarray) -> list[str]:
    """Distinct 8-hex-digit strings for ``ids`` of ``feature`` (a bijective multiplicative hash of 32 bits)."""
    mixed = (ids.astype(np.uint64) * np.uint64(2654435761) + np.uint64(feature * 40503)) & np.uint64(0xFFFFFFFF)
    return [f"{v:08x}" for v in mixed.tolist()]


def _effects(feature: int, ids: np.ndarray, spread: float) -> np.ndarray:
    """A fixed effect in ``[-spread, spread]`` per id of ``feature`` (a hash, so no table is stored)."""
    h = (ids.astype(np.uint64) * np.uint64(0x9E3779B1) + np.uint64(feature + 1) * np.uint64(0x85EBCA77)) \
        & np.uint64(0xFFFF)
    return (h.astype(np.float64) / 0xFFFF * 2 - 1) * spread


def _chunk(spec: SynthSpec, rng: np.random.Generator, n: int) -> list[str]:
    """``n`` Criteo lines (without newlines)."""
    cards = [min(c, spec.max_cardinality) for c in spec.cardinalities]
    dense = [rng.exponential(mean, size=n).astype(np.int64) for mean in _DENSE_MEANS]
    dense[1] = dense[1] - (rng.random(n) < 0.1).astype(np.int64) * (dense[1] + 1)  # I2 has -1s, as in Criteo
    ids = [_zipf_ids(rng, n, c, spec.zipf_a) for c in cards]
    logit = np.full(n, np.log(spec.base_ctr / (1 - spec.base_ctr)))
    for j, spread in enumerate(spec.effects):
        logit += _effects(j, ids[j], spread)
    logit += 0.4 * (np.log1p(np.maximum(dense[0], 0)) - np.log1p(_DENSE_MEANS[0]))
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64).tolist()
    int_cols = []
    for j, col in enumerate(dense):
        text = [str(v) for v in col.tolist()]
        for i in np.flatnonzero(rng.random(n) < spec.dense_missing[j]).tolist():
            text[i] = ""
        int_cols.append(text)
    cat_cols = []
    for j, col in enumerate(ids):
        text = _hex_ids(j, col)
        for i in np.flatnonzero(rng.random(n) < spec.cat_missing).tolist():
            text[i] = ""
        cat_cols.append(text)
    return ["\t".join(fields) for fields in zip(map(str, labels), *int_cols, *cat_cols)]


def write_synthetic(out: str | Path, lines: int, *, files: int = 1, gzip_output: bool = False,
                    spec: SynthSpec = SynthSpec(), chunk: int = 100_000) -> list[Path]:
    """Write ``lines`` synthetic Criteo lines into ``files`` files under ``out`` (see the module docstring).

    Returns:
        The files written, ``train_<i>.tsv`` (or ``.tsv.gz``).

    Raises:
        ValueError: ``lines`` < 1, ``files`` < 1, or a spec with other than 26 cardinalities.
    """
    if lines < 1 or files < 1:
        raise ValueError(f"write_synthetic: lines and files must be >= 1, got lines={lines}, files={files}")
    if len(spec.cardinalities) != NUM_SPARSE:
        raise ValueError(f"write_synthetic: need {NUM_SPARSE} cardinalities (C1..C26), got {len(spec.cardinalities)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed)
    paths = []
    per_file = [lines // files + (1 if i < lines % files else 0) for i in range(files)]
    for i, count in enumerate(per_file):
        path = out / (f"train_{i}.tsv.gz" if gzip_output else f"train_{i}.tsv")
        _write_file(path, count, spec, rng, gzip_output, chunk)
        paths.append(path)
    return paths


def _write_file(path: Path, count: int, spec: SynthSpec, rng: np.random.Generator, gzip_output: bool,
                chunk: int) -> None:
    opener = gzip.open(path, "wt", compresslevel=1) if gzip_output else path.open("w")
    with opener as f:
        for start in range(0, count, chunk):
            f.write("\n".join(_chunk(spec, rng, min(chunk, count - start))) + "\n")


def write_synthetic_criteo(path: str | Path, rows: int, *, seed: int = 0, missing_rate: float = 0.05) -> Path:
    """Write ``rows`` lines of Criteo-format TSV at ``path`` whose labels depend on the features (AUC > 0.5 is
    learnable): :func:`write_synthetic`'s draws over :data:`SMALL_CARDINALITIES` ids per feature, with about
    ``missing_rate`` of the feature values left empty, as in the real logs. The same arguments write the same
    file.
    """
    spec = SynthSpec(cardinalities=SMALL_CARDINALITIES, cat_missing=missing_rate,
                     dense_missing=(missing_rate,) * NUM_DENSE, seed=seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_file(path, rows, spec, np.random.default_rng(seed), False, 100_000)
    return path
