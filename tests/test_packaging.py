"""The package as a user gets it: ``python -m build`` makes the sdist and, from it, the wheel; the wheel installs into a
new virtual environment and its command line, its imports, its compiled kernels and docs/install.md's example run
from there.

Offline and quick: the build runs without isolation (the bootstrap's pinned setuptools), the wheel is installed
with ``--no-index`` and the lock as constraints, and the new environment reuses the bootstrap's installed
dependencies (torch...) through a ``.pth`` line naming ``.venv``'s site-packages, instead of installing them again:
pip finds them already there, so the ranges of the wheel's metadata are checked against the lock's versions. Such a line only adds
the folder to ``sys.path`` (the ``.pth`` files inside it, among them the editable install's finder, are not run),
and the new environment's own site-packages comes first: the checks assert that every module comes from there,
never from the repository.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import fxdist
from scheduling.ps.dynamic_native import FLAGS, SOURCE

ROOT = Path(__file__).resolve().parents[1]
INSTALL_DOC = ROOT / "docs" / "install.md"
HAVE_CXX = bool(os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++"))
"""Whether setup.py can build the compiled kernels into the wheel here (without a compiler it builds it without)."""


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """``python -m build --no-isolation``: the sdist, then the wheel built from it (no download)."""
    try:
        import build  # noqa: F401
    except ImportError:
        pytest.skip("the 'build' package is not installed (requirements.txt pins it: run scripts/bootstrap.sh)")
    # from a copy of the tree, so that the build's own files (fxdist.egg-info) never land in the repository, where
    # another run of this test may be building at the same time
    source = tmp_path_factory.mktemp("source") / "fxdist"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "runs", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"))
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)], cwd=out, timeout=300)
    return out


def _kernels_name() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return f"dynamic_kernels-{digest}.so"


def test_the_sdist_carries_the_sources_the_lock_and_the_docs(dist):
    (sdist,) = dist.glob("*.tar.gz")
    assert sdist.name == f"fxdist-{fxdist.__version__}.tar.gz"
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for want in ("pyproject.toml", "setup.py", "requirements.txt", "CHANGELOG.md", "docs/install.md",
                 "scheduling/ps/dynamic_kernels.cpp", "scheduling/ps/dynamic_native.py", "jobs/default.toml"):
        assert want in names, want


def test_the_wheel_carries_the_kernels_and_the_metadata(dist):
    (wheel,) = dist.glob("*.whl")
    assert re.fullmatch(rf"fxdist-{re.escape(fxdist.__version__)}-py3-none-linux_\w+\.whl", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(f"fxdist-{fxdist.__version__}.dist-info/METADATA").decode()
        entry_points = z.read(f"fxdist-{fxdist.__version__}.dist-info/entry_points.txt").decode()
    assert (f"scheduling/ps/{_kernels_name()}" in names) == HAVE_CXX    # the name dynamic_native looks for
    assert {"jobs/default.toml", "scheduling/ps/dynamic_kernels.cpp"} <= names
    assert not any(n.startswith("tests/") for n in names)
    requires = set(re.findall(r"^Requires-Dist: (.+)$", meta, flags=re.MULTILINE))
    assert {"torch>=2.6", "pydot>=3.0"} <= requires
    pinned = [r for r in requires if "==" in r.split(";")[0]]
    assert all(r.startswith("torchmetrics==") for r in pinned), pinned   # ranges (torchmetrics: torchrec 1.8's pin)
    assert set(re.findall(r"^Provides-Extra: (.+)$", meta, flags=re.MULTILINE)) >= {"torchrec", "gpu", "ray", "all"}
    assert "fxdist = jobs.launcher.cli:main" in entry_points and "fuse = quant:fuse" in entry_points


def test_the_lock_pins_every_line_so_it_serves_as_constraints():
    """``pip install -c requirements.txt`` (docs/install.md) accepts only ``name==version``: no extras, no ranges."""
    lines = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    bad = [line for line in lines if line and not re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!-]+", line)]
    assert not bad, f"requirements.txt lines a constraints file refuses: {bad}"


def _fresh_venv(root: Path) -> tuple[Path, Path]:
    """A new virtual environment without pip whose ``sys.path`` ends with the bootstrap's site-packages.
    Returns (its python, its site-packages)."""
    venv = root / "fresh"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=root)
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root)
                .strip())
    (site / "_fxdist_bootstrap_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, site


def test_the_wheel_installs_and_runs_from_a_new_environment(dist, tmp_path):
    (wheel,) = dist.glob("*.whl")
    python, site = _fresh_venv(tmp_path)
    # with its dependencies, offline: the resolver finds each range of the base and of fxdist[all] met by the lock's
    # pinned set (-c requirements.txt), already installed by the bootstrap, so it installs the wheel alone
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "-q", "-c",
          str(ROOT / "requirements.txt"), f"fxdist[all] @ {wheel.as_uri()}"], cwd=tmp_path)
    assert sorted(p.name for p in site.iterdir() if not p.name.startswith(("_", "."))) == [
        "fxdist", f"fxdist-{fxdist.__version__}.dist-info", "jobs", "quant", "recsys", "scheduling"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), CXX="/nonexistent/c++", FXDIST_NATIVE="1",
               PATH=f"{python.parent}{os.pathsep}{env.get('PATH', '')}")
    work = tmp_path / "work"      # not the repository: nothing of it is importable from here
    work.mkdir()

    cli = python.parent / "fxdist"
    assert _run([str(cli), "--version"], cwd=work, env=env).strip() == f"fxdist {fxdist.__version__}"
    assert "--resume" in _run([str(cli), "launch", "--help"], cwd=work, env=env)

    # one process (torch imported once): docs/install.md's example, then where everything came from
    blocks = re.findall(r"^```python\n(.*?)^```", INSTALL_DOC.read_text(), flags=re.MULTILINE | re.DOTALL)
    assert blocks, "docs/install.md has no python example"
    (work / "example.py").write_text(blocks[-1])
    out = _run([str(python), "-c", (
        "import runpy; runpy.run_path('example.py', run_name='__main__')\n"
        "import fxdist, recsys, scheduling, quant, jobs, jobs.launcher.cli\n"
        "import importlib.metadata as md\n"
        "from scheduling.ps.dynamic_native import load\n"
        "lib = load()\n"
        "print('WHERE', md.version('fxdist'), lib._name if lib is not None else None)\n"
        "for m in (fxdist, recsys, scheduling, quant, jobs, jobs.launcher.cli): print('WHERE', m.__file__)\n")],
        cwd=work, env=env)
    assert f"fxdist {fxdist.__version__} ok" in out, out
    where = [w for line in out.splitlines() if line.startswith("WHERE ") for w in line.split()[1:]]
    assert where[0] == fxdist.__version__
    if HAVE_CXX:
        assert where[1] == str(site / "scheduling" / "ps" / _kernels_name()), where  # the wheel's, no compiler run
    assert not (tmp_path / "cache" / "fxdist").exists()                         # nothing compiled
    assert all(Path(f).is_relative_to(site) for f in where[2:]), where


EXTRAS_MODULES = ("torchrec", "fbgemm_gpu", "tensordict", "torchmetrics", "pyre_extensions", "ray", "prometheus_client",
                  "psutil", "tqdm", "matplotlib", "pyarrow", "cryptography", "sklearn", "transformers")
"""What the extras bring (pyproject.toml), by import name: the base install has none of them."""


def test_the_base_install_imports_without_the_extras():
    """pyproject.toml's base dependencies are the truth: ``import fxdist, recsys, scheduling, quant, jobs`` (and
    ``fxdist.passes``, ``fxdist launch --help``) work with every extra's module unimportable."""
    code = (
        "import importlib.abc, sys\n"
        f"BLOCKED = {EXTRAS_MODULES!r}\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ImportError(f'{name} belongs to an extra')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import fxdist, fxdist.passes, recsys, scheduling, quant, jobs\n"
        "from jobs.launcher.cli import main\n"
        "try:\n"
        "    main(['launch', '--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n")
    assert "--resume" in _run([sys.executable, "-c", code], cwd=ROOT)
