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


def _per_feature(client, parts):
    """The per-column reference: each feature's slice of its server's answer, in feature order."""
    by_server = dict(zip(client.servers_for(), parts))
    return torch.cat([by_server[s][:, col:col + dim] for f in client.feature_names for s, col, dim in client._slots[f]],
                     dim=1)


def _same_values_and_gradients_as_per_feature(client, parts, kt) -> torch.Tensor:
    """Assert the pooled ``kt`` equals the per-feature reference, and so do the gradients of ``parts`` (which come
    out contiguous, for the push); returns the reference."""
    ref = _per_feature(client, parts)
    assert torch.equal(kt.values(), ref)
    grad = torch.randn(ref.shape)
    got = torch.autograd.grad(kt.values(), parts, grad)
    assert all(torch.equal(a, b) for a, b in zip(got, torch.autograd.grad(ref, parts, grad)))
    assert all(g.is_contiguous() for g in got)
    return ref


def test_equal_dims_are_gathered_as_blocks_with_the_same_values_and_gradients():
    # features interleaved across the servers (a on 0, b on 1, c on 0), all of dim 2: gathered by 2-wide blocks
    client = _client({"a": [(0, 0, 2)], "b": [(1, 0, 2)], "c": [(0, 2, 2)]}, widths=[4, 2])
    parts = [torch.randn(3, 4, requires_grad=True), torch.randn(3, 2, requires_grad=True)]
    kt = pool(client, None, parts)
    assert client._gather.block == 2 and kt.length_per_key() == [2, 2, 2]
    assert client._gather.positions is not None          # each answer's gradient: one index_select
    assert client._gather.interleave is None             # 2 blocks on server 0, 1 on server 1: not dealt round-robin
    ref = _same_values_and_gradients_as_per_feature(client, parts, kt)
    with torch.no_grad():
        assert torch.equal(pool(client, None, parts).values(), ref)


def test_tables_dealt_round_robin_are_stacked_with_the_same_values_and_gradients():
    # 3 servers, 6 features of dim 2 dealt round-robin, server 1 first: output blocks 0, 3 from server 1, 1, 4 from
    # server 0, 2, 5 from server 2
    slots = {"a": [(1, 0, 2)], "b": [(0, 0, 2)], "c": [(2, 0, 2)], "d": [(1, 2, 2)], "e": [(0, 2, 2)], "f": [(2, 2, 2)]}
    client = _client(slots, widths=[4, 4, 4])
    parts = [torch.randn(3, 4, requires_grad=True) for _ in range(3)]
    kt = pool(client, None, parts)
    assert client._gather.interleave == [1, 0, 2] and kt.length_per_key() == [2] * 6
    _same_values_and_gradients_as_per_feature(client, parts, kt)
    assert pool(client, None, [torch.ones(0, 4)] * 3).values().shape == (0, 12)


def test_an_answer_block_that_is_no_feature_gets_a_zero_gradient():
    # server 0 answers 3 blocks of 2 columns, only 2 of them features: gathered by blocks, backward index_add
    client = _client({"a": [(0, 0, 2)], "b": [(1, 0, 2)], "c": [(0, 4, 2)]}, widths=[6, 2])
    parts = [torch.randn(3, 6, requires_grad=True), torch.randn(3, 2, requires_grad=True)]
    kt = pool(client, None, parts)
    assert client._gather.block == 2 and client._gather.positions is None
    ref = _per_feature(client, parts)
    assert torch.equal(kt.values(), ref)
    grad = torch.randn(3, 6)
    got = torch.autograd.grad(kt.values(), parts, grad)
    assert torch.equal(got[0][:, 2:4], torch.zeros(3, 2))
    assert all(torch.equal(a, b) for a, b in zip(got, torch.autograd.grad(ref, parts, grad)))


def test_mixed_dims_are_gathered_by_column():
    client = _client({"a": [(0, 0, 2)], "b": [(1, 0, 3)], "c": [(0, 2, 1)]}, widths=[3, 3])
    parts = [torch.randn(2, 3), torch.randn(2, 3)]
    kt = pool(client, None, parts)
    assert client._gather.block == 0 and torch.equal(kt.values(), _per_feature(client, parts))


def test_an_empty_batch_pools_to_no_rows():
    client = _client({"a": [(0, 0, 2)], "b": [(1, 0, 2)]}, widths=[2, 2])
    kt = pool(client, None, [torch.ones(0, 2), torch.ones(0, 2)])
    assert kt.values().shape == (0, 4)
