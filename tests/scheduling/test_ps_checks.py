"""A moved embedding module refuses what the local module refuses, with the same error, before sending anything.

The bug this guards against: after ``parameter_servers`` float ids were silently truncated and a weighted EBC fed a KJT without
weights ran unweighted. Each case runs the local model and the moved one on the same bad input and compares
the exception class and message; the servers' tables must be unchanged afterwards. ``padding_idx`` and an
unweighted collection given weights must give the local module's results.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch import nn

_names = itertools.count()


class Tables(nn.Module):
    """An ``nn.Embedding`` (``padding_idx=0``), a mean bag and a sum bag (``padding_idx=1``), and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.item = nn.Embedding(12, 4, padding_idx=0)
        self.user = nn.EmbeddingBag(20, 4, mode="mean")
        self.tags = nn.EmbeddingBag(15, 4, mode="sum", padding_idx=1)
        self.head = nn.Linear(12, 1)

    def forward(self, items, users, tags, user_offsets=None, tag_weights=None):
        return self.head(torch.cat([self.item(items), self.user(users, user_offsets),
                                    self.tags(tags, per_sample_weights=tag_weights)], dim=1)).squeeze(1)


def _ebc(weighted: bool) -> nn.Module:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    class Collection(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=[
                EmbeddingBagConfig(name="t_a", embedding_dim=4, num_embeddings=10, feature_names=["a"]),
                EmbeddingBagConfig(name="t_b", embedding_dim=4, num_embeddings=30, feature_names=["b"])],
                is_weighted=weighted)

        def forward(self, kjt):
            return self.ebc(kjt).values()

    return Collection()


def _kjt(values, weights=None, lengths=(1, 2, 1, 1)):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=["a", "b"], values=values, lengths=torch.tensor(lengths), weights=weights)


@pytest.fixture(scope="module")
def cluster():
    from scheduling.ps import LocalCluster

    with LocalCluster(num_servers=1) as c:
        yield c


def _moved(make):
    import fxdist
    import scheduling

    torch.manual_seed(0)
    local = make()
    torch.manual_seed(0)
    to_servers = functools.partial(scheduling.parameter_servers, optimizer="sgd", lr=0.1, verbose=False,
                                   client=f"checks{next(_names)}")
    return local, fxdist.optimize(make(), passes=(to_servers,))


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the point is to compare any exception
        return type(e), str(e)
    return None


GOOD = dict(items=torch.tensor([0, 3, 11]), users=torch.tensor([[1, 2], [3, 19], [0, 0]]),
            tags=torch.tensor([[1, 2, 3], [4, 1, 1], [14, 0, 2]]))

BAD = {
    "float ids (Embedding)": dict(GOOD, items=torch.tensor([0.0, 3.0, 1.5])),
    "id out of range (Embedding)": dict(GOOD, items=torch.tensor([0, 12, 1])),
    "negative id (Embedding)": dict(GOOD, items=torch.tensor([0, -1, 1])),
    "int16 ids (EmbeddingBag)": dict(GOOD, users=GOOD["users"].to(torch.int16)),
    "float ids (EmbeddingBag)": dict(GOOD, users=GOOD["users"].float()),
    "id out of range (EmbeddingBag)": dict(GOOD, users=torch.tensor([[1, 2], [3, 20], [0, 0]])),
    "2-D input with offsets": dict(GOOD, user_offsets=torch.tensor([0, 1, 2])),
    "1-D input, offsets not from 0": dict(GOOD, users=torch.tensor([1, 2, 3, 4]), user_offsets=torch.tensor([1, 2, 3])),
    "per_sample_weights, wrong shape": dict(GOOD, tag_weights=torch.ones(3, 2)),
}


@pytest.mark.parametrize("case", list(BAD))
def test_embedding_modules_raise_the_local_error(cluster, case):
    from scheduling import placement

    local, gm = _moved(Tables)
    try:
        before = placement.table_state_dict(gm)
        want = _error(lambda: local(**BAD[case]))
        assert want is not None, "the case must make the local module raise"
        assert _error(lambda: gm(**BAD[case])) == want
        after = placement.table_state_dict(gm)
        assert all(torch.equal(before[k], after[k]) for k in before)      # nothing reached the servers
        torch.testing.assert_close(gm(**GOOD), local(**GOOD))              # and the model still works
    finally:
        placement.close(gm)


def test_per_sample_weights_with_mean_is_refused_as_locally(cluster):
    from scheduling import placement

    def make():
        m = Tables()
        m.tags.mode = "mean"
        return m

    local, gm = _moved(make)
    try:
        args = dict(GOOD, tag_weights=torch.ones(3, 3))
        want = _error(lambda: local(**args))
        assert want is not None and want[0] is NotImplementedError
        assert _error(lambda: gm(**args)) == want
    finally:
        placement.close(gm)


def test_int32_ids_padding_idx_and_training_match_the_local_module(cluster):
    from scheduling import placement

    local, gm = _moved(Tables)
    opt = torch.optim.SGD(local.parameters(), lr=0.1)
    dense = torch.optim.SGD(gm.parameters(), lr=0.1)
    try:
        for step in range(3):
            args = dict(GOOD, users=GOOD["users"].int(), tag_weights=torch.rand(3, 3, generator=torch.Generator().manual_seed(step)))
            opt.zero_grad()
            dense.zero_grad()
            want, got = local(**args), gm(**args)
            torch.testing.assert_close(got, want)
            want.sum().backward()
            got.sum().backward()
            opt.step()
            dense.step()
        placement.flush(gm)
        tables = placement.table_state_dict(gm)
        assert torch.equal(tables["item.weight"][0], torch.zeros(4))       # the padding row got no gradient
        for key in ("item.weight", "user.weight", "tags.weight"):
            torch.testing.assert_close(tables[key], local.state_dict()[key], rtol=1e-6, atol=1e-6)
    finally:
        placement.close(gm)


