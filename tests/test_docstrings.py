"""Public functions that raise say so: at least 90 % of them have a ``Raises:`` section (so a caller knows what to catch).

"Public": a function or method whose name has no leading underscore (``__init__`` and ``__call__`` count), in a
public class, in a module with no private path segment, under fxdist/, recsys/, scheduling/, quant/ and jobs/.
"Raises": its own body has a ``raise X`` statement (a bare re-raise and the raises of nested functions do not
count). A ``Raises:`` section in the function's docstring counts, and for ``__init__`` also in its class's. The
functions still missing one are printed, so the next edit knows where to look. Parsed with ``ast``; nothing is
imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fxdist", "recsys", "scheduling", "quant", "jobs")
REQUIRED_SHARE = 0.9


def _own_raises(fn: ast.AST) -> bool:
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Raise) and node.exc is not None:
            return True
        stack.extend(ast.iter_child_nodes(node))
    return False


def raising_functions(source: str, where: str) -> list[tuple[str, bool]]:
    """``(where:line qualified_name, documented)`` for each public function of ``source`` that raises."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, prefix: str, class_doc: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if child.name.startswith("_") and child.name not in ("__init__", "__call__"):
                    continue
                if _own_raises(child):
                    doc = (ast.get_docstring(child) or "") + (class_doc if child.name == "__init__" else "")
                    found.append((f"{where}:{child.lineno} {prefix}{child.name}", "Raises:" in doc))
            elif isinstance(child, ast.ClassDef) and not child.name.startswith("_"):
                visit(child, f"{prefix}{child.name}.", ast.get_docstring(child) or "")

    visit(ast.parse(source), "", "")
    return found


def _public_modules() -> list[Path]:
    return [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
            if not any(p.startswith("_") and p != "__init__" for p in path.relative_to(ROOT).with_suffix("").parts)]


def test_the_checker_sees_raises_and_their_sections():
    source = '''
def documented(x):
    """Doc.

    Raises:
        ValueError: bad x.
    """
    raise ValueError(x)

def undocumented(x):
    """Doc."""
    if x:
        raise KeyError(x)

def reraises():
    try:
        pass
    except OSError:
        raise

def nested():
    def inner():
        raise TypeError
    return inner

def _private():
    raise ValueError

class Thing:
    """A thing.

    Raises:
        TypeError: from the constructor.
    """

    def __init__(self):
        raise TypeError

    def method(self):
        raise RuntimeError
'''
    assert raising_functions(source, "m.py") == [("m.py:2 documented", True), ("m.py:10 undocumented", False),
                                                 ("m.py:36 Thing.__init__", True), ("m.py:39 Thing.method", False)]


def test_at_least_90_percent_of_public_raising_functions_document_their_raises():
    found = [f for path in _public_modules()
             for f in raising_functions(path.read_text(), str(path.relative_to(ROOT)))]
    missing = [name for name, documented in found if not documented]
    share = 1 - len(missing) / len(found)
    assert len(found) > 100  # the walk found the packages' functions
    assert share >= REQUIRED_SHARE, f"{share:.1%} of {len(found)} document their raises; missing:\n" + "\n".join(missing)
