"""Shared helpers of the docs tests: the repository's Markdown pages, their runnable blocks, the built site.

Runnable blocks: a fence opened by exactly ```` ```python ```` is run by ``tests/test_docs.py``; a block that must
not run here (it needs Ray, CUDA or minutes) is fenced ```` ```py ```` (with a ``title="..."`` saying why),
```` ```console ````, ```` ```toml ```` or ```` ```text ````.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SITE = ROOT / "build" / "site"
RUNNABLE = re.compile(r"^```python\n(.*?)^```", flags=re.MULTILINE | re.DOTALL)


def runnable_blocks(path: Path) -> list[str]:
    """The runnable Python blocks of a Markdown file, in order."""
    return RUNNABLE.findall(path.read_text())


def built_site() -> Path:
    """``build/site`` as ``make docs`` leaves it; built here (strict) when absent or older than a docs source or
    a benchmark record (``benchmarks/results/*.json``)."""
    sources = [ROOT / "mkdocs.yml", ROOT / "SECURITY.md", *DOCS.rglob("*"),
               *(ROOT / "benchmarks" / "results").glob("*.json")]   # the Benchmarks page's records
    newest = max(p.stat().st_mtime for p in sources if p.is_file())
    index = SITE / "index.html"
    if not index.is_file() or index.stat().st_mtime < newest:
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
        subprocess.run([sys.executable, "-m", "mkdocs", "build", "--quiet", "-f", str(ROOT / "mkdocs.yml")],
                       cwd=ROOT, env=env, check=True, timeout=300)
    return SITE
