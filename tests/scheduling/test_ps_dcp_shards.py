"""Checkpoints by shard with ``torch.distributed.checkpoint`` (:mod:`scheduling.ps.dcp_shards`): chunks written by
separate "servers" without a process group, merged, read back under another split; the metadata read without
running pickled code; the layout-free fingerprint; a server's requests through the socket transport only under its
save root."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from scheduling.ps import dcp_shards as d


def _save_split(folder, w, m, cuts):
    """Write rows of ``w`` / ``m`` split at ``cuts``, one sub-folder per piece (a server each)."""
    edges = [0, *cuts, w.shape[0]]
    for i, (a, b) in enumerate(zip(edges, edges[1:])):
        d.write_shards({"t.weight": (w[a:b].clone(), a, w.shape[0]), "t.momentum": (m[a:b].clone(), a, w.shape[0])},
                       d.subfolder(folder, "ns/x", f"ps{i}"))
    return d.merge_metadata(folder)


def test_chunks_of_two_writers_read_back_under_any_split(tmp_path):
    w, m = torch.randn(100, 8), torch.rand(100)
    meta = _save_split(tmp_path, w, m, [37])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".metadata", "ns_x@ps0", "ns_x@ps1"]
    assert [tuple(c.offsets) for c in meta.state_dict_metadata["t.weight"].chunks] == [(0, 0), (37, 0)]
    for start, rows in ((0, 100), (0, 20), (30, 40), (90, 10)):   # within one chunk, across both, the tail
        tw, tm = torch.zeros(rows, 8), torch.zeros(rows)
        d.read_rows(tmp_path, {"t.weight": (tw, start), "t.momentum": (tm, start)})
        assert torch.equal(tw, w[start:start + rows]) and torch.equal(tm, m[start:start + rows])
    whole = {"t.weight": torch.zeros(100, 8)}      # DCP's own reader and default planner read the merged folder
    dcp.load(whole, storage_reader=d.SafeReader(str(tmp_path)), no_dist=True)
    assert torch.equal(whole["t.weight"], w)


def test_reading_checks_keys_and_shapes(tmp_path):
    _save_split(tmp_path, torch.randn(10, 4), torch.rand(10), [5])
    with pytest.raises(KeyError, match="no 'u.weight'"):
        d.read_rows(tmp_path, {"u.weight": (torch.zeros(2, 4), 0)})
    with pytest.raises(ValueError, match="do not fit the saved"):
        d.read_rows(tmp_path, {"t.weight": (torch.zeros(4, 4), 8)})
    with pytest.raises(ValueError, match="do not fit the saved"):
        d.read_rows(tmp_path, {"t.weight": (torch.zeros(4, 3), 0)})


def test_merge_refuses_rows_held_twice_or_by_no_server(tmp_path):
    w = torch.randn(10, 4)
    d.write_shards({"t.weight": (w[:6], 0, 10)}, tmp_path / "a" / "s0")
    d.write_shards({"t.weight": (w[4:], 4, 10)}, tmp_path / "a" / "s1")
    with pytest.raises(ValueError, match="held twice or by no server"):
        d.merge_metadata(tmp_path / "a")
    d.write_shards({"t.weight": (w[:6], 0, 10)}, tmp_path / "b" / "s0")
    with pytest.raises(ValueError, match=r"rows \[6, 10\) are on no server"):
        d.merge_metadata(tmp_path / "b")
    with pytest.raises(ValueError, match="no server wrote"):
        d.merge_metadata(tmp_path / "c")
    assert not (tmp_path / "a" / d.METADATA).exists()


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_metadata_that_names_other_globals_is_refused(tmp_path):
    _save_split(tmp_path, torch.randn(10, 4), torch.rand(10), [5])
    assert isinstance(d.read_metadata(tmp_path / d.METADATA), d.md.Metadata)
    (tmp_path / d.METADATA).write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(pickle.UnpicklingError, match="refused global posix.system"):
        d.read_rows(tmp_path, {"t.weight": (torch.zeros(2, 4), 0)})
    (tmp_path / d.METADATA).write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(pickle.UnpicklingError, match="not DCP metadata"):
        d.read_metadata(tmp_path / d.METADATA)


def test_fingerprints_add_up_over_any_split_and_see_one_changed_bit():
    w = torch.randn(1000, 16)
    whole = d.fingerprint(w)
    assert whole == (d.fingerprint(w[:1]) + d.fingerprint(w[1:700], 1) + d.fingerprint(w[700:], 700)) % 2**64
    assert d.fingerprint(w[1:], 1) != d.fingerprint(w[1:], 0)          # the position counts
    flipped = w.clone()
    flipped.view(torch.int32)[500, 3] ^= 1
    assert d.fingerprint(flipped) != whole
    ids = torch.tensor([1 << 60, 5, -1])
    assert d.fingerprint(ids) != d.fingerprint(torch.tensor([(1 << 60) + 1, 5, -1]))
    assert d.fingerprint(torch.empty(0, 4)) == 0


def test_a_dynamic_tables_state_round_trips_as_plain_tensors():
    state = {"map_ids": torch.arange(3), "state": None, "step": 7, "counters": {"inserts": 2, "evictions": 0},
             "weight": torch.randn(4, 2)}
    flat = d.flatten_dynamic("m.dyn", state)
    assert sorted(flat) == ["m.dyn.dynamic.counters.evictions#int", "m.dyn.dynamic.counters.inserts#int",
                            "m.dyn.dynamic.map_ids", "m.dyn.dynamic.step#int", "m.dyn.dynamic.weight"]
    back = d.unflatten_dynamic("m.dyn", {**flat, "other.weight": torch.zeros(1)})
    assert back["step"] == 7 and back["counters"] == {"inserts": 2, "evictions": 0} and back["state"] is None
    assert torch.equal(back["weight"], state["weight"]) and torch.equal(back["map_ids"], state["map_ids"])
    with pytest.raises(TypeError, match="is a str"):
        d.flatten_dynamic("m", {"x": "text"})


def test_socket_requests_write_and_read_only_under_the_save_root(tmp_path):
    from scheduling.ps import PSClient
    from scheduling.ps.endpoints import ServerEndpoints
    from scheduling.ps.server import PSServer
    from scheduling.ps.transport.socket_server import SocketServer

    from .test_ps import _tables

    root = tmp_path / "root"
    root.mkdir()
    server = SocketServer(ServerEndpoints(PSServer("s0")), save_root=str(root)).start()
    client = PSClient(_tables(), [server.address], transport="socket", name="dcp", seed=3)
    try:
        paths = {sp.table.name: f"m.{sp.table.name}" for sp in client.shards}
        assert client.save_shards(root / "ok", paths)[0]["rows"] > 0
        (report,) = client.save_status(root / "ok")
        assert report["bytes"] > 0 and report["fingerprints"]
        from scheduling.ps.dcp_shards import merge_metadata

        merge_metadata(root / "ok")
        assert client.load_shards(root / "ok", paths) == [report["fingerprints"]]
        for method, args in (("save_shards", (tmp_path / "out", paths)), ("load_shards", (tmp_path / "out", paths)),
                             ("save_status", (root / ".." / "out",))):
            with pytest.raises(PermissionError, match="outside the save root"):
                getattr(client, method)(*args)
        assert not (tmp_path / "out").exists()
    finally:
        client.close()
        server.close()
