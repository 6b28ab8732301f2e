"""jobs.launcher.serving: ``fxdist serve`` on Ray Serve, over HTTP on a free loopback port.

Run folders written without a job (tests/jobs/_serving.py): the served DLRM answers as the eager model bit for bit,
follows the deltas written next to it (the served step advances, the answers become the eager model's with the
deltas applied), answers bad bodies with 400 and counts everything in its Prometheus metrics; a user model answers
its output structure. The command line refuses what it cannot serve before Ray starts.

End to end (one job): a ``[data] follow`` job with ``[export] every_steps`` starts on a folder with too few rows and
waits (said once per trainer in its timeline); it is served from its first (full) delta before it has a
``model.json``; files arriving in the folder (one renamed into place, one written in place, its last line in two
writes) train on to ``[job] steps``, the served step advances through the job's deltas, and the answers on held-out
rows equal, bit for bit, the trainer's model of the same step (the chain of deltas, itself equal to the job's final
``state_dict.pt``). The same run is the test of ``[data] follow`` in a job (both phases train what arrived alike,
evaluated at the end: a stream has no epochs).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from jobs import criteo, deltas
from jobs.config import load_config, parse_config
from jobs.launcher import serving
from jobs.launcher.cli import main
from recsys.criteo_synth import write_synthetic_criteo
from scheduling.ps.transport.ports import free_port
from tests.jobs._serving import ROWS, T_C1, dlrm_reference, dlrm_run, two_tower_run

pytestmark = pytest.mark.timeout(600)


def _call(url: str, body: Any = None, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _until(check, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


@pytest.fixture(scope="module")
def serve_port(ray_session):
    """Ray Serve's HTTP proxy on a free loopback port, for the module's applications; shut down after them."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()


def test_the_served_dlrm_answers_follows_deltas_and_counts(serve_port, tmp_path):
    config, model = dlrm_run(tmp_path / "run", step=0)
    served = serving.start(tmp_path / "run", port=serve_port, metrics_port=0, poll_s=0.1, name="dlrm",
                           route_prefix="/dlrm")
    assert served.url == f"http://127.0.0.1:{serve_port}/dlrm" and served.step == 0
    code, answer = _call(served.url + "/predict", {"rows": ROWS})
    assert code == 200 and answer["step"] == 0
    assert torch.equal(torch.tensor(answer["logits"], dtype=torch.float32), dlrm_reference(config, model, ROWS))

    folder = tmp_path / "run" / "model"
    state = {k: v.clone() for k, v in model.state_dict().items()}
    dense = {k: v * 1.5 for k, v in state.items() if ".embedding_bags." not in k}
    deltas.write_delta(folder, deltas.Delta(4, dense, {f"{T_C1}.weight": deltas.TableDelta(
        torch.tensor([0, 3]), torch.full((2, 4), 0.25))}))
    deltas.apply_delta(state, {}, deltas.load_delta(folder, 4))
    model.load_state_dict(state)
    assert _until(lambda: _call(served.url + "/step")[1]["step"] == 4)
    assert _call(served.url + "/step") == (200, {"step": 4, "deltas_applied": 1, "delta_failures": 0})
    code, answer = _call(served.url + "/predict", {"rows": ROWS})
    assert code == 200 and answer["step"] == 4
    assert torch.equal(torch.tensor(answer["logits"], dtype=torch.float32), dlrm_reference(config, model, ROWS))

    assert _call(served.url + "/predict", raw=b"{not json")[0] == 400
    code, answer = _call(served.url + "/predict", {"rows": ["1\t2"]})
    assert code == 400 and answer["error"].startswith("rows[0]: field_count")
    assert _call(served.url + "/nothing")[0] == 404
    assert _call(served.url + "/predict")[0] == 405  # a GET

    with urllib.request.urlopen(f"http://127.0.0.1:{served.metrics_port}/metrics", timeout=30) as page:
        samples = {(s.name, s.labels.get("code")): s.value
                   for family in text_string_to_metric_families(page.read().decode()) for s in family.samples}
    assert samples[("fxdist_serve_requests_total", "400")] == 2 and samples[("fxdist_serve_requests_total", "404")] == 1
    assert samples[("fxdist_serve_requests_total", "200")] >= 3  # two predictions and the GET /step polls
    assert samples[("fxdist_serve_model_step", None)] == 4 and samples[("fxdist_serve_deltas_applied_total", None)] == 1
    assert samples[("fxdist_serve_request_seconds_count", None)] == 5  # every /predict: 2 answered, 2 bad, 1 GET
    serving.stop("dlrm")


def test_a_served_user_model_answers_its_outputs(serve_port, tmp_path, monkeypatch):
    model = two_tower_run(tmp_path / "run", monkeypatch, step=7)
    served = serving.start(tmp_path / "run", port=serve_port, metrics_port=0, name="user", route_prefix="/user")
    users, items = [[1, 2], [3, 4], [5, 6]], [[7, 8], [9, 10], [11, 12]]
    code, answer = _call(served.url + "/predict", {"inputs": [users, items]})
    with torch.no_grad():
        logits, (u, _) = model(torch.tensor(users), torch.tensor(items))
    assert code == 200 and answer["step"] == 7
    assert torch.equal(torch.tensor(answer["predictions"][0]), logits)
    assert torch.equal(torch.tensor(answer["predictions"][1][0]), u)
    code, answer = _call(served.url + "/predict", {"rows": ROWS})
    assert code == 400 and "takes 'inputs', not 'rows'" in answer["error"]
    serving.stop("user")


