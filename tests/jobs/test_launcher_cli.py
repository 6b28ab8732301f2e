"""``fxdist data synth`` on the command line, and the troubleshooting pointer that ends the message of an error
of the packages (``docs/troubleshooting.md#<class>``)."""

from __future__ import annotations

import importlib
import re
import sys

import pytest

import fxdist
from jobs.launcher.cli import TROUBLESHOOTING, main, troubleshooting_section
from tests._docs_site import DOCS, ROOT

sys.path.insert(0, str(DOCS))
import gen_reference  # noqa: E402


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


def _sections() -> set[str]:
    return set(re.findall(r"^### (\w+)$", (ROOT / TROUBLESHOOTING).read_text(), flags=re.MULTILINE))


def test_every_exception_class_has_a_troubleshooting_section_the_cli_points_to():
    """Every exception class of the generated exceptions reference: ``fxdist`` prints any of them (``launch``'s
    last resort prints every error), so each has a ``### Name`` section, and the pointer for an instance (or a
    subclass of it that is no class of the packages, like Ray's wrappers) names that section, and so does the
    class's docstring (the API reference links it)."""
    classes = [c for c in gen_reference.exception_classes() if not c["warning"]]
    assert len(classes) > 20
    missing = [c["name"] for c in classes if c["name"] not in _sections()]
    assert not missing, f"no section in {TROUBLESHOOTING}: {missing}"
    for c in classes:
        cls = getattr(importlib.import_module(c["module"]), c["name"])
        want = f"{TROUBLESHOOTING}#{c['name'].lower()}"
        assert troubleshooting_section(cls.__new__(cls)) == want
        assert f"See {want}." in (cls.__doc__ or ""), f"{c['module']}.{c['name']}'s docstring names no section"
        wrapper = type(f"RayTaskError({c['name']})", (cls,), {"__module__": "ray.exceptions"})
        assert troubleshooting_section(wrapper.__new__(wrapper)) == want
    assert troubleshooting_section(ValueError("x")) is None


def test_a_bad_config_ends_with_the_pointer_to_its_section(tmp_path, capsys):
    assert main(["launch", "--set", "job.steps=-1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert "[job] steps = -1" in err[0] and err[-1] == f"fxdist: troubleshooting: {TROUBLESHOOTING}#configerror"
    bad = tmp_path / "bad.toml"
    bad.write_text("[job]\nno_such_key = 1\n")
    assert main(["config", str(bad)]) == 2
    assert capsys.readouterr().err.endswith(f"fxdist: troubleshooting: {TROUBLESHOOTING}#configerror\n")


@pytest.mark.parametrize(("error", "status", "section"), [
    ("recsys.criteo_format:DataError", 2, "dataerror"),
    ("jobs.launcher.launch:ParityError", 3, "parityerror"),
    ("jobs.launcher.launch:JobFailed", 1, "jobfailed"),
    ("scheduling.ps.safe_load:CheckpointRefused", 1, "checkpointrefused"),
    ("scheduling.ps.transport.auth:AuthenticationError", 1, "authenticationerror"),
    ("scheduling.ps.client:PSUnavailableError", 1, "psunavailableerror"),
])
def test_what_launch_prints_for_an_error_points_to_its_section(monkeypatch, capsys, error, status, section):
    """``fxdist launch``'s error paths (the job itself replaced by one that raises), after the error's notes;
    an error raised ``from`` one of the packages' points to that one."""
    from jobs.launcher import launch

    module, name = error.split(":")
    cls = getattr(importlib.import_module(module), name)
    exc = cls.__new__(cls)
    exc.args = ("the message",)
    exc.add_note("run folder: somewhere")

    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(launch, "launch", fail)
    assert main(["launch", "--quiet"]) == status
    err = capsys.readouterr().err.splitlines()
    assert "the message" in err[0] and err[1:] == ["fxdist: run folder: somewhere",
                                                   f"fxdist: troubleshooting: {TROUBLESHOOTING}#{section}"]


def test_an_error_raised_from_one_of_the_packages_points_to_that_one(monkeypatch, capsys):
    from jobs.launcher import launch
    from scheduling.ps.client import PSUnavailableError

    def fail(*args, **kwargs):
        try:
            raise PSUnavailableError("server 0 did not answer")
        except PSUnavailableError as e:
            raise RuntimeError("training failed") from e

    monkeypatch.setattr(launch, "launch", fail)
    assert main(["launch", "--quiet"]) == 1
    assert capsys.readouterr().err.endswith(f"fxdist: troubleshooting: {TROUBLESHOOTING}#psunavailableerror\n")
