"""``benchmarks/peer.py``'s ceiling (``dense_only``): the DLRM with its sparse arch a constant (no timing here).

Its outputs have the real DLRM's shapes, and it holds no tables: no ``EmbeddingBagCollection``, no parameter
of the sparse arch, nothing that a lookup or a push could send to a server.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrec")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _peer_systems as peer  # noqa: E402  (benchmarks/_peer_systems.py)

ROWS, DIM, B = 100, 8, 4


def _inputs():
    from recsys.criteo import criteo_kjt

    gen = torch.Generator().manual_seed(0)
    return torch.rand(B, 13, generator=gen), criteo_kjt(torch.randint(0, ROWS, (B, peer.TABLES), generator=gen))


def test_dense_only_has_the_real_dlrms_output_shapes():
    real, ceiling = peer.dlrm(ROWS, DIM), peer.dense_only_model(ROWS, DIM, batch=B)
    dense, kjt = _inputs()
    assert ceiling.sparse_arch(kjt).shape == real.sparse_arch(kjt).shape == (B, peer.TABLES, DIM)
    assert ceiling(dense, kjt).shape == real(dense, kjt).shape == (B, 1)


def test_dense_only_holds_no_tables_and_trains_only_the_dense_part():
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    real, ceiling = peer.dlrm(ROWS, DIM), peer.dense_only_model(ROWS, DIM, batch=B)
    assert not any(isinstance(m, EmbeddingBagCollection) for m in ceiling.modules())
    names = {n for n, _ in ceiling.named_parameters()}
    assert names == {n for n, _ in real.named_parameters() if not n.startswith("sparse_arch.")}
    assert all(p.device.type == "cpu" for p in ceiling.parameters())
    dense, kjt = _inputs()
    out = ceiling(dense, kjt)
    assert not ceiling.sparse_arch(kjt).requires_grad
    out.sum().backward()
    assert all(p.grad is not None for p in ceiling.parameters())
    assert ceiling.sparse_arch(kjt).abs().max() <= ROWS ** -0.5   # like the tables' rows


def test_the_compared_systems_include_the_ceiling_and_staleness():
    assert {"dense_only", "dmp_tw", "fx_prefetch_0ms", "fx_stale1_0ms"} <= set(peer.SYSTEMS)


def test_fx_system_names_give_the_schedule_the_transport_and_where_the_servers_run():
    assert {"fx_inproc_prefetch_0ms", "fx_inproc_stale1_0ms", "fx_rpc_prefetch_0ms"} <= set(peer.SYSTEMS)
    kinds = {s: peer._fx_kind(s) for s in peer.SYSTEMS if s.startswith("fx_")}
    assert kinds["fx_blocking_1ms"] == "blocking" and kinds["fx_prefetch_0ms"] == "prefetch"
    assert kinds["fx_inproc_prefetch_0ms"] == "prefetch" and kinds["fx_inproc_stale1_0ms"] == "stale1"
    assert kinds["fx_rpc_inproc_stale1_0ms"] == "stale1" and kinds["fx_dynamic_prefetch_0ms"] == "prefetch"
    assert [s for s in kinds if peer.in_trainers(s)] == ["fx_inproc_prefetch_0ms", "fx_inproc_stale1_0ms",
                                                         "fx_rpc_inproc_prefetch_0ms", "fx_rpc_inproc_stale1_0ms"]
    # the job's default transport (socket) for every fxdist system but the fx_rpc_* ones
    assert [s for s in kinds if not peer.over_socket(s)] == ["fx_rpc_prefetch_0ms", "fx_rpc_stale1_0ms",
                                                            "fx_rpc_inproc_prefetch_0ms", "fx_rpc_inproc_stale1_0ms"]
    assert [s for s in kinds if peer.dynamic_tables(s)] == ["fx_dynamic_prefetch_0ms"]
    assert not peer.over_socket("dmp_tw") and not peer.over_socket("dense_only")


def test_the_placement_spreads_the_tables_over_the_servers_asked_for():
    for servers in (1, 2, 3):
        placed = peer.plan(servers)
        assert sorted(placed) == sorted(f"t_C{i + 1}" for i in range(peer.TABLES))
        counts = [list(placed.values()).count(s) for s in range(servers)]
        assert sum(counts) == peer.TABLES and max(counts) - min(counts) <= 1
    setting = peer.Setting("fx_prefetch_0ms", ROWS, DIM, 1, 1, pg_port=0, servers=1)
    assert setting.num_servers == 1
    assert peer.Setting("fx_inproc_prefetch_0ms", ROWS, DIM, 1, 1, pg_port=0, servers=1).num_servers == peer.WORLD


def test_a_table_starts_from_the_same_rows_whichever_server_holds_it():
    from scheduling.ps.server import PSServer
    from scheduling.ps.shard_plan import TableSpec, plan_shards

    tables = [TableSpec(f"t_C{i + 1}", ROWS, DIM, (f"C{i + 1}",)) for i in range(3)]
    shards = plan_shards(tables, 2)   # t_C1 and t_C3 on server 0, t_C2 on server 1
    for server, held_tables in ((0, (0, 2)), (1, (1,))):
        srv = PSServer(f"ps{server}")
        srv.configure("emb", shards, server, "sgd", {"lr": 0.1}, peer.TABLE_SEED)
        held = srv.fused["emb"]
        assert held is not None
        assert torch.equal(held.weight, torch.cat([peer.initial_table(i, ROWS, DIM) for i in held_tables]))


def test_the_ceiling_with_embedding_grads_differs_from_the_ceiling_only_by_that_gradient():
    """``benchmarks/trainer_step.py``'s ``ceiling_grad``: the same outputs as the ceiling, and backward reaches the
    constant pooled embeddings (a fresh leaf each step), which the ceiling's never do."""
    import trainer_step

    dense, kjt = _inputs()
    ceiling = peer.dense_only_model(ROWS, DIM, batch=B)
    with_grad = peer.dense_only_model(ROWS, DIM, batch=B)
    with_grad.sparse_arch = trainer_step._PooledWithGrad(B, peer.TABLES, ROWS, DIM)
    with_grad.load_state_dict(ceiling.state_dict())
    torch.testing.assert_close(with_grad(dense, kjt), ceiling(dense, kjt), rtol=0, atol=0)
    first, second = with_grad.sparse_arch(kjt), with_grad.sparse_arch(kjt)
    assert first.is_leaf and first.requires_grad and first is not second
    torch.testing.assert_close(first, ceiling.sparse_arch(kjt), rtol=0, atol=0)
    pooled = with_grad.sparse_arch(kjt)
    with_grad.sparse_arch.forward = lambda features: pooled   # capture the leaf this step uses
    with_grad(dense, kjt).sum().backward()
    assert pooled.grad is not None and pooled.grad.shape == (B, peer.TABLES, DIM) and pooled.grad.abs().sum() > 0
    assert not ceiling.sparse_arch(kjt).requires_grad


