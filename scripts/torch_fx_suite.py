"""Run PyTorch's own FX tests (``test/test_fx.py`` and the ``test/fx/`` files it imports) against fxdist.

The test files are public PyTorch code: they are read from a checkout outside this repository (never copied
into it) and run by pytest in this process, with the FX names they import resolved to fxdist.

Scheme (nothing is written to disk; all of it lives in this runner process only, and only in the test files):

- A meta-path finder claims the modules whose files lie under the test folder (``test_fx.py``, the
  ``fx/test_*.py`` helpers it imports) and executes each with its own ``__builtins__``, whose ``__import__``
  resolves ``torch.fx[.sub]`` (and ``pippy.fx[.sub]``, the name PiPPy's vendored copy of the tests uses) to
  ``fxdist[.sub]``: ``from torch.fx import Graph`` in a test file binds fxdist's ``Graph``. A name or submodule
  fxdist does not provide (``_compatibility``, ``operator_schemas``, ``experimental.rewriter``,
  ``experimental.const_fold``...) resolves to torch.fx's own, so the file still imports; tests that use it
  then exercise torch.fx (or torch.fx's code on fxdist graphs).
- ``import torch`` in a test file binds a stand-in whose ``fx`` attribute is fxdist (same fallback) and whose
  other attributes are torch's, so ``torch.fx.Graph()`` and ``torch.fx.proxy.TracerBase`` in a test body are
  fxdist's too. ``sys.modules`` is untouched: torch's own internals (dynamo, export, jit, ao) keep torch.fx.
- A partial copy of ``test/fx/`` runs too: an ``fx.<helper>`` module whose file is absent is a stand-in whose
  classes (the names ``test_fx.py`` imports) report one skipped test each, naming the missing file.
- ``--torch-fx`` resolves the same names to torch.fx itself: the reference run, to tell fxdist's failures
  from tests that fail on this torch version anyway.
- ``SKIPS`` below lists tests of torch-only machinery fxdist deliberately does not reimplement, each with a
  reason; they are reported as skipped.

Run: ``PYTHONPATH=$PWD .venv/bin/python scripts/torch_fx_suite.py /path/to/pytorch/test [-k EXPR]
[--junitxml out.xml] [pytest args...]``. The argument is a ``test/`` folder (``test_fx.py`` in it is run) or
test files. Prints pytest's summary line and the pass/fail/skip counts.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

PREFIXES = ("torch.fx", "pippy.fx")

# test id substring -> reason. Small and explicit: torch-only machinery fxdist does not reimplement.
SKIPS: dict[str, str] = {
    "TestFXAPIBackwardCompatibility": "checks torch.fx's own @compatibility registry and signature files",
    "test_public_api_surface": "walks torch.fx's @compatibility registry",
    "TestOperatorSignatures": "torch.fx.operator_schemas (not part of fxdist)",
    "AnnotationsTest": "torch.fx.experimental gradual typing (torch-only): its checks require torch.fx Nodes",
    "TypeCheckerTest": "torch.fx.experimental gradual typing (torch-only): its checks require torch.fx Nodes",
    "test_const_fold_tensor_meta": "torch.fx.experimental.const_fold retraces an fxdist module with torch.fx: meta is not carried",
    "test_retain_node_meta": "torch.fx.experimental.const_fold retraces an fxdist module with torch.fx: meta is not carried",
    "test_imul_code_print": "deliberate difference: fxdist prints `imul = a;  imul *= b` (README)",
}


# ``fx/`` helper files ``test_fx.py`` imports test classes from, when the checkout lacks them (a partial copy of
# the tests): each such ``fx.<name>`` module is a stand-in whose classes report one skipped test with this reason.
HELPER_MISSING = "helper file not in this copy of test/fx/ (its tests are not run)"


# Modules an older copy of the tests imports that torch 2.13 renamed: old name -> current name.
RENAMED = {"torch.nn.utils._stateless": "torch.nn.utils.stateless"}
# Names an older copy of the tests imports from torch modules that dropped or renamed them.
MISSING = {"torch.fx._compatibility": {"_MARKED_WITH_COMATIBLITY": "_MARKED_WITH_COMPATIBILITY"}}
# Names a newer copy of the tests imports that this torch does not have yet: module -> name -> stand-in.
# ``HardwareClassification`` (fx/test_source_matcher_utils.py) only labels the test class.
NEWER = {"torch.testing._internal.common_utils": {"HardwareClassification": lambda: enum.Enum(
    "HardwareClassification", ["GENERIC"])}}


class _Alias:
    """Resolve ``torch.fx[.sub]`` / ``pippy.fx[.sub]`` to ``fxdist[.sub]`` (torch.fx's own where fxdist lacks it)."""

    backend = "fxdist"  # "torch.fx": the reference run, same files on torch.fx itself

    def resolve(self, name: str, fromlist=()) -> types.ModuleType:
        prefix = next(p for p in PREFIXES if name == p or name.startswith(p + "."))
        sub = name[len(prefix):]
        try:
            importlib.import_module(self.backend + sub)
            target = self.backend + sub
        except ModuleNotFoundError:
            target = "torch.fx" + sub
        if target.startswith("torch."):
            return __import__(target, fromlist=fromlist or ("__name__",))
        module = importlib.import_module(target)
        missing = []
        for child in fromlist or ():
            if not hasattr(module, child):
                try:
                    importlib.import_module(f"{target}.{child}")
                except ModuleNotFoundError:
                    missing.append(child)
        if not missing:
            return module
        merged = types.ModuleType(module.__name__)  # fxdist's names, torch.fx's for those fxdist lacks
        merged.__dict__.update(vars(module))
        real = importlib.import_module("torch.fx" + sub)
        for child in missing:
            try:
                setattr(merged, child, getattr(real, child))
            except AttributeError:
                setattr(merged, child, importlib.import_module(f"torch.fx{sub}.{child}"))
        return merged


class _HelperStandIn(types.ModuleType):
    """``fx.<helper>`` for a helper file the copy lacks: each class name it is asked for is a skipped TestCase."""

    def __getattr__(self, name: str):
        import unittest

        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (unittest.TestCase,), {"test_helper_missing": lambda self: None})
        cls = unittest.skip(f"{self.__name__}: {HELPER_MISSING}")(cls)
        setattr(self, name, cls)
        return cls


