"""scheduling.ps.pooling: per-server answers into a KeyedTensor, whole features (gather) and row-wise parts."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from scheduling.ps.pooling import pool


def _client(slots, widths, pooling="sum"):
    table = SimpleNamespace(feature_names=list(slots), pooling=pooling)
    servers = sorted({s for parts in slots.values() for s, _, _ in parts})
    return SimpleNamespace(tables=[table], feature_names=list(slots), _slots=slots, _gather=None, widths=widths,
                           servers_for=lambda: servers)


def test_whole_features_are_gathered_from_their_servers():
    client = _client({"a": [(0, 0, 2)], "b": [(1, 0, 3)]}, widths=[2, 3])
    parts = [torch.ones(4, 2), torch.full((4, 3), 2.0)]
    kt = pool(client, None, parts)
    assert kt.keys() == ["a", "b"] and kt.values().shape == (4, 5)
    assert torch.equal(kt.values()[:, 2:], torch.full((4, 3), 2.0)) and client._gather is not False


def test_row_wise_parts_are_added():
    client = _client({"a": [(0, 0, 2), (1, 0, 2)]}, widths=[2, 2])
    kt = pool(client, None, [torch.ones(3, 2), torch.full((3, 2), 2.0)])
    assert client._gather is False and torch.equal(kt.values(), torch.full((3, 2), 3.0))