def test_the_command_refuses_what_it_cannot_serve(tmp_path, capsys):
    assert main(["serve", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no trained model" in err and "troubleshooting.md#serveerror" in err
    assert main(["serve", str(tmp_path), "--poll-s", "0"]) == 2
    assert "--poll-s must be positive" in capsys.readouterr().err


def _model_at(config, model_dir: Path, step: int) -> torch.nn.Module:
    """The trainer's model of ``step``: the job's deltas up to ``step`` applied in order to a fresh model (the
    first delta, of step 0, carries the whole model)."""
    model = criteo.dlrm(config).eval()
    state = model.state_dict()
    for s in deltas.committed_steps(model_dir):
        if s <= step:
            deltas.apply_delta(state, {}, deltas.load_delta(model_dir, s))
    return model


def test_a_follow_job_served_while_it_trains(serve_port, tmp_path):
    from jobs.launcher.launch import launch

    stream, run = tmp_path / "stream", tmp_path / "run"
    stream.mkdir()
    lines = write_synthetic_criteo(tmp_path / "src.tsv", 1400, seed=0).read_text().splitlines(keepends=True)
    held_out = [ln.rstrip("\n") for ln in lines[-16:]]
    (stream / "part-0.tsv").write_text("".join(lines[:150]))  # the rows there at the start are held out
    config = load_config().replace(
        job={"steps": 12, "batch_size": 32, "checkpoint_every": 0, "progress": False, "name": "serve-test",
             "eval_epochs": 1.0},
        data={"path": str(stream), "follow": True, "follow_poll_s": 0.1}, export={"every_steps": 4},
        model={"table_size": 200, "bottom_mlp": [8], "top_mlp": [8]}, phases={"parity": "warn"},
        cluster={"trainers": 2, "cpus_per_trainer": 0.5, "parameter_servers": 0},
        metrics={"enabled": False}, quant={"enabled": False})
    results: dict = {}
    job = threading.Thread(target=lambda: results.setdefault("job", launch(config, run_dir=run, quiet=True)),
                           daemon=True)
    job.start()
    model_dir = run / "model"
    assert _until(lambda: deltas.committed_steps(model_dir), timeout_s=400), "no delta of step 0"
    trained = parse_config(json.loads((run / "results.json").read_text())["config"])  # as the trainers got it
    assert not (model_dir / "model.json").exists()  # served from the deltas: the job writes model.json at its end
    served = serving.start(run, port=serve_port, metrics_port=0, poll_s=0.1, name="e2e", route_prefix="/e2e")
    code, first = _call(served.url + "/predict", {"rows": held_out})
    assert code == 200 and first["step"] == 0

    # 12 steps of training rows arrive: a whole file renamed into place, then one written in place (its last line
    # in two writes: the reader waits for the line's end)
    (stream / ".part-1.tmp").write_text("".join(lines[150:700]))
    (stream / ".part-1.tmp").rename(stream / "part-1.tsv")
    with (stream / "part-2.tsv").open("w") as f:
        f.write("".join(lines[700:-16])[:-30])
        f.flush()
        f.write("".join(lines[700:-16])[-30:])
    assert _until(lambda: _call(served.url + "/step")[1]["step"] > 0, timeout_s=400), "the served step stayed 0"
    code, later = _call(served.url + "/predict", {"rows": held_out})
    assert code == 200 and later["step"] in (4, 8, 12) and _call(served.url + "/step")[1]["deltas_applied"] >= 1
    job.join(timeout=400)
    assert deltas.committed_steps(model_dir) == [0, 4, 8, 12]
    for answer in (first, later):
        expected = dlrm_reference(trained, _model_at(trained, model_dir, answer["step"]), held_out)
        assert torch.equal(torch.tensor(answer["logits"], dtype=torch.float32), expected), answer["step"]
    final = torch.load(model_dir / "state_dict.pt", weights_only=True)  # the job's own model at its end
    chained = _model_at(trained, model_dir, 12).state_dict()
    assert json.loads((model_dir / "model.json").read_text())["step"] == 12
    assert all(torch.equal(final[k], chained[k]) for k in final)
    assert _until(lambda: _call(served.url + "/step")[1]["step"] == 12)
    serving.stop("e2e")
    r = results["job"]
    assert r["status"] == "completed" and r["data"]["scan"]["sharding"] == "by line (follow)"
    assert r["data"]["scan"]["rows_per_trainer"] == [68, 67] and r["data"]["scan"]["files"] == 1  # 150 rows, 15 held out
    waits = [event for _, event in r["timeline"] if "waiting for data" in event]
    assert sorted(w.split(":")[0] for w in waits) == ["rank 0", "rank 1"]  # once per rank, not per poll
    assert r["parity"]["ok"] and r["parity"]["identical_losses"]  # both phases trained the same batches
    for p in r["phases"].values():
        assert p["steps"] == 12 and p["samples"] == 2 * 12 * 32
        assert p["quality_step"] == 12 and "epochs" not in p  # a stream has no epochs: evaluated at the end
        assert 0 < p["quality"]["auc"] < 1 and p["reader"]["rows"] >= 2 * 12 * 32