class _HelperFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Claim ``fx.<name>`` when ``<root>/fx/<name>.py`` is absent: load an ``_HelperStandIn``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, name, path=None, target=None):
        parts = name.split(".")
        if len(parts) != 2 or parts[0] != "fx" or (self.root / "fx" / f"{parts[1]}.py").exists():
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return _HelperStandIn(spec.name)

    def exec_module(self, module) -> None:
        return None


class _TestLoader(importlib.machinery.SourceFileLoader):
    """Execute a test file with a ``__builtins__`` whose ``__import__`` applies the alias."""

    builtins: dict = {}

    def exec_module(self, module) -> None:
        module.__builtins__ = self.builtins
        super().exec_module(module)


class _TestFinder(importlib.abc.MetaPathFinder):
    """Claim the modules whose files lie under the test folder; load them with ``_TestLoader``."""

    def __init__(self, root: Path, builtins_dict: dict) -> None:
        self.root = root
        self.builtins = builtins_dict

    def find_spec(self, name, path=None, target=None):
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            return None
        if not Path(spec.origin).resolve().is_relative_to(self.root):
            return None
        loader = _TestLoader(name, spec.origin)
        loader.builtins = self.builtins
        return importlib.util.spec_from_file_location(
            name, spec.origin, loader=loader, submodule_search_locations=spec.submodule_search_locations)


class _FxStandIn(types.ModuleType):
    """``torch.fx`` as the test bodies see it: fxdist's names, torch.fx's submodules fxdist lacks."""

    def __init__(self, alias: _Alias) -> None:
        super().__init__("torch.fx")
        self._alias = alias
        self._fxdist = importlib.import_module(alias.backend)

    def __getattr__(self, name: str):
        try:
            value = getattr(self._fxdist, name)
        except AttributeError:
            return self._alias.resolve("torch.fx." + name)
        return _SubStandIn(value, "torch.fx." + name) if isinstance(value, types.ModuleType) else value


