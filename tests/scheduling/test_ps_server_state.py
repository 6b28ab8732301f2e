"""A parameter server's checkpoint requests (:mod:`scheduling.ps.server_state`): copies of its shards, loading them
back into another server, the memory held and the checkpoint file."""

from __future__ import annotations

import torch

from scheduling.ps.server import PSServer
from scheduling.ps.server_state import ServerState, Shard
from scheduling.ps.shard_plan import TableSpec, plan_shards

TABLES = [TableSpec("a", 10, 4, ("fa",)), TableSpec("b", 6, 2, ("fb",))]


def _server(name: str, seed: int) -> PSServer:
    srv = PSServer(name)
    srv.configure("ns", plan_shards(TABLES, 1), 0, "rowwise_adagrad", {"lr": 0.5}, seed=seed)
    return srv


def test_state_dict_is_a_copy_that_loads_into_another_server(tmp_path):
    src = _server("ps0", seed=1)
    assert isinstance(src, ServerState) and all(isinstance(s, Shard) for s in src.shards.values())
    state = src.state_dict("ns")
    assert sorted(state) == ["ns/a@0", "ns/b@0"] and state["ns/a@0"]["weight"].shape == (10, 4)
    state["ns/a@0"]["weight"].add_(1.0)                     # a copy: the server's rows are unchanged
    assert not torch.equal(src.state_dict("ns")["ns/a@0"]["weight"], state["ns/a@0"]["weight"])
    dst = _server("ps1", seed=2)
    dst.load_state_dict(src.state_dict())
    for key, entry in src.state_dict().items():
        assert torch.equal(dst.state_dict()[key]["weight"], entry["weight"]), key
    assert dst.memory() == src.memory() == {"rows": 16, "bytes": (10 * 4 + 6 * 2 + 16) * 4}
    path = src.save(str(tmp_path))
    assert path.endswith("ps0.pt")
    loaded = torch.load(path, weights_only=False)
    assert torch.equal(loaded["ns/b@0"]["weight"], src.state_dict()["ns/b@0"]["weight"])
