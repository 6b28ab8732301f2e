"""No whole table reaches rank 0 for a job's full delta (:class:`jobs.trainer.deltas.DeltaWriter`) or its mid-phase
evaluation snapshot (:func:`jobs.trainer.evaluation.evaluate_mid_phase`): with 2 real parameter servers (a
``LocalCluster``, no Ray) and the trainer's own tables view (``jobs.trainer.servers._PhaseTables``), the trainer's
clients receive only small reports while the servers write a 10^5-row table and a dynamic one by shard; the readers
(``jobs.deltas.load_delta``, ``jobs.launcher.model_export.with_tables``) then give the tables whole, equal to a
gather, and the delta chain from the full delta rebuilds the trained tables bit for bit."""

from __future__ import annotations

import functools
import itertools
import re
import types

import pytest
import torch

from tests.scheduling.test_placement_sharded import Model, _counting, _same

ROWS, DIM = 10**5, 8
TABLE_BYTES = ROWS * (DIM + 1) * 4   # rows and row-wise Adagrad state
_NAMES = itertools.count()


@pytest.fixture
def trainer(tmp_path):
    """Rank 0's view of an optimized phase whose tables are on 2 servers, with ``tmp_path`` as run folder; ``.train()``
    takes a step."""
    import fxdist
    import scheduling
    from jobs.trainer.servers import _PhaseTables
    from scheduling import placement
    from scheduling.ps import LocalCluster

    torch.manual_seed(0)
    with LocalCluster(num_servers=2, timeout_s=120.0):
        to_servers = functools.partial(scheduling.parameter_servers, optimizer="rowwise_adagrad", lr=0.1,
                                       verbose=False, client=f"byshard{next(_NAMES)}", group_tables=False,
                                       dynamic={"dyn": {"capacity": 16, "min_count": 1}})
        gm = fxdist.optimize(Model(ROWS, DIM), passes=(to_servers,))  # the shared model, smaller
        owner = types.SimpleNamespace(rank=0, run_dir=tmp_path, state=None, barrier=lambda: None)
        tables = _PhaseTables(owner, "optimized")
        tables.attach(gm)
        gen = torch.Generator().manual_seed(1)

        def train() -> None:
            a = torch.randint(0, ROWS, (64, 2), generator=gen)
            ids = torch.randint(0, 40, (64,), generator=gen) * (1 << 40) + 3   # 40 ids > capacity 16: evictions
            gm(a, ids).sum().backward()
            tables.sync()

        t = types.SimpleNamespace(phase="optimized", step=0, tables=tables, gm=gm, train=train,
                                  dense_state=lambda: {k: v for k, v in gm.state_dict().items() if k.startswith("top.")},
                                  workload=types.SimpleNamespace(has_eval=True, eval_batches=lambda: None),
                                  evaluated=gm)
        try:
            yield t
        finally:
            placement.close(gm)


@pytest.mark.timeout(600)
def test_a_full_delta_is_written_by_the_servers_and_the_chain_rebuilds_the_tables(trainer, tmp_path):
    from jobs.deltas import DELTAS_DIR, apply_delta, committed_steps, load_delta
    from jobs.trainer.deltas import DeltaWriter
    from scheduling.placement.restore import table_checkpoint

    for _ in range(2):
        trainer.train()
    at_start = table_checkpoint(trainer.gm)          # a gather, for comparison (before counting)
    received = _counting(trainer.gm)
    writer = DeltaWriter(trainer, 2, 0, tmp_path / "model")
    writer.start()                                   # the full delta of step 0
    during = received[0]
    for step in (1, 2):
        trainer.train()
        writer.after_step(step)
    writer.close()
    assert during < TABLE_BYTES // 100               # the servers' short reports, no table

    model = tmp_path / "model"
    assert committed_steps(model) == [0, 2] and not list((model / DELTAS_DIR).glob(".*"))
    assert (model / DELTAS_DIR / f"{0:010d}" / "tables" / ".metadata").is_file()
    full = load_delta(model, 0)
    assert full.full and sorted(full.tables) == ["big.weight", "dyn.weight"] and full.dynamic["dyn"].full
    assert torch.equal(full.tables["big.weight"].values, at_start["big.weight"])
    assert torch.equal(full.tables["big.weight"].rows, torch.arange(ROWS))
    assert torch.equal(full.dynamic["dyn"].ids, torch.as_tensor(at_start["dyn.dynamic"]["map_ids"]).long())

    now = table_checkpoint(trainer.gm)
    state = {"big.weight": torch.zeros(ROWS, DIM), "dyn.weight": torch.zeros(16, DIM),
             **{k: torch.zeros_like(v) for k, v in trainer.dense_state().items()}}
    ids = {"dyn": {"ids": torch.empty(0, dtype=torch.int64), "slots": torch.empty(0, dtype=torch.int64)}}
    for step in committed_steps(model):
        apply_delta(state, ids, load_delta(model, step))
    assert torch.equal(state["big.weight"], now["big.weight"]) and torch.equal(state["dyn.weight"], now["dyn.weight"])
    assert torch.equal(ids["dyn"]["ids"], torch.sort(torch.as_tensor(now["dyn.dynamic"]["map_ids"]).long())[0])


@pytest.mark.timeout(600)
def test_the_evaluation_snapshot_is_written_by_shard_and_read_whole_by_the_launcher(trainer, tmp_path):
    from jobs.launcher.model_export import with_tables
    from jobs.trainer.checkpoints import referenced
    from jobs.trainer.evaluation import evaluate_mid_phase
    from scheduling.placement.restore import table_checkpoint

    for _ in range(3):
        trainer.train()
    received = _counting(trainer.gm)
    out = evaluate_mid_phase(trainer, 3, snapshot=True)
    during = received[0]
    assert during < TABLE_BYTES // 100
    assert re.fullmatch(r"tables/eval-00000003-[0-9a-f]{8}/optimized", out["tables"]["dcp"])
    assert out["step"] == 3 and sorted(out["model"]) == ["top.bias", "top.weight"]
    saved = {"step": 5, "models": {}, "tables": {}, "eval": {"optimized": out}}
    assert referenced(saved) == {out["tables"]["dcp"].split("/")[1]}

    whole = with_tables(saved, tmp_path)["eval"]["optimized"]["tables"]
    _same(whole, table_checkpoint(trainer.gm), "snapshot")   # nothing trained since: the gather's tables
