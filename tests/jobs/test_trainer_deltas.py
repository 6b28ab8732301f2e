"""jobs.trainer.deltas: the trainers' part in writing deltas, with stand-in tables (no Ray, one process)."""

from __future__ import annotations

import torch

from jobs.deltas import committed_steps, load_delta, write_delta
from jobs.trainer.deltas import DeltaWriter, delta_of
from jobs.trainer.metrics import Exporter


class _Tables:
    """Stand-in server tables: each take returns the rows pushed since the previous one."""

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.calls: list[str] = []

    def sync(self) -> None:
        self.calls.append("sync")

    def track_changes(self) -> None:
        self.calls.append("track")
        self.pending = []

    def state_dict(self) -> dict:
        self.calls.append("state_dict")
        return {"emb.t.weight": torch.zeros(8, 2), "emb.t.momentum": torch.zeros(8),
                "emb.d.dynamic": {"map_ids": torch.tensor([3]), "map_slots": torch.tensor([1])}}

    def take_changes(self) -> dict:
        self.calls.append("take")
        rows, self.pending = torch.tensor(sorted(set(self.pending)), dtype=torch.int64), []
        return {"emb.t.weight": {"rows": rows, "values": torch.full((rows.numel(), 2), float(len(rows)))},
                "emb.d.dynamic": {"ids": torch.tensor([9]), "slots": torch.tensor([0]), "evicted": torch.tensor([4])}}


class _Trainer:
    phase = "optimized"

    def __init__(self, step: int = 0) -> None:
        self.step = step
        self.tables = _Tables()
        self.weight = torch.zeros(3)

    def dense_state(self) -> dict:
        return {"dense.w": self.weight}


def test_delta_of_maps_weights_and_dynamic_maps_and_copies_the_dense_weights():
    dense = {"w": torch.zeros(2)}
    d = delta_of(4, dense, {"a.weight": {"rows": torch.tensor([1]), "values": torch.ones(1, 3)},
                            "a.dynamic": {"ids": torch.tensor([5]), "slots": torch.tensor([1]),
                                          "evicted": torch.tensor([], dtype=torch.int64)}})
    assert d.step == 4 and list(d.tables) == ["a.weight"] and list(d.dynamic) == ["a"] and d.num_rows == 1
    dense["w"].add_(1.0)                              # the module trains on: the delta keeps the step's values
    assert torch.equal(d.dense["w"], torch.zeros(2))


def test_writes_every_n_steps_and_each_step_exactly_once(tmp_path):
    trainer, exporter = _Trainer(), Exporter("j", 0)
    writer = DeltaWriter(trainer, 2, 0, tmp_path, exporter=exporter)
    writer.start()
    for step in range(1, 7):
        trainer.tables.pending.append(step)
        trainer.weight.fill_(step)
        path = writer.after_step(step)
        assert (path is not None) == (step % 2 == 0)
    writer.close()                                    # written on rank 0's background thread
    assert committed_steps(tmp_path) == writer.written == [0, 2, 4, 6]
    base = load_delta(tmp_path, 0)                    # the chain starts with the whole model
    assert base.full and base.tables["emb.t.weight"].rows.tolist() == list(range(8))
    assert "emb.t.momentum" not in base.tables and base.dynamic["emb.d"].full
    assert not load_delta(tmp_path, 2).full
    assert load_delta(tmp_path, 4).tables["emb.t.weight"].rows.tolist() == [3, 4]    # the changes since step 2
    assert torch.equal(load_delta(tmp_path, 4).dense["dense.w"], torch.full((3,), 4.0))
    assert load_delta(tmp_path, 6).dynamic["emb.d"].evicted.tolist() == [4]
    labels = {"job": "j", "phase": "optimized", "rank": "0"}
    assert exporter.registry.get_sample_value("fxdist_export_deltas_total", labels) == 4
    assert exporter.registry.get_sample_value("fxdist_export_delta_rows_total", labels) == 8 + 6


def test_a_restarted_run_keeps_the_committed_deltas_and_sends_the_changes_later(tmp_path):
    """A run restarted from the checkpoint of step 2 after it committed the deltas of 2 and 4: the delta of 4 is
    not rewritten and its changes are not taken, so the delta of 6 covers every row changed since step 2."""
    first = _Trainer()
    writer = DeltaWriter(first, 2, 0, tmp_path)
    writer.start()
    for step in range(1, 6):
        first.tables.pending.append(step)
        writer.after_step(step)
    writer.close()
    before = (tmp_path / "deltas" / "0000000004" / "delta.pt").stat()
    again = _Trainer(step=2)                           # resumed at step 2: tracking starts there
    writer = DeltaWriter(again, 2, 0, tmp_path)
    writer.start()
    for step in range(3, 7):
        again.tables.pending.append(step)
        writer.after_step(step)
    writer.close()
    assert writer.skipped == [4] and writer.written == [6] and again.tables.calls.count("take") == 1
    assert "state_dict" not in again.tables.calls     # no full delta: the chain goes on from step 4
    assert load_delta(tmp_path, 6).tables["emb.t.weight"].rows.tolist() == [3, 4, 5, 6]
    after = (tmp_path / "deltas" / "0000000004" / "delta.pt").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_other_ranks_only_sync_and_tables_without_records_send_dense_weights(tmp_path):
    trainer = _Trainer()
    writer = DeltaWriter(trainer, 1, 1, tmp_path)
    writer.start()
    assert writer.after_step(1) is None and trainer.tables.calls == ["sync", "sync"] and committed_steps(tmp_path) == []

    class _Local:                                      # tables in the trainer: no server records
        def sync(self) -> None:
            pass

        def state_dict(self) -> dict:
            return {}

    trainer.tables = _Local()
    writer = DeltaWriter(trainer, 1, 0, tmp_path)
    writer.start()
    written = writer.after_step(1)
    writer.close()
    delta = load_delta(tmp_path, 1) if written else None
    assert delta is not None and delta.tables == {} and list(delta.dense) == ["dense.w"]
    assert committed_steps(tmp_path) == [0, 1] and load_delta(tmp_path, 0).full
    assert write_delta(tmp_path, delta) is None


def test_a_run_resumed_past_its_newest_delta_starts_a_new_chain_with_a_full_delta(tmp_path):
    write_delta(tmp_path, delta_of(2, {"dense.w": torch.zeros(3)}, {}))
    trainer = _Trainer(step=6)                         # deltas 3..6 were never written
    writer = DeltaWriter(trainer, 2, 0, tmp_path)
    assert writer.start() is not None and writer.after_step(8) is not None
    writer.close()
    assert writer.written == [6, 8] and load_delta(tmp_path, 6).full and not load_delta(tmp_path, 8).full
