"""Criteo click logs: parsing, hashing, sharding across trainers, and a synthetic generator.

A Criteo (Kaggle DAC) line is 40 tab-separated fields: the click label (0/1), 13 integer features
``I1..I13`` (counts, may be empty or negative) and 26 categorical features ``C1..C26`` (8 hex digits,
may be empty). Each line becomes

- ``dense``: 13 floats, ``log(1 + max(x, 0))``, empty -> 0;
- ``sparse``: 26 ids, feature ``j`` hashed into ``[1, table_size)`` with CRC-32 (stable across
  processes and runs, unlike Python's ``hash``); empty -> id 0 ("missing");
- ``label``: 0.0 or 1.0.

Lines that do not parse (wrong field count, a label other than 0/1, a non-integer ``I`` field) are
counted by reason and skipped; they never stop a job.

Shapes: a :class:`Batch` holds ``dense (B, 13) float32``, ``sparse (B, 26) int64``, ``labels (B,) float32``.

Split and shards: with ``eval_fraction = 1/k``, every k-th valid line (index ``k-1, 2k-1, ...``) is held
out for evaluation; the remaining training lines are dealt round-robin to ``world_size`` trainers.

Source: Criteo Kaggle Display Advertising Challenge format; DLRM (Naumov et al. 2019) preprocessing
(log transform of counts, hashed categorical ids).
"""

from __future__ import annotations

import math
import random
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

__all__ = [
    "NUM_DENSE",
    "NUM_SPARSE",
    "Batch",
    "ParseStats",
    "parse_line",
    "CriteoShard",
    "default_criteo_path",
    "resolve_data_path",
    "write_synthetic_criteo",
]

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE


class Batch(NamedTuple):
    dense: torch.Tensor
    """(B, 13) float32, log-transformed integer features."""
    sparse: torch.Tensor
    """(B, 26) int64, hashed categorical ids; 0 = missing."""
    labels: torch.Tensor
    """(B,) float32 click labels."""


