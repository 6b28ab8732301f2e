"""recsys.criteo_synth: Criteo-format files the job reads, with Zipf ids and labels a model can learn; the
job's small synthetic file."""

from __future__ import annotations

import collections
import math

import torch

from jobs.stats import auc
from recsys.criteo_format import parse_line
from recsys.criteo_shard import CriteoShard
from recsys.criteo_synth import SynthSpec, write_synthetic, write_synthetic_criteo


def test_files_parse_and_the_gzip_layout_reads(tmp_path):
    paths = write_synthetic(tmp_path, 3001, files=3, gzip_output=True, spec=SynthSpec(seed=4))
    assert [p.name for p in paths] == ["train_0.tsv.gz", "train_1.tsv.gz", "train_2.tsv.gz"]
    shards = [CriteoShard(p, 1000, eval_fraction=0) for p in paths]
    assert sum(len(s) for s in shards) == 3001 and all(s.stats.malformed_total == 0 for s in shards)
    assert write_synthetic(tmp_path / "again", 3001, files=3, gzip_output=True, spec=SynthSpec(seed=4))
    import gzip

    assert gzip.open(paths[1]).read() == gzip.open(tmp_path / "again" / "train_1.tsv.gz").read()


def test_ids_are_zipf_within_the_cap_and_labels_are_learnable(tmp_path):
    (path,) = write_synthetic(tmp_path, 40_000, spec=SynthSpec(seed=1, max_cardinality=5000))
    rows = [line.rstrip("\n").split("\t") for line in path.open()]
    assert all(parse_line("\t".join(r), 100) for r in rows[:2000])  # every line parses
    c3 = collections.Counter(r[1 + 13 + 2] for r in rows if r[1 + 13 + 2])
    assert len(c3) <= 5000
    top = c3.most_common(1)[0][1] / sum(c3.values())
    assert top > 20 / 5000  # the head is far above uniform
    labels = torch.tensor([float(r[0]) for r in rows])
    assert 0.15 < labels.mean() < 0.4
    # naive Bayes over the first categorical features, fitted on one half, scored on the other
    train, test = rows[: len(rows) // 2], rows[len(rows) // 2:]
    prior = sum(int(r[0]) for r in train) / len(train)
    scores = torch.zeros(len(test))
    for j in range(14, 14 + 8):
        clicks, seen = collections.Counter(), collections.Counter()
        for r in train:
            seen[r[j]] += 1
            clicks[r[j]] += int(r[0])
        for i, r in enumerate(test):
            p = (clicks[r[j]] + 10 * prior) / (seen[r[j]] + 10)
            scores[i] += math.log(p / (1 - p))
    assert auc(scores, torch.tensor([float(r[0]) for r in test])) > 0.62


def test_synthetic_data_is_criteo_format_and_learnable(tmp_path):
    path = write_synthetic_criteo(tmp_path / "s.tsv", 2000, seed=0)
    shard = CriteoShard(path, 1000, eval_fraction=0.0)
    assert shard.stats.malformed_total == 0 and len(shard) == 2000
    rate = shard.labels.mean().item()
    assert 0.1 < rate < 0.6
    # a label that depends on the features: the first categorical feature alone separates classes
    ids = shard.sparse[:, 0]
    means = {int(i): shard.labels[ids == i].mean().item() for i in ids.unique()}
    scores = torch.tensor([means[int(i)] for i in ids])
    assert auc(scores, shard.labels) > 0.6
