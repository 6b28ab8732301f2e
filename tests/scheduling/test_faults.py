"""Faults: unreachable servers, a crashed server, restart from the last checkpoint. Every wait is bounded."""

from __future__ import annotations

import time

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from scheduling.ps import LocalCluster, PSClient, PSEmbeddingBagCollection, PSUnavailableError, init_trainer
from scheduling.ps.transport.ports import free_port


def test_unreachable_servers_fail_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(PSUnavailableError, match=r"did not assemble within 2\.0 s"):
        init_trainer("trainer", 0, 3, master_port=free_port(), timeout_s=2.0)
    assert time.monotonic() - start < 30  # bounded: no hang


def _tables():
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=10, feature_names=[f"f{i}"])
            for i in range(2)]


def _kjt(shift: int) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=["f0", "f1"], values=(torch.arange(8) + shift) % 10,
                             lengths=torch.tensor([2, 2, 1, 3]))


def _step(ebc: PSEmbeddingBagCollection, shift: int) -> None:
    parts = ebc.lookup(_kjt(shift))
    ebc.pool(_kjt(shift), parts).values().pow(2).sum().backward()
    ebc.push(_kjt(shift), parts)


def test_crash_gives_a_clear_error_and_restart_from_checkpoint_continues(tmp_path):
    cluster = LocalCluster(2, timeout_s=20).start()
    try:
        client = PSClient(_tables(), cluster.server_names, name="faulty", timeout_s=3.0, seed=2)
        ebc = PSEmbeddingBagCollection(client)
        _step(ebc, 0)
        paths = client.checkpoint(tmp_path)
        saved = client.state_dict()
        _step(ebc, 1)                                    # progress after the checkpoint is lost
        cluster.kill(1)
        start = time.monotonic()
        with pytest.raises(PSUnavailableError, match=r"'ps1' \(server 1 of 2, client 'faulty'\)"):
            for shift in range(2, 6):                    # the failure shows up on the next RPC to ps1
                _step(ebc, shift)
        assert time.monotonic() - start < 30
        client.close(flush=False)
    finally:
        cluster.close()

    restarted = LocalCluster(2, timeout_s=20, checkpoints=sorted(paths)).start()
    try:
        client = PSClient(_tables(), restarted.server_names, name="faulty", timeout_s=3.0, seed=99)
        state = client.state_dict()                      # the checkpoint, not fresh seed-99 weights
        for key in saved:
            torch.testing.assert_close(state[key], saved[key])
        ebc = PSEmbeddingBagCollection(client)
        _step(ebc, 1)                                    # serving and training again
        assert not torch.equal(client.state_dict()["t0.weight"], saved["t0.weight"])
        assert [s["pushes"] for s in client.stats()] == [1, 1]
        client.close()
    finally:
        restarted.close()


def test_a_crash_under_a_carried_lookup_is_a_clear_error():
    cluster = LocalCluster(2, timeout_s=20).start()
    try:
        client = PSClient(_tables(), cluster.server_names, name="faulty_pf", timeout_s=3.0, seed=2)
        kjt, nxt = _kjt(0), _kjt(1)
        part = client.lookup(1, kjt)
        part.sum().backward()
        cluster.kill(1)
        start = time.monotonic()
        with pytest.raises(PSUnavailableError, match=r"'ps1' \(server 1 of 2, client 'faulty_pf'\)"):
            client.settle_push(client.push_async(1, kjt, part, next_kjt=nxt), 1)  # the push carries the lookup
            client.finish_lookup(client.lookup_async(1, nxt), 1)
        assert time.monotonic() - start < 30
        client.close(flush=False)
    finally:
        cluster.close()
