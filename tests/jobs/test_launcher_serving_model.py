"""jobs.launcher.serving_model: the served model, its deltas and its dynamic tables, without Ray.

Run folders are written by ``write_model_dir`` from small models (tests/jobs/_serving.py); deltas by
``jobs.deltas.write_delta``. Predictions are compared with the eager model bit for bit: before any delta, after
each delta (the eager model with the same delta applied to its state dict), and for dynamic tables (the ids the map
does not hold served as zero rows).
"""

from __future__ import annotations

import threading

import pytest
import torch

from jobs import criteo, deltas
from jobs.launcher.serving_inputs import RequestError
from jobs.launcher.serving_model import IdIndex, ServedModel, ServeError, model_folder
from tests.jobs._serving import ROWS, T_C1, dlrm_reference, dlrm_run, dynamic_run, two_tower_run

TABLE = f"{T_C1}.weight"


def _logits(answer: dict) -> torch.Tensor:
    return torch.tensor(answer["logits"], dtype=torch.float32)


def test_the_served_dlrm_answers_as_the_eager_model(tmp_path):
    config, model = dlrm_run(tmp_path / "run", step=3)
    served = ServedModel(tmp_path / "run")
    assert served.step == 3 and not served.snapshot.module.training
    answer = served.predict({"rows": ROWS})
    assert answer["step"] == 3
    assert torch.equal(_logits(answer), dlrm_reference(config, model, ROWS))
    assert answer["predictions"] == torch.sigmoid(_logits(answer)).tolist()
    unlabelled = [r.split("\t", 1)[1] for r in ROWS]  # 39 fields: the label column is optional
    assert served.predict({"rows": unlabelled})["logits"] == answer["logits"]
    assert model_folder(tmp_path / "run" / "model") == tmp_path / "run" / "model"


def test_deltas_apply_in_step_order_and_match_the_model_with_them(tmp_path):
    config, model = dlrm_run(tmp_path / "run", step=0)
    applied: list[int] = []
    served = ServedModel(tmp_path / "run", on_applied=applied.append)
    before = served.snapshot
    folder = tmp_path / "run" / "model"
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    for step in (2, 4):
        dense = {k: v + 0.01 * step for k, v in expected.items() if ".embedding_bags." not in k}
        change = deltas.TableDelta(torch.tensor([1, 7]), torch.full((2, 4), float(step)))
        deltas.write_delta(folder, deltas.Delta(step, dense, {TABLE: change}))
        deltas.apply_delta(expected, {}, deltas.load_delta(folder, step))
    assert served.poll() == [2, 4] and applied == [2, 4] and served.step == 4
    assert served.poll() == []  # nothing new
    model.load_state_dict(expected)
    assert torch.equal(_logits(served.predict({"rows": ROWS})), dlrm_reference(config, model, ROWS))
    # copy on write: the first snapshot's tensors were not touched, the untouched ones are shared
    assert not torch.equal(before.state[TABLE], served.snapshot.state[TABLE])
    other = f"{T_C1[:-1]}2.weight"
    assert served.snapshot.state[other].data_ptr() == before.state[other].data_ptr()


def test_a_bad_delta_keeps_the_served_model_and_is_retried(tmp_path):
    dlrm_run(tmp_path / "run", step=0)
    failures: list[BaseException] = []
    served = ServedModel(tmp_path / "run", on_failed=failures.append)
    folder = tmp_path / "run" / "model"
    deltas.write_delta(folder, deltas.Delta(1, {}, {"no.such.weight": deltas.TableDelta(torch.tensor([0]),
                                                                                       torch.ones(1, 4))}))
    assert served.poll() == [] and served.step == 0 and served.failures == 1
    assert isinstance(failures[0], (ServeError, deltas.DeltaError)) and "no.such.weight" in str(failures[0])
    assert served.poll() == [] and served.failures == 2  # tried again


def test_a_newer_model_folder_is_reloaded(tmp_path):
    dlrm_run(tmp_path / "run", step=2)
    served = ServedModel(tmp_path / "run")
    config, model = dlrm_run(tmp_path / "run", step=9)  # the job's end rewrites model/ (another model here)
    assert served.poll() == [9] and served.step == 9
    assert torch.equal(_logits(served.predict({"rows": ROWS})), dlrm_reference(config, model, ROWS))


def test_dynamic_tables_map_raw_ids_to_slots_and_follow_the_deltas(tmp_path):
    config, model, slots = dynamic_run(tmp_path / "run")
    served = ServedModel(tmp_path / "run")
    assert served.features["C1"] == T_C1 and len(served.features) == 26

    def reference(mapping: dict[int, int]) -> torch.Tensor:
        """The eager model with a zero row added, where the ids the map does not hold go."""
        zero = criteo.dlrm(config.replace(model={"dynamic_capacity": 9})).eval()
        state = {k: (torch.cat([v, torch.zeros(1, 4)]) if ".embedding_bags." in k else v)
                 for k, v in model.state_dict().items()}
        zero.load_state_dict(state)
        from jobs.table_sizes import reader_sizes
        from recsys.criteo_format import parse_line

        parsed = [parse_line(r, reader_sizes(config)) for r in ROWS]
        ids = torch.full((len(ROWS), 26), 8, dtype=torch.int64)  # every other table: no id has a row
        ids[:, 0] = torch.tensor([mapping.get(p[1][0], 8) for p in parsed])
        with torch.no_grad():
            return zero(torch.tensor([p[0] for p in parsed]), criteo.to_kjt(ids)).reshape(-1)

    assert torch.equal(_logits(served.predict({"rows": ROWS})), reference(slots))
    first, second = list(slots)
    folder = tmp_path / "run" / "model"  # step 3: the first row's id evicted, the second's moved to slot 6
    new_rows = torch.arange(8.0).repeat(2, 1)[:, :4] + 1
    change = deltas.DynamicDelta(torch.tensor([second]), torch.tensor([6]), torch.tensor([first]))
    deltas.write_delta(folder, deltas.Delta(3, {}, {TABLE: deltas.TableDelta(torch.tensor([2, 6]), new_rows)},
                                            {T_C1: change}))
    assert served.poll() == [3]
    expected = model.state_dict()
    expected[TABLE][torch.tensor([2, 6])] = new_rows
    assert torch.equal(_logits(served.predict({"rows": ROWS})), reference({second: 6}))


