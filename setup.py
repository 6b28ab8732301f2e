"""The compiled kernels in the wheel; everything else about the package is in pyproject.toml.

``scheduling/ps/dynamic_kernels.cpp`` is a plain C library (``extern "C"``, no torch or Python headers) that
``scheduling/ps/dynamic_native.py`` loads with ctypes. At run time that module compiles it into a user cache when it
finds a C++ compiler; built here, the wheel carries it, so a node without a compiler runs the kernels too. It is
compiled exactly as the run-time build does it (the same compiler choice and ``FLAGS``, read from
``dynamic_native.py``) under the same name, ``dynamic_kernels-<digest>.so``, the digest being the sha256 of the
source and the flags: ``dynamic_native`` loads the packaged file only when that name matches its own source, so a
stale library is never used. The wheel is tagged ``py3-none-<platform>``: machine code, but no Python ABI.

Without a compiler (or with ``FXDIST_BUILD_KERNELS=0``) the package builds without the library, says so, and the
kernels are compiled at first use where a compiler is found (else torch's code runs: the same results).
"""

from __future__ import annotations

import ast
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
SOURCE = "scheduling/ps/dynamic_kernels.cpp"
KERNELS = "scheduling.ps.dynamic_kernels"


def _flags() -> tuple[str, ...]:
    """``FLAGS`` of scheduling/ps/dynamic_native.py (a literal tuple), read without importing it (it imports torch)."""
    tree = ast.parse((HERE / "scheduling/ps/dynamic_native.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "FLAGS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise RuntimeError("scheduling/ps/dynamic_native.py has no literal FLAGS")


def library_name() -> str:
    """``dynamic_kernels-<digest>.so``, as ``dynamic_native`` names the build of this source with these flags."""
    digest = hashlib.sha256((HERE / SOURCE).read_bytes() + " ".join(_flags()).encode()).hexdigest()[:16]
    return f"dynamic_kernels-{digest}.so"


class BuildKernels(build_ext):
    """build_ext for the one C library: the run-time build's compiler and flags, its file name."""

    def get_ext_filename(self, fullname: str) -> str:
        # called with the dotted name (get_outputs) and with its last part alone (get_ext_fullpath)
        if fullname == KERNELS:
            return os.path.join(*KERNELS.split(".")[:-1], library_name())
        if fullname == KERNELS.rpartition(".")[2]:
            return library_name()
        return super().get_ext_filename(fullname)

    def finalize_options(self) -> None:
        super().finalize_options()
        cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        why = ("pip install -e: the source tree compiles them at first use" if self.editable_mode
               else "FXDIST_BUILD_KERNELS=0" if os.environ.get("FXDIST_BUILD_KERNELS", "1") == "0"
               else None if cxx else "no C++ compiler ($CXX, g++ or c++)")
        if why:   # then there is no such output at all (the editable install copies every output it was told of)
            print(f"fxdist: not building the compiled kernels ({why}); they are compiled at first use where a "
                  "compiler is found, else torch's code runs")
            self.extensions = [e for e in self.extensions if e.name != KERNELS]
        self.cxx = cxx

    def build_extension(self, ext: Extension) -> None:
        if ext.name != KERNELS:
            super().build_extension(ext)
            return
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [self.cxx, *_flags(), "-o", str(out), str(HERE / SOURCE)]
        print("fxdist: building the compiled kernels:", " ".join(cmd))
        subprocess.run(cmd, check=True)


class Wheel(bdist_wheel):
    """Tag ``py3-none-<platform>``: the library is machine code for the platform, but loads in any Python 3."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(
    ext_modules=[Extension(KERNELS, sources=[SOURCE])],
    cmdclass={"build_ext": BuildKernels, "bdist_wheel": Wheel},
)
