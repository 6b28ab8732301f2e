"""jobs.launcher.model_export: the trained model a run leaves in ``RUN_DIR/model/``.

The built-in DLRM after a real job (the session's :func:`one_server_run`, one parameter server: its tables gathered
from the server): ``state_dict.pt`` loads strictly into a fresh DLRM, which scores the held-out rows exactly as the
model rebuilt from the final checkpoint, and the exported program as the eager model, bit for bit. ``fxdist export``
rebuilds the folder from any checkpoint of a copy of that run. Without a job: a two-tower model returning a tuple
(tables as the servers hand them back), a model torch.export cannot capture (model.json says why, the state dict is
still written), and the folder's atomic replacement.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from jobs import entry
from jobs.config import parse_config
from jobs.launcher.cli import main
from jobs.launcher.inference import rebuild_model
from jobs.launcher.model_export import (
    after_job,
    final_model_state,
    latest_checkpoint,
    load_sample_input,
    with_tables,
    write_model_dir,
)
from jobs.trainer.workload import build_model, inference_batches
from scheduling.ps.safe_load import safe_load
from tests.jobs.test_later_stages import Branchy, TupleTwoTower
from tests.jobs.test_later_stages import _config as later_config

pytestmark = pytest.mark.timeout(420)


def _outputs(model, config, data_path, batches: int = 2) -> list:
    held_out, _ = inference_batches(config, data_path)
    assert held_out, "no held-out batch"
    with torch.no_grad():
        return [model(*entry.split_batch(b, forward=model.forward)[0]) for b in held_out[:batches]]


def _run_config(run_dir: Path):
    results = json.loads((run_dir / "results.json").read_text())
    return parse_config(results["config"], source=str(run_dir / "results.json")), results


def test_dlrm_job_leaves_a_model_that_loads_scores_and_exports_as_trained(one_server_run):
    run_dir = one_server_run["run_dir"]
    config, results = _run_config(run_dir)
    folder = run_dir / "model"
    record = json.loads((folder / "model.json").read_text())
    # deltas/: one_server_run has [export] every_steps = 2 (tests/jobs/test_deltas.py)
    assert record["files"] == ["deltas", "model.json", "model.pt2", "sample_input.pt", "state_dict.pt"]
    assert sorted(p.name for p in folder.iterdir()) == record["files"]
    assert not list(run_dir.glob("model.*"))  # no temporary folder left
    assert record["entry_point"]["factory"].startswith("bundled: jobs.criteo.dlrm")
    assert record["config"]["parsed"] == results["config"] and len(record["config"]["sha256"]) == 64
    assert record["written_by"] == "fxdist launch" and record["phase"] == "optimized"
    assert record["metrics"]["held_out"]["auc"] == results["phases"]["optimized"]["quality"]["auc"]
    assert record["exports"]["fp32"] == {"file": "model.pt2", "max_abs_diff": 0.0}
    assert record["exports"]["int8"]["error"]["type"] == "no int8 model"  # [quant] enabled = false

    saved = safe_load(latest_checkpoint(run_dir), map_location="cpu")
    assert all(set(t) == {"dcp"} for t in saved["tables"].values())  # the servers wrote them by shard (DCP)
    checkpoint = final_model_state(with_tables(saved, run_dir))      # read whole from RUN_DIR/tables/
    assert record["step"] == checkpoint["step"] == results["config"]["job"]["steps"]
    assert checkpoint["tables"], "the tables were on a server: the checkpoint has them apart"
    fresh = build_model(config).eval()
    fresh.load_state_dict(torch.load(folder / "state_dict.pt", weights_only=True), strict=True)
    table = "sparse_arch.embedding_bag_collection.embedding_bags.t_C1.weight"
    assert torch.equal(fresh.state_dict()[table], checkpoint["tables"][table])  # gathered from the server
    trained = rebuild_model(config, checkpoint)
    data_path = results["data"]["path"]
    for mine, theirs in zip(_outputs(fresh, config, data_path), _outputs(trained, config, data_path), strict=True):
        assert torch.equal(mine, theirs)

    sample = load_sample_input(folder / "sample_input.pt")
    assert type(sample[1]).__name__ == "KeyedJaggedTensor" and sample[0].shape[1] == 13
    program = torch.export.load(folder / "model.pt2")
    with torch.no_grad():
        assert torch.equal(program.module()(*sample), fresh(*sample))


def test_fxdist_export_rebuilds_the_folder_from_any_checkpoint(one_server_run, tmp_path, capsys, monkeypatch):
    source = one_server_run["run_dir"]
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy2(source / "results.json", run / "results.json")
    shutil.copytree(source / "ray", run / "ray")
    shutil.copytree(source / "tables", run / "tables")   # the tables, by shard, that state.pt names
    assert main(["export", str(run)]) == 0, capsys.readouterr().err
    record = json.loads((run / "model" / "model.json").read_text())
    latest = latest_checkpoint(run)
    assert record["written_by"] == "fxdist export" and record["checkpoint"] == str(latest)
    assert record["exports"]["fp32"]["max_abs_diff"] == 0.0
    assert f"wrote {run / 'model'} from {latest}" in capsys.readouterr().out
    last = torch.load(run / "model" / "state_dict.pt", weights_only=True)
    expected = torch.load(source / "model" / "state_dict.pt", weights_only=True)
    if json.loads((source / "model" / "model.json").read_text())["step"] == record["step"]:
        assert all(torch.equal(last[k], expected[k]) for k in expected)  # the job's own folder, rebuilt

    earlier = min(run.glob("ray/**/state.pt"), key=lambda p: safe_load(p, mmap=True)["step"])

    def refused(*args, **kwargs):  # a model torch.export cannot capture (and a quick second export)
        raise NotImplementedError("no capture here\nsecond line")

    monkeypatch.setattr(torch.export, "export", refused)
    assert main(["export", str(run), "--checkpoint", str(earlier.parent)]) == 0
    record = json.loads((run / "model" / "model.json").read_text())
    assert record["step"] < json.loads((source / "model" / "model.json").read_text())["step"]
    assert record["exports"]["fp32"] == {"error": {"type": "NotImplementedError", "message": "no capture here"}}
    assert record["files"] == ["model.json", "sample_input.pt", "state_dict.pt"]
    state = torch.load(run / "model" / "state_dict.pt", weights_only=True)
    assert any(not torch.equal(state[k], last[k]) for k in last)  # the earlier model, not the latest
    assert not list(run.glob("model.*"))

    assert main(["export", str(tmp_path / "nothing")]) == 2
    assert "no results.json with the run's config" in capsys.readouterr().err
    assert main(["export", str(run), "--checkpoint", str(run / "missing.pt")]) == 2
    assert "missing.pt: no such file" in capsys.readouterr().err


def _two_tower_checkpoint(model: torch.nn.Module, step: int) -> dict:
    """A job checkpoint of ``model`` with its EmbeddingBag tables apart, as the ``parameter_servers`` pass and
    the servers leave them (with row-wise Adagrad state)."""
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    tables = {k: sd.pop(k) for k in ("users.weight", "items.weight")}
    tables.update({k.replace(".weight", ".momentum"): torch.rand(v.shape[0]) for k, v in list(tables.items())})
    return {"step": step, "models": {"baseline": {}, "optimized": sd}, "tables": {"optimized": tables}}


def test_a_tuple_output_model_loads_and_exports_leaf_for_leaf(tmp_path):
    config = later_config("tuple_two_tower", "pairs")
    torch.manual_seed(3)
    trained = TupleTwoTower().eval()
    results = {"phases": {"optimized": {"quality": {"auc": 0.61, "log_loss": 0.7}, "quality_step": 9}}}
    record = after_job(config, _two_tower_checkpoint(trained, 9), results, tmp_path, None, None, print)
    assert record is not None and record["step"] == 9
    assert record["entry_point"]["factory"] == "tests.jobs.test_later_stages:tuple_two_tower"
    assert record["metrics"]["held_out"] == {"step": 9, "auc": 0.61, "log_loss": 0.7}
    fresh = entry.make_model(config).eval()
    fresh.load_state_dict(torch.load(tmp_path / "model" / "state_dict.pt", weights_only=True), strict=True)
    sample = load_sample_input(tmp_path / "model" / "sample_input.pt")
    program = torch.export.load(tmp_path / "model" / "model.pt2").module()
    with torch.no_grad():
        want, mine, exported = trained(*sample), fresh(*sample), program(*sample)
    assert isinstance(exported, tuple) and isinstance(exported[1], tuple)
    for a, b, c in zip(torch.utils._pytree.tree_leaves(want), torch.utils._pytree.tree_leaves(mine),
                       torch.utils._pytree.tree_leaves(exported), strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)


def test_a_model_torch_export_cannot_capture_still_gets_its_state_dict(tmp_path):
    config = later_config("branchy", "pairs")
    torch.manual_seed(4)
    trained = Branchy().eval()
    sample = (torch.randint(0, 40, (8, 2)), torch.randint(0, 30, (8, 2)))
    state = {"phase": "optimized", "step": 5, "model": trained.state_dict(), "tables": {}}
    record = write_model_dir(tmp_path, config, state, sample=sample)
    error = record["exports"]["fp32"]["error"]
    assert error["type"] == "GuardOnDataDependentSymNode" and "data-dependent" in error["message"]
    assert "\n" not in error["message"]
    assert record["files"] == ["model.json", "sample_input.pt", "state_dict.pt"]
    assert json.loads((tmp_path / "model" / "model.json").read_text())["exports"] == record["exports"]
    fresh = Branchy()
    fresh.load_state_dict(torch.load(tmp_path / "model" / "state_dict.pt", weights_only=True), strict=True)
    assert all(torch.equal(v, trained.state_dict()[k]) for k, v in fresh.state_dict().items())


def test_the_folder_is_replaced_whole_and_a_failed_write_leaves_the_old_one(tmp_path, monkeypatch):
    config = later_config("tuple_two_tower", "pairs")
    model = TupleTwoTower()
    state = {"phase": "optimized", "step": 1, "model": model.state_dict(), "tables": {}}
    write_model_dir(tmp_path, config, state)  # no sample: no program, the reason recorded
    (tmp_path / "model" / "stale.txt").write_text("from an older folder")
    record = write_model_dir(tmp_path, config, {**state, "step": 2})
    assert record["exports"]["fp32"]["error"]["type"] == "no sample input"
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["model.json", "state_dict.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]

    real_save = torch.save

    def full_disk(obj, path, *args, **kwargs):
        if str(path).endswith("model.json") or "state_dict" in str(path):
            raise OSError(28, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_model_dir(tmp_path, config, {**state, "step": 3})
    assert json.loads((tmp_path / "model" / "model.json").read_text())["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]

    broken = {**state, "model": {k: v for k, v in state["model"].items() if k != "user_tower.0.bias"}}
    with pytest.raises(RuntimeError, match=r"does not hold \['user_tower.0.bias'\]"):
        write_model_dir(tmp_path, config, broken)
    assert after_job(config, {"step": 1, "models": {}}, {}, tmp_path, None, None, lambda m: None) is None


def test_dynamic_tables_are_rows_by_slot_and_their_id_maps(tmp_path):
    """A checkpoint of the DLRM with dynamic tables, as ``table_checkpoint`` gathers it from the servers (rows by slot
    under ``<path>.weight``, the table's server state under ``<path>.dynamic``): the state dict loads strictly into a
    fresh dynamic DLRM, the id maps go to ``dynamic_ids.pt``, and no program is made (raw-id inputs)."""
    from jobs import criteo
    from jobs.config import load_config

    config = load_config().replace(model={"table_sizes": "dynamic", "dynamic_capacity": 50, "bottom_mlp": [8],
                                          "top_mlp": [8]})
    sd = criteo.dlrm(config).state_dict()
    paths = [k.removesuffix(".weight") for k in sd if ".embedding_bags." in k]
    tables = {f"{p}.weight": torch.randn(50, config.model.embedding_dim) for p in paths}
    gen = torch.Generator().manual_seed(0)
    for p in paths:
        held = int(torch.randint(1, 50, (1,), generator=gen))
        tables[f"{p}.dynamic"] = {"map_ids": torch.randint(0, 2**62, (held,), generator=gen),
                                  "map_slots": torch.randperm(50, generator=gen)[:held], "capacity": 50, "step": 7}
    dense = {k: v for k, v in sd.items() if ".embedding_bags." not in k}
    record = write_model_dir(tmp_path, config, {"phase": "optimized", "step": 7, "model": dense, "tables": tables},
                             sample=(torch.zeros(2, 13),))
    assert record["exports"]["fp32"]["error"]["type"] == "dynamic tables" and record["dynamic_tables"] == sorted(paths)
    assert record["files"] == ["dynamic_ids.pt", "model.json", "state_dict.pt"]
    fresh = criteo.dlrm(config)
    fresh.load_state_dict(torch.load(tmp_path / "model" / "state_dict.pt", weights_only=True), strict=True)
    ids = torch.load(tmp_path / "model" / "dynamic_ids.pt", weights_only=True)
    for p in paths:
        assert torch.equal(fresh.state_dict()[f"{p}.weight"], tables[f"{p}.weight"])
        assert torch.equal(ids[p]["ids"], tables[f"{p}.dynamic"]["map_ids"])
        assert torch.equal(ids[p]["slots"], tables[f"{p}.dynamic"]["map_slots"])


def test_the_int8_model_is_exported_or_model_json_says_why(tmp_path):
    """The int8 model the int8 stage chose (here: every layer, by a timer that finds int8 faster). In torch 2.13
    FBGEMM's packed weights are TorchScript objects torch.export cannot trace: model.json records the exception
    and the fp32 files stand; if torch learns to capture them, the program must match the int8 module."""
    from jobs.launcher.inference import quantize
    from tests.jobs.test_later_stages import _int8_faster

    config = later_config("tuple_two_tower", "pairs")
    torch.manual_seed(5)
    trained = TupleTwoTower().eval()
    sample = (torch.randint(0, 40, (8, 2)), torch.randint(0, 30, (8, 2)))
    with torch.no_grad():
        int8, info = quantize(trained, [sample, sample], timer=_int8_faster)
    assert info["quantized_modules"] == 4
    state = {"phase": "optimized", "step": 2, "model": trained.state_dict(), "tables": {}}
    record = write_model_dir(tmp_path, config, state, sample=sample, int8=int8)
    assert record["exports"]["fp32"]["file"] == "model.pt2"
    if "error" in record["exports"]["int8"]:
        assert record["exports"]["int8"]["error"]["type"] == "AttributeError"
        assert "model_int8.pt2" not in record["files"] and not (tmp_path / "model" / "model_int8.pt2").exists()
    else:
        assert record["exports"]["int8"] == {"file": "model_int8.pt2", "max_abs_diff": 0.0}


def test_torchrecs_notice_of_a_non_strict_kjt_export_is_not_shown(tmp_path, caplog):
    import logging

    from jobs.launcher.model_export import _export

    class Noisy(torch.nn.Module):
        def forward(self, x):
            logging.getLogger().warning("Trying to non-strict torch.export KJT to_dict, which is extremely slow and "
                                        "not recommended!")   # what torchrec logs on the root logger
            logging.getLogger().warning("another warning")
            return x * 2

    filters = list(logging.getLogger().filters)
    with caplog.at_level(logging.WARNING):
        record = _export(Noisy(), (torch.ones(3),), tmp_path / "model.pt2")
    assert record == {"file": "model.pt2", "max_abs_diff": 0.0}
    messages = [r.getMessage() for r in caplog.records]
    assert "another warning" in messages and not any("non-strict torch.export KJT" in m for m in messages)
    assert logging.getLogger().filters == filters   # removed again after the export
