"""The suite's two lanes (tests/conftest.py, scripts/test.sh): which tests ``-m ray`` selects, and the refusal of
``ray.init`` in a test outside that lane."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _selected(*args: str) -> list[str]:
    """The test ids that ``pytest --collect-only *args`` selects."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_the_ray_lane_holds_the_tests_using_a_ray_fixture_a_ray_parameter_or_the_marker():
    files = ["tests/jobs/test_staleness.py", "tests/jobs/test_config.py", "tests/scheduling/test_local_cluster.py",
             "tests/test_docs_your_model.py"]
    ray, others = _selected("-m", "ray", *files), _selected("-m", "not ray", *files)
    assert "tests/jobs/test_staleness.py::test_a_stale_job_trains_and_records_the_tolerance_parity" in ray  # fixture
    assert "tests/jobs/test_staleness.py::test_max_staleness_wrong_type_is_a_config_error" in others
    assert any(t.startswith("tests/test_docs_your_model.py::") for t in ray)  # the module's marker
    lanes = {t.rpartition("[")[2].rstrip("]") for t in ray + others if "test_local_cluster.py" in t and "[" in t}
    assert lanes >= {"ray", "torch_rpc", "socket"}
    assert all(t.endswith("[ray]") for t in ray if "test_local_cluster.py" in t and "[" in t)  # the parameter
    assert others and not any("test_config.py" in t for t in ray) and not set(ray) & set(others)


def test_ray_init_outside_the_lane_fails_and_names_the_marker(tmp_path):
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import _ray_needs_its_marker, pytest_collection_modifyitems, pytest_configure  # noqa\n")
    (tmp_path / "test_starts_ray.py").write_text(
        "import pytest\nray = pytest.importorskip('ray')\n\n"
        "def test_unmarked():\n    ray.init(num_cpus=1)\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "test_unmarked starts Ray: mark it with @pytest.mark.ray" in proc.stdout
