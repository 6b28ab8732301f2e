"""jobs.deltas: writing, listing, loading and applying deltas of a model (plain torch, no Ray)."""

from __future__ import annotations

import os

import pytest
import torch

from jobs.deltas import (
    DELTAS_DIR,
    Delta,
    DeltaError,
    DeltaQueue,
    DynamicDelta,
    TableDelta,
    apply_delta,
    apply_map,
    committed_steps,
    delta_path,
    latest_step,
    load_delta,
    write_delta,
)


def _delta(step: int, rows: list[int], fill: float) -> Delta:
    r = torch.tensor(rows, dtype=torch.int64)
    return Delta(step, {"dense.w": torch.full((2, 3), fill)},
                 {"emb.t.weight": TableDelta(r, torch.full((len(rows), 4), fill))},
                 {"dyn": DynamicDelta(torch.tensor([7, 9]), torch.tensor([1, 0]), torch.tensor([5]))})


def test_write_then_load_round_trips_every_field(tmp_path) -> None:
    path = write_delta(tmp_path, _delta(10, [0, 3], 1.5), extra={"phase": "optimized"})
    assert path == delta_path(tmp_path, 10) == tmp_path / DELTAS_DIR / "0000000010"
    got = load_delta(tmp_path, 10)
    assert got.step == 10 and got.num_rows == 2
    assert torch.equal(got.tables["emb.t.weight"].rows, torch.tensor([0, 3]))
    assert torch.equal(got.tables["emb.t.weight"].values, torch.full((2, 4), 1.5))
    assert torch.equal(got.dense["dense.w"], torch.full((2, 3), 1.5))
    assert torch.equal(got.dynamic["dyn"].evicted, torch.tensor([5]))
    assert '"phase": "optimized"' in (path / "delta.json").read_text()
    # plain tensors only: torch's weights-only loader reads it
    assert torch.load(path / "delta.pt", weights_only=True)["step"] == 10


def test_committed_steps_are_ascending_and_skip_temporary_folders(tmp_path) -> None:
    assert committed_steps(tmp_path) == [] and latest_step(tmp_path) is None
    for step in (5, 20, 15):
        write_delta(tmp_path, _delta(step, [1], float(step))) if step != 15 else None
    (tmp_path / DELTAS_DIR / ".tmp-0000000025-abc").mkdir()          # a delta being written
    (tmp_path / DELTAS_DIR / "0000000030").mkdir()                   # no delta.pt: not committed
    assert committed_steps(tmp_path) == [5, 20] and latest_step(tmp_path) == 20


def test_a_step_at_or_before_the_newest_is_not_rewritten(tmp_path) -> None:
    write_delta(tmp_path, _delta(10, [0], 1.0))
    assert write_delta(tmp_path, _delta(10, [1], 2.0)) is None
    assert write_delta(tmp_path, _delta(5, [1], 2.0)) is None
    assert torch.equal(load_delta(tmp_path, 10).tables["emb.t.weight"].rows, torch.tensor([0]))
    assert committed_steps(tmp_path) == [10]
    assert not [n for n in os.listdir(tmp_path / DELTAS_DIR) if n.startswith(".tmp")]


def test_a_queue_commits_in_order_in_the_background_and_stops_at_a_failed_write(tmp_path, monkeypatch) -> None:
    from jobs import deltas

    queue = DeltaQueue(tmp_path)
    assert queue.put(_delta(2, [0], 1.0)) and queue.put(_delta(4, [1], 2.0)) and not queue.put(_delta(4, [1], 3.0))
    queue.close()
    assert committed_steps(tmp_path) == [2, 4] and DeltaQueue(tmp_path).newest == 4

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(deltas, "write_delta", full_disk)
    queue = DeltaQueue(tmp_path)
    assert queue.put(_delta(6, [0], 1.0))
    with pytest.raises(OSError, match="No space left"):
        queue.close()
    queue = DeltaQueue(tmp_path)
    queue.put(_delta(6, [0], 1.0))
    import time

    deadline = time.monotonic() + 10
    while not queue._last.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(OSError, match="No space left"):          # the next put reports it and writes nothing
        queue.put(_delta(8, [0], 1.0))
    assert committed_steps(tmp_path) == [2, 4]


def test_load_raises_a_clear_error_for_missing_or_foreign_files(tmp_path) -> None:
    with pytest.raises(DeltaError, match="no delta of step 3"):
        load_delta(tmp_path, 3)
    folder = delta_path(tmp_path, 3)
    folder.mkdir(parents=True)
    torch.save({"format": 99, "step": 3}, folder / "delta.pt")
    with pytest.raises(DeltaError, match="not a delta of format 1"):
        load_delta(tmp_path, 3)
    (folder / "delta.pt").write_bytes(b"not a zip")
    with pytest.raises(DeltaError, match="not a readable delta"):
        load_delta(tmp_path, 3)


