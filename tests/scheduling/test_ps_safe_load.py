"""Checkpoints read with ``torch.load(weights_only=True)`` (:mod:`scheduling.ps.safe_load`): the servers' real
checkpoint files load (and need exactly the allowed project types), a file that needs more is refused naming the
file and the type, and the code a malicious pickle names never runs, through every server entry point that takes
a ``checkpoint=`` file."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from scheduling.ps.dynamic import DynamicSpec
from scheduling.ps.safe_load import SAFE_GLOBALS, CheckpointRefused, safe_load
from scheduling.ps.server import PSServer
from scheduling.ps.shard_plan import TableSpec, plan_shards
from tests._planted import Planted

TABLES = [TableSpec("a", 10, 4, ("fa",)), TableSpec("b", 6, 2, ("fb",), pooling="mean"),
          TableSpec("d", 40, 4, ("fd",), dynamic=DynamicSpec(40, 1, 5))]


def _saved_server(tmp_path: Path, storage: str = "fp32", seed: int = 1) -> tuple[PSServer, str]:
    server = PSServer("ps0")
    server.configure("ns", plan_shards(TABLES, 1), 0, "rowwise_adagrad", {"lr": 0.5}, seed=seed, storage=storage)
    return server, server.save(str(tmp_path))


@pytest.mark.parametrize("storage", ["fp32", "fp16"])
def test_a_servers_checkpoint_loads_and_needs_exactly_the_allowed_types(tmp_path, storage):
    server, path = _saved_server(tmp_path, storage)
    registered = torch.serialization.get_safe_globals()  # what safe_load registered leaves the list below
    torch.serialization.clear_safe_globals()
    try:
        needed = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    finally:
        torch.serialization.add_safe_globals(registered)
    assert sorted(needed) == sorted(SAFE_GLOBALS)
    state = safe_load(path)
    assert state["ns/d@0"]["spec"].table.dynamic == DynamicSpec(40, 1, 5)
    other, _ = _saved_server(tmp_path / "other", storage, seed=2)
    assert not torch.equal(other.state_dict()["ns/a@0"]["weight"], server.state_dict()["ns/a@0"]["weight"])
    other.load_state_dict(state)
    for key, entry in server.state_dict().items():
        assert torch.equal(other.state_dict()[key]["weight"], entry["weight"]), key


def test_a_checkpoint_that_would_run_code_is_refused_naming_file_and_type(tmp_path):
    _, path = _saved_server(tmp_path)
    state = torch.load(path, weights_only=True)
    marker = tmp_path / "marker"
    state["ns/a@0"]["hook"] = Planted(marker)
    torch.save(state, path)
    with pytest.raises(CheckpointRefused) as refused:
        safe_load(path)
    assert refused.value.path == path and refused.value.types == ["tests._planted.write_marker"]
    message = str(refused.value)
    assert f"{path}: checkpoint not loaded: it holds tests._planted.write_marker" in message
    assert "weights_only=True" in message and "Please use" not in message  # no advice to allow it
    assert isinstance(refused.value, pickle.UnpicklingError) and not marker.exists()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")
def test_a_bare_pickle_is_refused_naming_what_it_calls(tmp_path):
    """Not torch's zip format (torch says only "Unsupported operand"): the names come from the pickle's opcodes."""
    path, marker = tmp_path / "state.pt", tmp_path / "marker"
    path.write_bytes(pickle.dumps({"x": Planted(marker)}, protocol=4))
    with pytest.raises(CheckpointRefused, match=r"it holds tests\._planted\.write_marker") as refused:
        safe_load(path)
    assert refused.value.types == ["tests._planted.write_marker"] and not marker.exists()


def test_every_server_entry_point_refuses_it(tmp_path):
    """start_server, serve_in_trainer and the socket transport's serve load ``checkpoint=`` through safe_load before
    they serve anything (the Ray actor's PSActor.reset makes the same call)."""
    from scheduling.ps.in_trainers import serve_in_trainer, stop_serving
    from scheduling.ps.server import start_server
    from scheduling.ps.transport.socket_server import serve

    marker = tmp_path / "marker"
    path = tmp_path / "ps0.pt"
    torch.save({"ns/a@0": {"spec": None, "weight": torch.zeros(1, 1), "hook": Planted(marker)}}, path)
    calls = [lambda: start_server("ps0", 1, 2, master_port=1, checkpoint=str(path), block=False),
             lambda: serve_in_trainer("trainer0", checkpoint=str(path)),
             lambda: serve("ps0", "127.0.0.1", 0, checkpoint=str(path), block=False)]
    for call in calls:
        with pytest.raises(CheckpointRefused, match=r"write_marker"):
            call()
    stop_serving()
    assert not marker.exists()