class MalformedLine(ValueError):
    """A Criteo line that cannot be parsed; ``reason`` is a short key used for counting."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class ParseStats:
    """What a reader saw: valid lines and malformed lines by reason."""

    valid: int = 0
    malformed: Counter = field(default_factory=Counter)
    """reason -> count, e.g. {"field_count": 2, "label": 1}."""
    examples: list[str] = field(default_factory=list)
    """Up to 5 "line N: reason: detail" strings, for the report."""

    @property
    def malformed_total(self) -> int:
        return sum(self.malformed.values())

    def record(self, lineno: int, error: MalformedLine) -> None:
        self.malformed[error.reason] += 1
        if len(self.examples) < 5:
            self.examples.append(f"line {lineno}: {error}")

    def as_dict(self) -> dict:
        return {"valid": self.valid, "malformed": dict(self.malformed), "examples": list(self.examples)}


def _hash_id(table: int, value: str, table_size: int) -> int:
    if not value:
        return 0
    return 1 + zlib.crc32(f"{table}:{value}".encode()) % (table_size - 1)


def parse_line(line: str, table_size: int) -> tuple[list[float], list[int], float]:
    """Parse one Criteo TSV line into (13 dense floats, 26 ids, label).

    Raises:
        MalformedLine: with ``reason`` one of "field_count", "label", "integer_feature".
    """
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != NUM_FIELDS:
        raise MalformedLine("field_count", f"expected {NUM_FIELDS} tab-separated fields, got {len(fields)}")
    if fields[0] not in ("0", "1"):
        raise MalformedLine("label", f"label must be 0 or 1, got {fields[0][:20]!r}")
    dense = []
    for j, raw in enumerate(fields[1 : 1 + NUM_DENSE]):
        if not raw:
            dense.append(0.0)
            continue
        try:
            x = int(raw)
        except ValueError:
            raise MalformedLine("integer_feature", f"I{j + 1} is not an integer: {raw[:20]!r}") from None
        dense.append(math.log1p(x) if x > 0 else 0.0)
    sparse = [_hash_id(j, raw, table_size) for j, raw in enumerate(fields[1 + NUM_DENSE :])]
    return dense, sparse, float(fields[0])


class CriteoShard:
    """One trainer's share of a Criteo file, parsed once into memory, served as endless batches.

    Args:
        path: The Criteo TSV file.
        table_size: Hash buckets per categorical feature.
        rank: This trainer's index in ``[0, world_size)``.
        world_size: Number of trainers sharing the training lines.
        eval_fraction: Fraction of lines held out (see module docstring); ``rank`` and ``world_size``
            do not apply to the held-out lines.
        split: "train" (this rank's training lines) or "eval" (all held-out lines).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: bad ``rank``/``world_size``/``split``, or the shard has no valid line.
    """

    def __init__(
        self,
        path: str | Path,
        table_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        eval_fraction: float = 0.1,
        split: str = "train",
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"CriteoShard: rank {rank} is not in [0, world_size={world_size})")
        if split not in ("train", "eval"):
            raise ValueError(f"CriteoShard: split must be 'train' or 'eval', got {split!r}")
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"Criteo data not found: {self.path}")
        self.stats = ParseStats()
        every = round(1 / eval_fraction) if eval_fraction > 0 else 0
        dense, sparse, labels = [], [], []
        valid = 0
        with self.path.open(encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    d, s, y = parse_line(line, table_size)
                except MalformedLine as e:
                    self.stats.record(lineno, e)
                    continue
                held_out = every > 0 and valid % every == every - 1
                train_index = valid - (valid // every if every else 0)
                valid += 1
                if split == "eval" and not held_out:
                    continue
                if split == "train" and (held_out or train_index % world_size != rank):
                    continue
                dense.append(d)
                sparse.append(s)
                labels.append(y)
        self.stats.valid = valid
        if not labels:
            raise ValueError(
                f"CriteoShard: {self.path} has no valid {split} line for rank {rank} of {world_size} "
                f"({valid} valid, {self.stats.malformed_total} malformed)"
            )
        self.dense = torch.tensor(dense, dtype=torch.float32)
        self.sparse = torch.tensor(sparse, dtype=torch.int64)
        self.labels = torch.tensor(labels, dtype=torch.float32)

    def __len__(self) -> int:
        return self.labels.shape[0]

    def batches(self, batch_size: int, *, start: int = 0) -> Iterator[Batch]:
        """Endless batches of ``batch_size`` consecutive rows, wrapping around the shard.

        Args:
            batch_size: B.
            start: Index of the first batch (so a restarted trainer resumes where it stopped).
        """
        n = len(self)
        offset = (start * batch_size) % n
        while True:
            idx = (torch.arange(batch_size) + offset) % n
            offset = (offset + batch_size) % n
            yield Batch(self.dense[idx], self.sparse[idx], self.labels[idx])

    def all_batches(self, batch_size: int) -> Iterator[Batch]:
        """Every row once, in batches of at most ``batch_size`` (the last one may be smaller)."""
        for i in range(0, len(self), batch_size):
            yield Batch(self.dense[i : i + batch_size], self.sparse[i : i + batch_size], self.labels[i : i + batch_size])


def default_criteo_path() -> Path:
    """``<repo>/../shared/data/criteo/train_examples.txt`` (it may be absent outside CI)."""
    return Path(__file__).resolve().parents[1].parent / "shared" / "data" / "criteo" / "train_examples.txt"


def resolve_data_path(configured: str, run_dir: Path, synthetic_rows: int, *, seed: int = 0) -> tuple[Path, str]:
    """Find the job's data: the configured path, else the shared Criteo sample, else synthetic data.

    Returns:
        (path, note): ``note`` says where the data came from, for the log and the report.

    Raises:
        FileNotFoundError: ``configured`` is set but does not exist.
    """
    if configured:
        path = Path(configured).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"[data] path = {configured!r}: no such file")
        return path, f"Criteo data from {path}"
    shared = default_criteo_path()
    if shared.is_file():
        return shared, f"Criteo sample from {shared}"
    path = run_dir / "synthetic_criteo.tsv"
    write_synthetic_criteo(path, synthetic_rows, seed=seed)
    return path, (
        f"no Criteo data found (looked for {shared}; set [data] path to use your own); "
        f"generated {synthetic_rows} rows of synthetic Criteo-format data at {path}"
    )


def write_synthetic_criteo(path: str | Path, rows: int, *, seed: int = 0, missing_rate: float = 0.05) -> Path:
    """Write ``rows`` lines of Criteo-format TSV whose labels depend on the features (AUC > 0.5 is learnable).

    Integer features are geometric counts; categorical values are Zipf-like draws from per-feature
    vocabularies of 8-hex-digit ids; the click probability is a logistic function of a few features.
    About ``missing_rate`` of the feature values are left empty, as in the real logs.
    """
    rng = random.Random(seed)
    vocab = [[f"{rng.getrandbits(32):08x}" for _ in range(50 + 40 * j)] for j in range(NUM_SPARSE)]
    effect = [[rng.gauss(0.0, 0.8) for _ in v] for v in vocab]
    dense_w = [rng.gauss(0.0, 0.4) for _ in range(NUM_DENSE)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(rows):
            ints = [int(rng.expovariate(1 / (2 + 10 * j))) for j in range(NUM_DENSE)]
            cats = [min(int(rng.paretovariate(1.2)) - 1, len(v) - 1) for v in vocab]
            logit = -1.0 + sum(w * (math.log1p(x) - math.log1p(2 + 10 * j))
                               for j, (w, x) in enumerate(zip(dense_w, ints))) / 2
            logit += sum(effect[j][c] for j, c in enumerate(cats[:6]))
            label = 1 if rng.random() < 1 / (1 + math.exp(-logit)) else 0
            int_fields = ["" if rng.random() < missing_rate else str(x) for x in ints]
            cat_fields = ["" if rng.random() < missing_rate else vocab[j][c] for j, c in enumerate(cats)]
            f.write("\t".join([str(label), *int_fields, *cat_fields]) + "\n")
    return path
