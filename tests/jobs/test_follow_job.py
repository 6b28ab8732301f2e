"""A job with ``[data] follow = true`` (training from a stream): it starts on a folder with too few rows, waits
for data (said once in the timeline), trains the rows a writer adds while it runs, and ends at ``[job] steps``."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from jobs.config import load_config
from recsys.criteo_synth import write_synthetic_criteo


def _write_when_waiting(run: Path, stream: Path, lines: list[str], timeout_s: float = 300.0) -> None:
    """Once the run's timeline says the job waits for data: a whole file renamed into place, then one written in
    place (its last line in two writes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            timeline = json.loads((run / "results.json").read_text()).get("timeline", [])
        except (OSError, ValueError):  # not written yet, or being rewritten
            timeline = []
        if any("waiting for data" in event for _, event in timeline):
            break
        time.sleep(0.2)
    (stream / ".part-1.tmp").write_text("".join(lines[150:700]))
    (stream / ".part-1.tmp").rename(stream / "part-1.tsv")
    with (stream / "part-2.tsv").open("w") as f:
        f.write("".join(lines[700:])[:-30])
        f.flush()
        f.write("".join(lines[700:])[-30:])


def test_a_follow_job_waits_for_data_and_trains_what_arrives(ray_session, tmp_path):
    from jobs.launcher.launch import launch

    stream, run = tmp_path / "stream", tmp_path / "run"
    stream.mkdir()
    lines = write_synthetic_criteo(tmp_path / "src.tsv", 1200, seed=0).read_text().splitlines(keepends=True)
    (stream / "part-0.tsv").write_text("".join(lines[:150]))  # 67 training rows per trainer: 2 of 12 batches
    writer = threading.Thread(target=_write_when_waiting, args=(run, stream, lines), daemon=True)
    writer.start()
    config = load_config().replace(
        job={"steps": 12, "batch_size": 32, "checkpoint_every": 6, "progress": False, "name": "follow-test",
             "eval_epochs": 1.0},
        data={"path": str(stream), "follow": True, "follow_poll_s": 0.1},
        model={"table_size": 200, "bottom_mlp": [8], "top_mlp": [8]},
        cluster={"trainers": 2, "cpus_per_trainer": 0.5, "parameter_servers": 0},
        metrics={"enabled": False}, quant={"enabled": False})
    r = launch(config, run_dir=run, quiet=True)
    writer.join(timeout=1)
    assert r["status"] == "completed" and r["data"]["scan"]["sharding"] == "by line (follow)"
    assert r["data"]["scan"]["rows_per_trainer"] == [68, 67] and r["data"]["scan"]["files"] == 1
    waits = [event for _, event in r["timeline"] if "waiting for data" in event]
    assert sorted(w.split(":")[0] for w in waits) == ["rank 0", "rank 1"]  # once per rank, not per poll
    assert r["parity"]["ok"] and r["parity"]["identical_losses"]  # both phases trained the same batches
    for p in r["phases"].values():
        assert p["steps"] == 12 and p["samples"] == 2 * 12 * 32
        assert p["quality_step"] == 12 and "epochs" not in p  # a stream has no epochs: evaluated at the end
        assert 0 < p["quality"]["auc"] < 1 and p["reader"]["rows"] >= 2 * 12 * 32
