"""The ``ray`` transport of the parameter servers (Ray actors called directly) and Ray calls in traced models.

Differential, as for ``torch_rpc``: a model trained with its tables on Ray server actors gives the same
losses and tables as with local tables (one trainer), and ``async_rpc`` / prefetch keep training exactly
the blocking baseline. Faults: a dead actor is a ``PSUnavailableError``; a restarted one is reached through
the same handle and reloads a checkpoint, with no group to restart.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import scheduling
from scheduling.ps import LocalCluster, PSClient, PSEmbeddingBagCollection, PSUnavailableError

from ..test_placement import _dlrm, _kjt_batches, _train_local, _train_on_servers
from ..test_ps import _kjt, _tables
from ..test_ps import _train as _train_dlrm_on_ps

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray  # a module-wide Ray session
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with LocalCluster(2, transport="ray") as cl:
            yield cl
    finally:
        ray.shutdown()


def test_clients_pick_the_ray_transport_and_answer_like_torchrec(ray_cluster):
    client = PSClient(_tables(), ray_cluster.server_names, sharding="row_wise", name="ray_lookup", seed=3)
    try:
        assert client.transport.name == "ray" and ray_cluster.server_names == ["ps0", "ps1"]
        from torchrec import EmbeddingBagCollection

        ebc = EmbeddingBagCollection(tables=_tables())
        sd = client.state_dict()
        ebc.load_state_dict({f"embedding_bags.{t}.weight": sd[f"{t}.weight"] for t in ("t0", "t1")})
        torch.testing.assert_close(PSEmbeddingBagCollection(client)(_kjt()).values(), ebc(_kjt()).values())
        assert len({s["pid"] for s in client.stats()}) == 2                  # two actor processes
        with pytest.raises(ValueError, match=r"server ps\d: feature 'f0' has id 99 outside table 't0'"):
            bad = type(_kjt())(keys=["f0", "f1", "f2"], values=torch.tensor([99]), lengths=torch.tensor([1, 0, 0]))
            client.lookup(0, bad)
    finally:
        client.close()


def test_torchrec_dlrm_on_ray_servers_trains_as_with_local_tables(ray_cluster):
    torch.manual_seed(0)
    model = _dlrm()
    batches = _kjt_batches(4)
    local_losses, local_tables = _train_local(copy.deepcopy(model), batches)
    losses, tables, gm, hits = _train_on_servers(model, batches, [(1, "next_sparse_features")])
    torch.testing.assert_close(losses, local_losses, rtol=1e-5, atol=1e-6)
    assert tables.keys() == local_tables.keys() and len(tables) == 2
    for key in tables:
        torch.testing.assert_close(tables[key], local_tables[key], rtol=1e-5, atol=1e-6)
        assert not torch.equal(tables[key], model.get_parameter(key))       # the tables did train
    from scheduling.ps import ops
    # prefetch rode on the pushes: every lookup of steps 2..4 (of 4) was answered by a prefetch
    assert hits == 3 * len(gm.graph.find_nodes(op="call_function", target=ops.ps_lookup_start))


def test_async_rpc_and_prefetch_train_exactly_the_blocking_baseline(ray_cluster, criteo_path):
    base = _train_dlrm_on_ps(ray_cluster, criteo_path, "ray_base", None)
    for mode in ("stale1", "prefetch"):
        other = _train_dlrm_on_ps(ray_cluster, criteo_path, f"ray_{mode}", mode)
        assert other[0] == base[0], mode
        assert base[0][-1] < base[0][0]
        for key in base[1]:
            assert torch.equal(other[1][key], base[1][key]), (mode, key)
        assert torch.equal(other[3], base[3]) and other[4] == base[4] == 8


def test_dead_actor_is_unavailable_and_a_restarted_one_reloads_the_checkpoint(ray_cluster, tmp_path):
    from scheduling.ps.transport.ray_transport import register_servers, server_actor_class, unregister_servers

    actor = server_actor_class(max_restarts=1).remote("psr")
    register_servers({"psr": actor})
    client = PSClient(_tables(), ["psr"], name="ray_restart", seed=5, timeout_s=60)
    try:
        parts = PSEmbeddingBagCollection(client).lookup(_kjt())
        saved = client.state_dict()
        client.checkpoint(tmp_path)
        pid = client.stats()[0]["pid"]
        ray.kill(actor, no_restart=False)                                    # a crash; Ray restarts it
        # the kill lands asynchronously: until then the old process answers; from then on every fetch is
        # unavailable (in flight when the process died, restarting, or served by the restarted one, which lost
        # its tables)
        deadline, messages = time.monotonic() + 60, []
        while not any("lost its tables" in m for m in messages) and time.monotonic() < deadline:
            try:
                client.lookup(0, _kjt())
            except PSUnavailableError as e:
                messages.append(str(e))
            else:
                assert not messages, f"a fetch succeeded after the server had failed: {messages}"
            time.sleep(0.2)
        assert messages and all("'psr' (server 0 of 1, client 'ray_restart') failed during lookup" in m for m in messages)
        assert "server psr is a restarted Ray actor that lost its tables; reset() it" in messages[-1]
        client.close(flush=False)
        # the same handle reaches the new process; it reloads its tables without any group re-forming
        ray.get(actor.reset.remote(str(tmp_path / "psr.pt")), timeout=60)
        client = PSClient(_tables(), ["psr"], name="ray_restart", seed=99, timeout_s=60)  # keeps loaded shards
        assert client.stats()[0]["pid"] != pid
        assert all(torch.equal(v, saved[k]) for k, v in client.state_dict().items())
        torch.testing.assert_close(PSEmbeddingBagCollection(client).lookup(_kjt())[0], parts[0].detach())
    finally:
        client.close(flush=False)
        unregister_servers(["psr"])
        ray.kill(actor, no_restart=True)


class _Tables:
    """A tiny Ray actor: sums rows of a fixed table."""

    def __init__(self) -> None:
        self.weight = torch.arange(40.0).view(10, 4)
        self.calls = 0

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.weight[ids].sum(1)


class _UserModel(nn.Module):
    def __init__(self, tables) -> None:
        super().__init__()
        self.tables, self.dense = tables, nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        rows = ray.get(self.tables.lookup.remote(ids))   # the user's own blocking call
        return self.dense(x) + rows


class _BlockingForm(_UserModel):
    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        from scheduling import ray_calls

        rows = ray_calls.ray_call(self.tables, "lookup", ids)
        return self.dense(x) + rows


@pytest.mark.parametrize("model_cls", [_UserModel, _BlockingForm], ids=["ray.get(h.m.remote)", "ray_call"])
def test_user_ray_get_calls_are_split_and_overlapped(ray_cluster, model_cls):
    from scheduling.ray_calls import ray_remote, symbolic_trace

    torch.manual_seed(0)
    model = model_cls(ray.remote(_Tables).remote())
    gm = symbolic_trace(model)
    ids, x = torch.tensor([[1, 2], [3, 9]]), torch.randn(2, 4)
    expected = model(ids, x)
    scheduling.async_rpc(gm)
    order = [(n.op, n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_module", "get_attr")]
    assert order == [("get_attr", "tables"), ("call_function", ray_remote), ("call_module", "dense"),
                     ("call_function", ray.get), ("call_function", __import__("operator").add)]
    assert "ray_remote(tables, 'lookup', ids)" in gm.code
    torch.testing.assert_close(gm(ids, x), expected)
    assert ray.get(model.tables.lookup.remote(ids)).shape == (2, 4)


def test_the_passes_do_not_import_ray():
    code = ("import sys, scheduling, scheduling.async_rpc_pass, scheduling.prefetch, scheduling.async_pairs, "
            "scheduling.ps.client, scheduling.ps.server; assert 'ray' not in sys.modules, 'ray imported'")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]


def test_ray_servers_kill_all_really_kills(ray_cluster):
    """RayServers.kill_all ends every actor for good (it used to do nothing)."""
    from scheduling.ps.transport.ray_transport import RayServers, start_actors, unregister_servers

    servers = RayServers(["pskill0", "pskill1"], timeout_s=20)
    servers.host.actors = start_actors(["pskill0", "pskill1"])
    try:
        servers.kill_all()
        for actor in servers.actors:  # the kill lands asynchronously: until then the old process may answer
            deadline = time.monotonic() + 30
            with pytest.raises(ray.exceptions.RayActorError):
                while time.monotonic() < deadline:
                    ray.get(actor.stats.remote(), timeout=30)
                    time.sleep(0.2)
    finally:
        unregister_servers(["pskill0", "pskill1"])


def test_an_actor_serving_over_ray_or_sockets_reports_the_rows_it_holds_now():
    """``PSActor.stats`` with hooks (a job's server metrics): the tables its server holds. Over ``ray`` and
    ``socket`` the server is reset, never leaves a group, so ``stats`` measures it live (it reported 0 rows)."""
    from scheduling.ps.shard_plan import TableSpec, plan_shards
    from scheduling.ps.transport.ray_transport import PSActor

    class Hooks:
        def start(self): ...
        def serving(self, server): ...
        def stats(self): return {"lookups": 0}

    actor = PSActor("ps0", serve_at_start=False, hooks=Hooks())
    assert actor.stats()["rows"] == 0
    actor.reset()
    actor.configure("ns", plan_shards([TableSpec("t", 10, 4, ("f",)), TableSpec("u", 7, 4, ("g",))], 1), 0, "sgd",
                    {"lr": 1.0}, seed=0)
    stats = actor.stats()
    assert stats["rows"] == 17 and stats["bytes"] >= 17 * 4 * 4 and stats["lookups"] == 0
    actor.reset()   # the next worker group: an empty server
    assert actor.stats()["rows"] == 0