def test_load_refuses_pickled_objects(tmp_path) -> None:
    from tests._planted import Planted

    folder = delta_path(tmp_path, 4)
    folder.mkdir(parents=True)
    marker = tmp_path / "ran"
    torch.save({"format": 1, "step": 4, "dense": {"x": Planted(str(marker))}}, folder / "delta.pt")
    with pytest.raises(DeltaError, match="not a readable delta"):
        load_delta(tmp_path, 4)
    assert not marker.exists()


def test_apply_sets_rows_dense_and_the_id_map_in_place() -> None:
    module = torch.nn.Module()
    module.register_buffer("w", torch.zeros(2, 3))
    state = {"dense.w": module.w, "emb.t.weight": torch.zeros(5, 4)}
    ids = {"dyn": {"ids": torch.tensor([5, 7]), "slots": torch.tensor([0, 2])}}
    apply_delta(state, ids, _delta(1, [0, 3], 2.0))
    assert torch.equal(module.w, torch.full((2, 3), 2.0))                   # shares storage with the module
    assert torch.equal(state["emb.t.weight"][[0, 3]], torch.full((2, 4), 2.0))
    assert torch.equal(state["emb.t.weight"][[1, 2, 4]], torch.zeros(3, 4))
    # 5 evicted, 7 moved from slot 2 to slot 1, 9 admitted at slot 0: sorted by id
    assert torch.equal(ids["dyn"]["ids"], torch.tensor([7, 9])) and torch.equal(ids["dyn"]["slots"], torch.tensor([1, 0]))


def test_apply_map_drops_the_previous_owner_of_a_filled_slot() -> None:
    old = {"ids": torch.tensor([1, 2, 3]), "slots": torch.tensor([4, 5, 6])}
    new = apply_map(old, DynamicDelta(torch.tensor([8]), torch.tensor([5])))
    assert new["ids"].tolist() == [1, 3, 8] and new["slots"].tolist() == [4, 6, 5]


def test_a_full_map_replaces_the_old_one_and_survives_a_round_trip(tmp_path) -> None:
    old = {"ids": torch.tensor([1, 2]), "slots": torch.tensor([0, 3])}
    full = DynamicDelta(torch.tensor([9, 4]), torch.tensor([1, 2]), full=True)
    assert apply_map(old, full)["ids"].tolist() == [4, 9] and apply_map(old, full)["slots"].tolist() == [2, 1]
    write_delta(tmp_path, Delta(0, {}, {}, {"dyn": full}, full=True))
    got = load_delta(tmp_path, 0)
    assert got.full and got.dynamic["dyn"].full and not load_delta(tmp_path, 0).dynamic["dyn"].evicted.numel()


@pytest.mark.parametrize("bad, match", [
    ({"emb.t.weight": torch.zeros(2, 4)}, "cannot take rows"),                 # row 3 outside 2 rows
    ({"emb.t.weight": torch.zeros(5, 8)}, "cannot take rows"),                 # width 4 into 8
    ({}, "table 'emb.t.weight' is not in the state dict"),
])
def test_apply_checks_everything_before_writing(bad, match) -> None:
    state = {"dense.w": torch.zeros(2, 3), **bad}
    ids = {"dyn": {"ids": torch.tensor([5]), "slots": torch.tensor([0])}}
    with pytest.raises(DeltaError, match=match):
        apply_delta(state, ids, _delta(1, [0, 3], 2.0))
    assert torch.equal(state["dense.w"], torch.zeros(2, 3)) and ids["dyn"]["ids"].tolist() == [5]


def test_apply_needs_the_dynamic_tables_map() -> None:
    state = {"dense.w": torch.zeros(2, 3), "emb.t.weight": torch.zeros(5, 4)}
    with pytest.raises(DeltaError, match="dynamic table 'dyn'"):
        apply_delta(state, {}, _delta(1, [0], 1.0))


# ---- the deltas of a job (tests/jobs/conftest.py: one_server_run, a delta every 2 steps) --------------------------
def _run_model(run_dir):
    """The run's config and a fresh model of its structure, tables in the trainer (their values do not matter: the
    chain starts with a full delta)."""
    import json

    from jobs import criteo
    from jobs.config import parse_config

    config = parse_config(json.loads((run_dir / "results.json").read_text())["config"])
    return config, criteo.dlrm(config)


def _replay(run_dir, upto: int) -> dict[str, torch.Tensor]:
    _, model = _run_model(run_dir)
    state, ids = model.state_dict(), {}
    for step in committed_steps(run_dir / "model"):
        if step <= upto:
            apply_delta(state, ids, load_delta(run_dir / "model", step))
    assert ids == {}                                   # fixed tables
    return state


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different


