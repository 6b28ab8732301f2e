"""Every ``>>>`` example in a public docstring runs and prints what it shows (STYLE.md: examples are doctests)."""

from __future__ import annotations

import doctest
import importlib
import re

import pytest

from tests.test_layout import MODULES


def _modules_with_examples() -> list[str]:
    example = re.compile(r"^\s*>>> ", re.MULTILINE)
    return sorted(name for name, path in MODULES.items() if example.search(path.read_text()))


@pytest.mark.parametrize("name", _modules_with_examples())
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS, verbose=False)
    assert result.attempted > 0, f"{name} shows examples that doctest did not find"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (see output above)"