class _SubStandIn(types.ModuleType):
    """A submodule seen through ``torch.fx.<sub>`` in a test body: its names, else torch.fx's (``experimental._config``)."""

    def __init__(self, module: types.ModuleType, torch_name: str) -> None:
        super().__init__(module.__name__)
        self._module = module
        self._torch_name = torch_name

    def __getattr__(self, name: str):
        try:
            value = getattr(self._module, name)
        except AttributeError:
            try:
                value = importlib.import_module(f"{self._module.__name__}.{name}")
            except ModuleNotFoundError:
                try:
                    return getattr(importlib.import_module(self._torch_name), name)
                except AttributeError:
                    return importlib.import_module(f"{self._torch_name}.{name}")
        if isinstance(value, types.ModuleType):
            return _SubStandIn(value, f"{self._torch_name}.{name}")
        return value


class _TorchStandIn(types.ModuleType):
    """``torch`` with ``fx`` replaced by the fxdist stand-in; every other attribute is torch's."""

    def __init__(self, fx: types.ModuleType) -> None:
        super().__init__("torch")
        self.fx = fx

    def __getattr__(self, name: str):
        import torch

        return getattr(torch, name)


def _make_builtins(alias: _Alias) -> dict:
    """A copy of ``builtins`` whose ``__import__`` gives test files fxdist for ``torch.fx`` / ``pippy.fx``."""
    import builtins

    real_import = builtins.__import__
    torch_standin = _TorchStandIn(_FxStandIn(alias))
    pippy_standin = types.ModuleType("pippy")
    pippy_standin.fx = torch_standin.fx

    def alias_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and (name == "pippy" or name.startswith("pippy.")):
            return alias.resolve(name, fromlist) if fromlist else pippy_standin
        if level == 0 and (name == "torch" or name.startswith("torch.")):
            if fromlist and any(name == p or name.startswith(p + ".") for p in PREFIXES):
                return alias.resolve(name, fromlist)
            module = real_import(name, globals, locals, fromlist, level)
            return module if fromlist and name != "torch" else torch_standin
        return real_import(name, globals, locals, fromlist, level)

    table = dict(vars(builtins))
    table["__import__"] = alias_import
    return table


class _Plugin:
    def __init__(self, root: Path, backend: str) -> None:
        alias = _Alias()
        alias.backend = backend
        self.finder = _TestFinder(root, _make_builtins(alias))
        self.helpers = _HelperFinder(root)
        self.counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}

    def pytest_sessionstart(self, session) -> None:
        sys.meta_path.insert(0, self.finder)
        sys.meta_path.append(self.helpers)

    def pytest_collection_modifyitems(self, session, config, items) -> None:
        import pytest

        for item in items:
            for key, reason in SKIPS.items():
                if key in item.nodeid:
                    item.add_marker(pytest.mark.skip(reason=reason))

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            outcome = "error" if report.when == "setup" and report.failed else report.outcome
            self.counts[outcome] += 1


def main(argv: list[str] | None = None) -> int:
    """Run the chosen PyTorch FX test files on fxdist; return pytest's exit code.

    Raises:
        SystemExit: bad command-line arguments (argparse).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="a PyTorch test/ folder, or test files")
    parser.add_argument("--torch-fx", action="store_true",
                        help="reference run: resolve the FX names to torch.fx itself (version-skew failures show here too)")
    args, rest = parser.parse_known_args(argv)
    files = []
    for p in map(Path, args.paths):
        files.append(str(p / "test_fx.py") if p.is_dir() else str(p))
    root = Path(files[0]).resolve().parent
    sys.path.insert(0, str(root))  # test_fx.py imports ``fx.test_*`` helpers from its folder
    for old, new in RENAMED.items():
        sys.modules.setdefault(old, importlib.import_module(new))
    for module_name, names in MISSING.items():
        module = importlib.import_module(module_name)
        for old, new in names.items():
            if not hasattr(module, old):
                setattr(module, old, getattr(module, new, {}))
    for module_name, stand_ins in NEWER.items():
        try:  # torch.testing._internal needs expecttest; test files that import it then fail on their own
            module = importlib.import_module(module_name)
        except ImportError as e:
            print(f"fxdist torch_fx_suite: {module_name} not importable ({e}); its stand-ins are not set")
            continue
        for name, make in stand_ins.items():
            if not hasattr(module, name):
                setattr(module, name, make())
    import pytest

    plugin = _Plugin(root, "torch.fx" if args.torch_fx else "fxdist")
    code = pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(root), *files, *rest], plugins=[plugin])
    print("fxdist torch_fx_suite:", ", ".join(f"{k} {v}" for k, v in plugin.counts.items()))
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