def test_a_jobs_deltas_rebuild_its_trained_model_bit_for_bit(one_server_run):
    """2 trainers on one server actor, 8 steps: a full delta at step 0 and one every 2 steps, in step order; applied
    in order to a fresh model they give RUN_DIR/model/state_dict.pt at the last step, bit for bit, and the dense
    weights of the step-4 checkpoint at step 4; only the changed rows travel."""
    import json

    from scheduling.ps.safe_load import safe_load

    run_dir = one_server_run["run_dir"]
    model_dir = run_dir / "model"
    steps = committed_steps(model_dir)
    assert steps[:5] == [0, 2, 4, 6, 8] and load_delta(model_dir, 0).full and not load_delta(model_dir, 2).full
    assert (delta_path(model_dir, 0) / "tables" / ".metadata").is_file()   # the full delta: the server wrote its tables
    assert not list((model_dir / DELTAS_DIR).glob(".*"))
    config, fresh = _run_model(run_dir)
    table_rows = sum(v.shape[0] for k, v in fresh.state_dict().items() if k in load_delta(model_dir, 2).tables)
    assert 0 < load_delta(model_dir, 2).num_rows < table_rows
    step = json.loads((model_dir / "model.json").read_text())["step"]
    _equal(_replay(run_dir, step), torch.load(model_dir / "state_dict.pt", weights_only=True))
    (at4,) = [p for p in sorted(run_dir.glob("ray/**/state.pt")) if safe_load(p)["step"] == 4]
    dense = safe_load(at4)["models"]["optimized"]
    replayed = _replay(run_dir, 4)
    _equal({k: replayed[k] for k in dense}, dense)


def test_a_new_model_folder_takes_over_the_deltas_as_hard_links(tmp_path) -> None:
    """RUN_DIR/model/ is replaced whole at the end of a job (jobs.launcher.model_export): its committed deltas move
    into the new folder, the same files (hard links), and no temporary delta folder comes along."""
    from jobs.launcher.model_export import _replace_dir

    target = tmp_path / "model"
    write_delta(target, _delta(2, [0], 1.0))
    (target / DELTAS_DIR / ".tmp-0000000004-x").mkdir()
    before = (delta_path(target, 2) / "delta.pt").stat().st_ino
    new = tmp_path / "model.tmp-1"
    new.mkdir()
    (new / "state_dict.pt").write_bytes(b"")
    _replace_dir(new, target)
    assert committed_steps(target) == [2] and (delta_path(target, 2) / "delta.pt").stat().st_ino == before
    assert sorted(os.listdir(target / DELTAS_DIR)) == ["0000000002"] and (target / "state_dict.pt").exists()


def test_a_full_delta_with_tables_by_shard_is_committed_whole_and_read_whole(tmp_path) -> None:
    from scheduling.ps import dcp_shards

    weight, momentum = torch.randn(10, 4), torch.rand(10)
    shards = tmp_path / DELTAS_DIR / ".tables-0000000000-x"                     # two servers' rows of one table
    for name, lo, hi in (("ps0", 0, 6), ("ps1", 6, 10)):
        dcp_shards.write_shards({"emb.t.weight": (weight[lo:hi], lo, 10), "emb.t.momentum": (momentum[lo:hi], lo, 10)},
                                shards / f"ns@{name}")
    dynamic = dcp_shards.flatten_dynamic("dyn", {"map_ids": torch.tensor([7, 9]), "map_slots": torch.tensor([1, 0]),
                                                 "weight": torch.ones(2, 4), "state": torch.ones(2), "step": 3})
    dcp_shards.write_shards({k: (v, 0, v.shape[0] if v.dim() else 0) for k, v in dynamic.items()}, shards / "dyn@ps0")
    dcp_shards.merge_metadata(shards)
    path = write_delta(tmp_path, Delta(0, {"dense.w": torch.zeros(2)}, {}, {}, full=True), shards=shards)
    assert not shards.exists() and (path / "tables" / ".metadata").is_file()   # moved in before the commit
    got = load_delta(tmp_path, 0)
    assert got.full and sorted(got.tables) == ["dyn.weight", "emb.t.weight"] and got.num_rows == 12
    assert torch.equal(got.tables["emb.t.weight"].values, weight) and "emb.t.momentum" not in got.tables
    assert torch.equal(got.dynamic["dyn"].ids, torch.tensor([7, 9])) and got.dynamic["dyn"].full
    record = __import__("json").loads((path / "delta.json").read_text())
    assert record["format"] == 2 and record["rows"] == {"emb.t.weight": 10, "dyn.weight": 2}

    import shutil

    shutil.rmtree(path / "tables")                                              # a torn copy: one clear error
    with pytest.raises(DeltaError, match="tables by shard"):
        load_delta(tmp_path, 0)
