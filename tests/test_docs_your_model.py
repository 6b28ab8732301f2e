"""Getting started's "your own model in ``fxdist launch``" as a new user follows it: the page's files
(``mypkg/models.py``, ``mypkg/data.py``, ``myjob.toml``, fenced with a ``title="myproject/..."``) are written into
an empty folder outside the repository, the page's command runs the job there (``PYTHONPATH=$PWD fxdist launch
myjob.toml``, fewer steps), and the page's ``predict.py`` loads the trained model from ``RUN_DIR/model/`` and
predicts. The one end-to-end Ray job of the docs tests (about a minute on 2 cores)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._docs_site import DOCS

PAGE = DOCS / "getting-started" / "your-model.md"
TITLED = re.compile(r'^```(?:py|toml) title="myproject/([\w./]+)[^"]*"\n(.*?)^```', flags=re.MULTILINE | re.DOTALL)
FXDIST = Path(sys.executable).parent / "fxdist"

pytestmark = [pytest.mark.timeout(600), pytest.mark.ray]  # the page's job starts a local Ray


def _files() -> dict[str, str]:
    return {path: text for path, text in TITLED.findall(PAGE.read_text())}


def test_the_page_gives_every_file_and_the_command():
    files = _files()
    assert set(files) == {"mypkg/models.py", "mypkg/data.py", "myjob.toml", "predict.py"}
    assert 'name = "mymodel"' in files["myjob.toml"] and "runs/mymodel-*" in files["predict.py"]
    assert "PYTHONPATH=$PWD ../fxdist/.venv/bin/fxdist launch myjob.toml" in PAGE.read_text()


def test_a_new_user_trains_loads_and_predicts_with_their_own_model(tmp_path: Path):
    project = tmp_path / "myproject"
    for path, text in _files().items():
        (project / path).parent.mkdir(parents=True, exist_ok=True)
        (project / path).write_text(text)
    env = {**os.environ, "PYTHONPATH": str(project)}   # the page's PYTHONPATH=$PWD, and nothing of the repository
    launch = subprocess.run(
        [str(FXDIST), "launch", "myjob.toml", "--quiet", "--set", "job.steps=30", "--set", "quant.enabled=false",
         "--set", "metrics.enabled=false"], cwd=project, env=env, capture_output=True, text=True, timeout=540)
    assert launch.returncode == 0, (launch.stdout + launch.stderr)[-3000:]
    runs = sorted((project / "runs").glob("mymodel-*"))
    assert len(runs) == 1 and (runs[0] / "model" / "state_dict.pt").is_file()
    predict = subprocess.run([sys.executable, "predict.py"], cwd=project, env=env, capture_output=True, text=True,
                             timeout=120)
    assert predict.returncode == 0, predict.stderr[-3000:]
    found = re.search(r"tensor\(\[([\d.e+-]+), ([\d.e+-]+)\]\)", predict.stdout)
    assert found, predict.stdout
    most_below_500, none_below_500 = float(found.group(1)), float(found.group(2))
    # the job learned the page's rule: a click when most of a sample's ids are < 500
    assert 0.5 < most_below_500 < 1 and 0 < none_below_500 < 0.5, predict.stdout