def test_fx_nice_systems_name_their_servers_nice_value_and_the_others_keep_the_trainers_priority():
    assert {"fx_nice19_prefetch_0ms", "fx_nice19_stale1_0ms", "fx_nice4_prefetch_0ms"} <= set(peer.SYSTEMS)
    assert set(peer.SYSTEMS) - set(peer.DEFAULT_SYSTEMS) == {"fx_nice19_prefetch_0ms", "fx_nice19_stale1_0ms",
                                                             "fx_nice4_prefetch_0ms", "fx_send1_prefetch_0ms",
                                                             "fx_send0_prefetch_0ms", "fx_shm0_prefetch_0ms",
                                                             "fx_shm0_stale1_0ms", "fx_noauth_prefetch_0ms"}   # on demand only
    assert peer._fx_kind("fx_nice19_prefetch_0ms") == "prefetch" and peer._fx_kind("fx_nice19_stale1_0ms") == "stale1"
    assert peer.server_nice("fx_nice19_prefetch_0ms") == 19 and peer.server_nice("fx_nice4_prefetch_0ms", 7) == 4
    assert peer.server_nice("fx_prefetch_0ms") == 0 and peer.server_nice("fx_stale1_0ms", 5) == 5  # --server-nice
    assert peer.over_socket("fx_nice19_prefetch_0ms") and not peer.in_trainers("fx_nice19_prefetch_0ms")
    assert peer.server_nice("fx_rpc_nice3_prefetch_0ms") == 3 and not peer.over_socket("fx_rpc_nice3_prefetch_0ms")


def test_fx_send_systems_set_their_trainers_send_thread_and_the_others_leave_it_to_the_environment():
    assert peer.send_thread_setting("fx_send1_prefetch_0ms") == "1"
    assert peer.send_thread_setting("fx_send0_prefetch_0ms") == "0"
    assert peer.send_thread_setting("fx_prefetch_0ms") is None and peer.send_thread_setting("fx_nice19_stale1_0ms") is None
    assert peer._fx_kind("fx_send1_prefetch_0ms") == "prefetch" and peer._fx_kind("fx_nice19_send0_stale1_0ms") == "stale1"
    assert peer.over_socket("fx_send1_prefetch_0ms") and not peer.in_trainers("fx_send1_prefetch_0ms")
    assert peer.server_nice("fx_send1_prefetch_0ms", 3) == 3 and peer.server_nice("fx_send0_nice7_prefetch_0ms") == 7


def test_fx_noauth_systems_switch_the_security_layer_off_in_the_benchmarks_processes_only(monkeypatch):
    import pickle

    from scheduling.ps.transport import auth, shm_arena, socket_wire

    assert peer.security_off("fx_noauth_prefetch_0ms") and not peer.security_off("fx_prefetch_0ms")
    assert peer._fx_kind("fx_noauth_prefetch_0ms") == "prefetch" and peer.over_socket("fx_noauth_prefetch_0ms")
    for module, name in ((auth, "server_handshake"), (auth, "client_handshake"), (socket_wire, "safe_loads"),
                         (socket_wire, "fresh_bytes"), (shm_arena, "fresh_bytes")):
        monkeypatch.setattr(module, name, getattr(module, name))   # restored after the test
    peer.without_security()
    assert auth.server_handshake(None, b"") is None and auth.client_handshake(None, b"") is None
    assert socket_wire.safe_loads is pickle.loads
    assert socket_wire.fresh_bytes(3).numel() == 3 and shm_arena.fresh_bytes(0).numel() == 0


def test_fx_shm0_systems_turn_their_trainers_arenas_off_and_the_others_leave_it_to_the_environment():
    assert peer.shm_setting("fx_shm0_prefetch_0ms") == "0" and peer.shm_setting("fx_shm0_stale1_0ms") == "0"
    assert peer.shm_setting("fx_prefetch_0ms") is None and peer.shm_setting("fx_send0_prefetch_0ms") is None
    assert peer._fx_kind("fx_shm0_stale1_0ms") == "stale1" and peer.send_thread_setting("fx_shm0_send1_prefetch_0ms") == "1"
    assert peer.over_socket("fx_shm0_prefetch_0ms") and not peer.in_trainers("fx_shm0_prefetch_0ms")
