"""recsys.criteo: the Criteo tables, torchrec's DLRM built for them, and Criteo batches as KeyedJaggedTensors."""

from __future__ import annotations

import pytest
import torch

from recsys.criteo import CRITEO_SPARSE, criteo_batches, criteo_dlrm, criteo_kjt, criteo_tables
from recsys.criteo_format import parse_line
from recsys.criteo_shard import CriteoShard
from recsys.criteo_synth import write_synthetic_criteo


def test_tables_one_per_feature_with_their_sizes():
    tables = criteo_tables([3, 4, 5], dim=8, num_tables=3)
    assert [(t.name, t.num_embeddings, t.embedding_dim, t.feature_names) for t in tables] == [
        ("t_C1", 3, 8, ["C1"]), ("t_C2", 4, 8, ["C2"]), ("t_C3", 5, 8, ["C3"])]
    with pytest.raises(ValueError, match=r"expected 3 positive table sizes \(one per feature\), got \[3, 0, 5\]"):
        criteo_tables([3, 0, 5], num_tables=3)


def test_kjt_is_key_major_with_one_id_per_bag():
    ids = torch.arange(2 * CRITEO_SPARSE).reshape(2, CRITEO_SPARSE)
    kjt = criteo_kjt(ids)
    assert kjt.keys()[:2] == ["C1", "C2"] and len(kjt.keys()) == CRITEO_SPARSE
    assert kjt["C2"].values().tolist() == [1, CRITEO_SPARSE + 1]
    assert kjt.lengths().tolist() == [1] * ids.numel()
    with pytest.raises(ValueError, match=r"expected ids of shape \(B, 26\), got \(2, 3\)"):
        criteo_kjt(torch.zeros(2, 3, dtype=torch.long))


def test_dlrm_is_seeded_apart_from_its_tables_device():
    a = criteo_dlrm(10, 4, dense_layers=(8, 4), seed=3)
    b = criteo_dlrm(10, 4, dense_layers=(8, 4), seed=3, tables_device="meta")
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        if "embedding_bags" not in name:
            assert torch.equal(p, q), name
    dense, ids = torch.rand(2, 13), torch.randint(0, 10, (2, CRITEO_SPARSE))
    assert a(dense, criteo_kjt(ids)).shape == (2, 1)
    with pytest.raises(ValueError, match="dense_layers must end at the embedding dim 4"):
        criteo_dlrm(10, 4, dense_layers=(8, 3))


def test_batches_from_the_criteo_sample(criteo_path):
    dense, kjt, labels = next(criteo_batches(criteo_path, 16, num_embeddings=50))
    assert dense.shape == (16, 13) and labels.shape == (16,) and len(kjt.keys()) == CRITEO_SPARSE
    assert int(kjt.values().max()) < 50 and bool((dense >= 0).all())


def test_a_short_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.tsv"
    path.write_text("1\t" + "\t".join(["0"] * 39) + "\n0\t1\t2\n")
    with pytest.raises(ValueError, match=r"bad\.tsv:2: expected 40 tab-separated columns"):
        list(criteo_batches(path, 1))


def _same_ids_in_every_reader(path, size: int, rows: int, batch: int) -> None:
    """criteo_batches, quant's load_criteo and the job's readers (in memory, vectorised: CriteoShard; one line at
    a time: parse_line) give the same rows and ids for the same lines: one parser, one hash."""
    from quant.models.dlrm import load_criteo

    shard = CriteoShard(path, size, eval_fraction=0.0, max_rows=rows)
    text = [line for line in path.read_text().splitlines() if line.strip()][:rows]
    assert shard.sparse.tolist() == [parse_line(line, size)[1] for line in text]
    assert bool((shard.sparse == 0).any()) and bool((shard.sparse > 0).all(dim=1).any())  # missing and present ids
    dense, sparse, labels = load_criteo(path, table_size=size)
    assert torch.equal(sparse[:rows], shard.sparse) and torch.equal(dense[:rows], shard.dense)
    assert torch.equal(labels[:rows], shard.labels)
    batches = list(criteo_batches(path, batch, num_embeddings=size, limit=rows))
    assert len(batches) == rows // batch
    for k, (d, kjt, y) in enumerate(batches):
        ids = shard.sparse[k * batch:(k + 1) * batch]
        for j, key in enumerate(kjt.keys()):  # an empty bag where the job's id is 0 ("missing")
            assert kjt[key].values().tolist() == ids[:, j][ids[:, j] > 0].tolist()
            assert kjt[key].lengths().tolist() == (ids[:, j] > 0).int().tolist()
        assert torch.equal(d, shard.dense[k * batch:(k + 1) * batch])
        assert torch.equal(y, shard.labels[k * batch:(k + 1) * batch])


def test_every_reader_gives_the_same_ids(tmp_path):
    path = write_synthetic_criteo(tmp_path / "c.tsv", 300, seed=4, missing_rate=0.1)
    _same_ids_in_every_reader(path, 97, 300, 50)


def test_every_reader_gives_the_same_ids_on_the_criteo_sample(criteo_path):
    _same_ids_in_every_reader(criteo_path, 500, 1000, 100)