EBC_BAD = {
    "weighted collection, no weights": (True, lambda: _kjt(torch.tensor([1, 2, 3, 4, 5]))),
    "id out of range": (False, lambda: _kjt(torch.tensor([1, 2, 3, 30, 5]))),
    "negative id": (True, lambda: _kjt(torch.tensor([-1, 2, 3, 4, 5]), torch.ones(5))),
    "float ids": (False, lambda: _kjt(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))),
}


@pytest.mark.parametrize("case", list(EBC_BAD))
def test_embedding_bag_collection_raises_the_local_error(cluster, case):
    from scheduling import placement

    weighted, batch = EBC_BAD[case]
    local, gm = _moved(functools.partial(_ebc, weighted))
    try:
        before = placement.table_state_dict(gm)
        want = _error(lambda: local(batch()))
        assert want is not None, "the case must make the local collection raise"
        assert _error(lambda: gm(batch())) == want
        after = placement.table_state_dict(gm)
        assert all(torch.equal(before[k], after[k]) for k in before)
    finally:
        placement.close(gm)


@pytest.mark.parametrize("weighted", [False, True])
def test_collection_weights_rule_matches_the_local_collection(cluster, weighted):
    """A weighted collection uses the weights; an unweighted one ignores weights it is given."""
    from scheduling import placement

    local, gm = _moved(functools.partial(_ebc, weighted))
    try:
        kjt = _kjt(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0.5, 2.0, 1.0, 3.0, 0.25]))
        torch.testing.assert_close(gm(kjt), local(kjt))
    finally:
        placement.close(gm)


def _ec() -> nn.Module:
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    class Sequences(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ec = EmbeddingCollection(tables=[
                EmbeddingConfig(name="t_a", embedding_dim=4, num_embeddings=10, feature_names=["a"]),
                EmbeddingConfig(name="t_b", embedding_dim=4, num_embeddings=30, feature_names=["b"])])

        def forward(self, kjt):
            out = self.ec(kjt)
            return torch.cat([out["a"].values(), out["b"].values()])

    return Sequences()


@pytest.mark.parametrize("values", [torch.tensor([1, 2, 3, 30, 5]), torch.tensor([1, 2, -1, 4, 5]),
                                    torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])])
def test_embedding_collection_raises_the_local_error(cluster, values):
    from scheduling import placement

    local, gm = _moved(_ec)
    try:
        want = _error(lambda: local(_kjt(values)))
        assert want is not None, "the case must make the local collection raise"
        assert _error(lambda: gm(_kjt(values))) == want
        good = _kjt(torch.tensor([1, 2, 3, 4, 5]))
        torch.testing.assert_close(gm(good), local(good))
    finally:
        placement.close(gm)


def test_check_kjt_bounds_each_key_by_its_own_table_and_skips_dynamic_tables():
    """The batch is tested in one vectorized pass; each key against its own table's rows."""
    from torchrec import KeyedJaggedTensor

    from scheduling.ps.checks import check_kjt
    from scheduling.ps.shard_plan import TableSpec

    tables = [TableSpec("small", 5, 4, ("a",)), TableSpec("big", 50, 4, ("b",)),
              TableSpec("raw", 10, 4, ("c",), dynamic={"capacity": 8})]

    def kjt(a: list[int], b: list[int], c: list[int]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(keys=["a", "b", "c"], values=torch.tensor(a + b + c),
                                 lengths=torch.tensor([len(a), 0, len(b), 0, len(c), 0]))

    check_kjt(kjt([4, 0], [49], [10 ** 12, -3]), tables, False)        # in range; raw ids unchecked
    check_kjt(kjt([0], [5, 49], []), tables, False)                    # 5 is a row of "big"
    with pytest.raises(RuntimeError, match=r"takes value 5 which is not in the valid range \[0, 5\)"):
        check_kjt(kjt([5], [5], []), tables, False)                      # 5 is outside "small"
    with pytest.raises(RuntimeError, match=r"takes value 50 which is not in the valid range \[0, 50\)"):
        check_kjt(kjt([0], [50], []), tables, False)


def test_check_kjt_bounds_cached_per_layout_follow_each_collections_tables():
    """The per-bag bounds are cached per (tables, keys, bags per key): a second collection with the same keys but
    other rows, and another batch size, get their own."""
    from torchrec import KeyedJaggedTensor

    from scheduling.ps.checks import check_kjt
    from scheduling.ps.shard_plan import TableSpec

    small, big = [TableSpec("t", 5, 4, ("a", "b"))], [TableSpec("t", 50, 4, ("a", "b"))]

    def kjt(ids: list[int], bags: int) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor(ids),
                                 lengths=torch.tensor([1] * len(ids) + [0] * (2 * bags - len(ids))))

    for _ in range(2):   # the second round reads the cache
        check_kjt(kjt([4, 4], 1), small, False)
        check_kjt(kjt([49, 7], 1), big, False)
        with pytest.raises(RuntimeError, match=r"takes value 7 which is not in the valid range \[0, 5\)"):
            check_kjt(kjt([4, 7], 1), small, False)
        with pytest.raises(RuntimeError):                    # torch's message for several bags differs
            check_kjt(kjt([0, 1, 2, 7], 2), small, False)    # 2 bags per key: "b"'s second bag holds 7
        check_kjt(kjt([0, 1, 2, 3], 2), small, False)
