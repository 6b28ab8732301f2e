"""``fxdist data synth`` on the command line."""

from __future__ import annotations

import pytest

import fxdist
from jobs.launcher.cli import main


def test_cli_writes_and_refuses_bad_counts(tmp_path, capsys):
    assert main(["data", "synth", "--lines", "500", "--out", str(tmp_path / "d")]) == 0
    assert "wrote 500 synthetic Criteo lines to 1 file(s)" in capsys.readouterr().out
    assert len((tmp_path / "d" / "train_0.tsv").read_text().splitlines()) == 500
    assert main(["data", "synth", "--lines", "0", "--out", str(tmp_path / "e")]) == 2
    assert "lines and files must be >= 1" in capsys.readouterr().err


def test_version_prints_the_one_version_string(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == f"fxdist {fxdist.__version__}"
