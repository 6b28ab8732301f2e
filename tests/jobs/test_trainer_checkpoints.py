"""A job's checkpoints with tables by shard (:mod:`jobs.trainer.checkpoints`), without Ray or servers: the servers'
copy returns at once, the checkpoint is reported only once their writes finished (at a later step, before an
injected fault, or at once when final), ``state.pt`` names the table folder, old folders are pruned, and a restore
goes by shard or through the whole-table path."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from jobs.trainer import checkpoints


class _Tables:
    """A phase's server tables as the checkpoints see them (``jobs.trainer.servers._PhaseTables``)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.moved = run_dir, frozenset({"t.weight"})
        self.written: set[Path] = set()
        self.started: list[Path] = []
        self.loaded: list[Path] = []

    def sync(self) -> None:
        pass

    def start_checkpoint(self, folder):
        folder.mkdir(parents=True)
        self.started.append(folder)
        return {"copy_s": 0.01, "rows": 10}

    def finish_checkpoint(self, folder, wait):
        if folder not in self.written and not wait:
            return None
        (folder / ".metadata").write_bytes(b"")   # the merged metadata
        return f"digest-of-{folder.parent.name}"

    def load_sharded(self, folder):
        self.loaded.append(folder)
        return "loaded"

    def load_state_dict(self, state):
        self.loaded.append(state)

    def state_dict(self):
        return {"t.weight": torch.ones(2, 2)}


def _trainer(run_dir: Path):
    model = torch.nn.Linear(2, 1)
    return types.SimpleNamespace(tables=_Tables(run_dir), dense_state=model.state_dict,
                                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


class _State:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.checkpointed = types.SimpleNamespace(remote=lambda *a: self.calls.append(("checkpointed", *a)))
        self.event = types.SimpleNamespace(remote=lambda *a: self.calls.append(("event", *a)))


@pytest.fixture()
def reports(monkeypatch):
    import ray.train

    seen: list[tuple] = []

    def report(metrics, checkpoint=None):
        saved = None
        if checkpoint is not None:
            from scheduling.ps.safe_load import safe_load

            saved = safe_load(Path(checkpoint.path) / "state.pt")
        seen.append((metrics["step"], saved))

    monkeypatch.setattr(ray.train, "report", report)
    monkeypatch.setattr(checkpoints, "_PENDING", [])
    return seen


def test_a_checkpoint_is_reported_once_the_servers_wrote_it(tmp_path, reports):
    trainers = {"optimized": _trainer(tmp_path)}
    state, config = _State(), types.SimpleNamespace(faults=types.SimpleNamespace(
        kill_trainer_at_step=-1, kill_server_at_step=7, pause_at_step=-1))
    checkpoints.save_checkpoint(5, trainers, {}, 0, final=False, state=state)
    assert reports == [] and checkpoints._PENDING                       # copied, not reported
    checkpoints.poll_pending(config, trainers, "optimized", 6, 0, state)
    assert reports == []                                                # the write still runs
    checkpoints.poll_pending(config, trainers, "optimized", 7, 0, state)  # a fault comes at step 7: wait for it
    (step, saved), = reports
    folder = trainers["optimized"].tables.started[0]
    assert step == 5 and saved["tables"]["optimized"] == {"dcp": str(folder.relative_to(tmp_path))}
    assert folder.parts[-3] == checkpoints.TABLES_DIR and saved["models"]["optimized"]["weight"].shape == (1, 2)
    assert ("checkpointed", "optimized", 5, checkpoints.digest(saved["models"]["optimized"]),
            f"digest-of-{folder.parent.name}") in state.calls
    assert not checkpoints._PENDING

    checkpoints.save_checkpoint(10, trainers, {}, 0, final=True, state=state)   # final: reported at once
    assert [s for s, _ in reports] == [5, 10]


def test_a_pending_checkpoint_is_reported_first_and_old_folders_pruned(tmp_path, reports, monkeypatch):
    monkeypatch.setattr(checkpoints, "KEEP_TABLES", 2)
    trainers = {"baseline": _trainer(tmp_path), "optimized": _trainer(tmp_path)}
    for step in (2, 4, 6, 8):
        checkpoints.save_checkpoint(step, trainers, {}, 0, final=False)
    assert [s for s, _ in reports] == [2, 4, 6]                      # each reported at the next checkpoint
    left = sorted(p.name for p in (tmp_path / checkpoints.TABLES_DIR).iterdir())
    assert len(left) == 3 and left[0].startswith("step-00000004") and left[2].startswith("step-00000008")


def test_restore_goes_by_shard_or_through_the_whole_tables(tmp_path):
    view = _Tables(tmp_path)
    assert checkpoints.restore_tables(view, {"dcp": "tables/step-1/optimized"}, 0) == "loaded"
    assert view.loaded == [tmp_path / "tables/step-1/optimized"]
    old = {"t.weight": torch.zeros(2, 2)}
    assert checkpoints.restore_tables(view, old, 0) == checkpoints.digest(view.state_dict())
    assert view.loaded[-1] is old and checkpoints.restore_tables(view, old, 1) is None
    view.run_dir = None
    with pytest.raises(RuntimeError, match=r"by shard in RUN_DIR/tables/x"):
        checkpoints.restore_tables(view, {"dcp": "tables/x"}, 0)


def test_pruning_keeps_the_evaluation_snapshot_the_checkpoint_names(tmp_path, reports, monkeypatch):
    import os

    monkeypatch.setattr(checkpoints, "KEEP_TABLES", 2)
    for name in ("eval-00000003-aaaaaaaa", "eval-00000001-bbbbbbbb"):   # the second from an attempt that crashed
        meta = tmp_path / checkpoints.TABLES_DIR / name / "optimized" / ".metadata"
        meta.parent.mkdir(parents=True)
        meta.write_bytes(b"")
        os.utime(meta, (1.0, 1.0))                                       # older than every checkpoint's
    early = {"optimized": {"step": 3, "tables": {"dcp": "tables/eval-00000003-aaaaaaaa/optimized"}}}
    assert checkpoints.referenced({"eval": early}) == {"eval-00000003-aaaaaaaa"}
    trainers = {"optimized": _trainer(tmp_path)}
    for step in (4, 6, 8, 10):
        checkpoints.save_checkpoint(step, trainers, early, 0, final=False)
    left = sorted(p.name for p in (tmp_path / checkpoints.TABLES_DIR).iterdir())
    assert left[0] == "eval-00000003-aaaaaaaa" and [n[:13] for n in left[1:]] == ["step-00000006", "step-00000008",
                                                                                 "step-00000010"]
    assert reports[-1][1]["eval"] == early                               # the record names it in state.pt
