"""recsys.criteo: the Criteo tables, torchrec's DLRM built for them, and Criteo batches as KeyedJaggedTensors."""

from __future__ import annotations

import pytest
import torch

from recsys.criteo import CRITEO_SPARSE, criteo_batches, criteo_dlrm, criteo_kjt, criteo_tables


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
