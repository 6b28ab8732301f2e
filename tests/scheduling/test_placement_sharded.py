"""Checkpoints of the moved tables by shard (:mod:`scheduling.placement.sharded`): 2 servers write a 10^6-row table
(and a dynamic one) with ``torch.distributed.checkpoint``, each its own rows, while the trainer receives only small
reports; 1 and 3 servers then restore exactly the saved rows, optimizer state and dynamic map, each reading its
own rows."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch import nn

ROWS, DIM = 10**6, 16
_NAMES = itertools.count()


class Model(nn.Module):
    """A ``rows`` x ``dim`` table (EmbeddingBag; 10^6 x 16 here), a dynamic one (Embedding over raw ids), a linear
    layer."""

    def __init__(self, rows: int = ROWS, dim: int = DIM) -> None:
        super().__init__()
        self.big = nn.EmbeddingBag(rows, dim, mode="sum")
        self.dyn = nn.Embedding(8, dim)                     # dynamic: capacity 16
        self.top = nn.Linear(2 * dim, 1)

    def forward(self, a, ids):
        return self.top(torch.cat([self.big(a), self.dyn(ids)], dim=1)).squeeze(1)


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _counting(gm) -> list[int]:
    """Counts the tensor bytes of every answer ``gm``'s clients receive from now on (``[total]``)."""
    from scheduling.placement import client_names
    from scheduling.ps import get_client

    seen = [0]
    for name in client_names(gm):
        client = get_client(name)
        wait = client._wait

        def counted(fut, server, what, wait=wait):
            answer = wait(fut, server, what)
            seen[0] += _tensor_bytes(answer)
            return answer

        client._wait = counted
    return seen


def _on_servers(num_servers: int, body):
    import fxdist
    import scheduling
    from scheduling import placement
    from scheduling.ps import LocalCluster

    torch.manual_seed(0)
    with LocalCluster(num_servers=num_servers, timeout_s=120.0):
        to_servers = functools.partial(scheduling.parameter_servers, optimizer="rowwise_adagrad", lr=0.1,
                                       verbose=False, client=f"sharded{next(_NAMES)}", group_tables=False,
                                       dynamic={"dyn": {"capacity": 16, "min_count": 1}})
        gm = fxdist.optimize(Model(), passes=(to_servers,))
        try:
            return body(gm)
        finally:
            placement.close(gm)


def _same(a, b, where: str) -> None:
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, where


@pytest.mark.timeout(600)
def test_servers_write_their_shards_and_any_number_restore_them(tmp_path):
    from scheduling import placement
    from scheduling.placement import sharded
    from scheduling.placement.restore import table_checkpoint, table_layout

    folder = tmp_path / "tables"

    def save(gm):
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            a = torch.randint(0, ROWS, (64, 2), generator=gen)
            ids = torch.randint(0, 40, (64,), generator=gen) * (1 << 40) + 3   # 40 ids > capacity 16: evictions
            gm(a, ids).sum().backward()
        placement.flush(gm)
        received = _counting(gm)
        started = sharded.start_checkpoint(gm, folder)
        digest = sharded.finish_checkpoint(gm, folder)
        during = received[0]
        whole = table_checkpoint(gm)           # the old path, for comparison: every row passes through here
        return started, digest, during, received[0] - during, whole, table_layout(gm)

    started, saved_digest, during, gathered, saved, layout = _on_servers(2, save)
    assert sorted(layout["big"]["servers"]) == ["ps0", "ps1"]   # row-wise over both servers
    assert started["rows"] == ROWS + 16
    table_bytes = ROWS * (DIM + 1) * 4
    assert gathered >= table_bytes            # the gather receives every row and its Adagrad state...
    assert during < table_bytes // 1000       # ...the checkpoint by shard only small reports
    assert saved["big.momentum"].count_nonzero() > 0 and saved["dyn.dynamic"]["counters"]
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", *sorted(
        f"{ns}@ps{i}" for ns, i in (("sharded0_big", 0), ("sharded0_big", 1), ("sharded0_dyn", 0 if
                                     layout["dyn"]["servers"] == ["ps0"] else 1)))]

    for n in (1, 3):
        digest, restored = _on_servers(n, lambda gm: (sharded.load_checkpoint(gm, folder), table_checkpoint(gm)))
        assert digest == saved_digest, n
        _same(restored, saved, f"{n} servers")
    _same({k: v for k, v in sharded.read_tables(folder).items()}, saved, "read_tables")


def test_an_unfinished_checkpoint_is_refused(tmp_path):
    from scheduling.placement import sharded

    (tmp_path / "t").mkdir()
    assert not sharded.is_sharded_checkpoint(tmp_path / "t")
    with pytest.raises(FileNotFoundError, match="never finished"):
        sharded.load_checkpoint(None, tmp_path / "t")
