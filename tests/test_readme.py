"""The README stays short and points into the docs: at most 150 lines, a runnable example (run by
``tests/test_docs.py`` with the docs' examples), and every relative link names a file the repository holds."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_is_short_and_has_a_runnable_example():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    assert re.search(r"^```python\n.*parameter_servers.*?^```", text, flags=re.MULTILINE | re.DOTALL)
    assert "make job" in text and "make test" in text


def test_the_readme_links_resolve():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert local, "the README links into the docs"
    missing = [link for link in local if not (README.parent / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