def test_bad_requests_name_what_was_wrong(tmp_path, monkeypatch):
    dlrm_run(tmp_path / "dlrm")
    served = ServedModel(tmp_path / "dlrm")
    for body, message in [([1], "JSON object"), ({"inputs": []}, "takes 'rows', not 'inputs'"),
                          ({"rows": [ROWS[0], "1\t2"]}, "rows[1]: field_count"),
                          ({"rows": [ROWS[0].replace("62770d79", "xyz")]}, "rows[0]: categorical_feature")]:
        with pytest.raises(RequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
            served.predict(body)
    two_tower_run(tmp_path / "user", monkeypatch)
    user = ServedModel(tmp_path / "user")
    with pytest.raises(RequestError, match=r"inputs\[1\]: expected 2 dimensions"):
        user.predict({"inputs": [[[1, 2]], [3, 4]]})
    with pytest.raises(RequestError, match=r"the model refused the inputs: \w+Error: .*400"):
        user.predict({"inputs": [[[1, 2]], [[3, 400]]]})  # id 400 of a 30-row table


def test_a_user_model_answers_its_output_structure(tmp_path, monkeypatch):
    model = two_tower_run(tmp_path / "run", monkeypatch, step=7)
    served = ServedModel(tmp_path / "run")
    users, items = [[1, 2], [3, 39]], [[0, 5], [29, 4]]
    answer = served.predict({"inputs": [users, items]})
    with torch.no_grad():
        logits, (u, i) = model(torch.tensor(users), torch.tensor(items))
    assert answer["step"] == 7
    assert torch.equal(torch.tensor(answer["predictions"][0]), logits)
    assert torch.equal(torch.tensor(answer["predictions"][1][1]), i)


def test_runs_that_cannot_be_served_are_refused_at_start(tmp_path, monkeypatch):
    with pytest.raises(ServeError, match="no trained model"):
        ServedModel(tmp_path)
    two_tower_run(tmp_path / "run", monkeypatch)
    (tmp_path / "run" / "model" / "sample_input.pt").unlink()
    with pytest.raises(ServeError, match="no sample_input.pt"):
        ServedModel(tmp_path / "run", check_only=True)


def test_requests_never_see_a_half_applied_delta(tmp_path):
    """Readers racing the delta thread only ever get the logits of one whole step's model."""
    config, model = dlrm_run(tmp_path / "run", step=0)
    served = ServedModel(tmp_path / "run")
    folder = tmp_path / "run" / "model"
    expected = {0: dlrm_reference(config, model, ROWS)}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for step in range(1, 6):
        dense = {k: v + 0.05 for k, v in state.items() if ".embedding_bags." not in k}
        deltas.write_delta(folder, deltas.Delta(step, dense, {TABLE: deltas.TableDelta(torch.arange(50),
                                                                                     torch.full((50, 4), step / 10))}))
        deltas.apply_delta(state, {}, deltas.load_delta(folder, step))
        model.load_state_dict(state)
        expected[step] = dlrm_reference(config, model, ROWS)
    seen: list[tuple[int, torch.Tensor]] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            answer = served.predict({"rows": ROWS})
            seen.append((answer["step"], _logits(answer)))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert served.poll() == [1, 2, 3, 4, 5]
    finally:
        stop.set()
        reader.join()
    assert served.step == 5 and seen
    assert all(torch.equal(logits, expected[step]) for step, logits in seen)


def test_the_id_index_finds_slots_and_misses():
    index = IdIndex.of(torch.tensor([40, 7, 99]), torch.tensor([0, 1, 2]))
    slots, hit = index.lookup(torch.tensor([7, 8, 99, 1000, -3]))
    assert hit.tolist() == [True, False, True, False, False] and slots[hit].tolist() == [1, 2]
    empty = IdIndex.of(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    assert not empty.lookup(torch.tensor([1]))[1].any()


def test_a_job_under_way_is_served_from_its_deltas(tmp_path):
    """No model.json yet (the job writes it at its end): a fresh model with the newest full delta, then the rest."""
    import json

    from jobs.config import to_dict
    from tests.jobs._serving import dlrm_config

    config = dlrm_config()
    model = criteo.dlrm(config.replace(job={"seed": 5})).eval()  # not the weights a fresh model of config has
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "results.json").write_text(json.dumps({"config": to_dict(config)}, default=str))
    with pytest.raises(ServeError, match="nor deltas"):
        ServedModel(run)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    deltas.write_delta(run / "model", deltas.Delta(0, state, {}, {}, full=True))
    change = deltas.TableDelta(torch.tensor([3]), torch.full((1, 4), 2.0))
    deltas.write_delta(run / "model", deltas.Delta(4, {}, {TABLE: change}))
    served = ServedModel(run)
    assert served.step == 0 and served.poll() == [4]
    deltas.apply_delta(state, {}, deltas.load_delta(run / "model", 4))
    model.load_state_dict(state)
    assert torch.equal(_logits(served.predict({"rows": ROWS})), dlrm_reference(config, model, ROWS))
