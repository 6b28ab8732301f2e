"""MkDocs hooks of the docs site (``hooks:`` in mkdocs.yml).

``on_files`` adds the generated reference pages (``docs/gen_reference.py``: the job config keys, the command
line, the Prometheus metrics, the results.json keys) to the site as generated files, so they are made from the
code at every build and never stored in ``docs/``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gen_reference  # noqa: E402


def on_files(files: Files, config: Any) -> Files:
    for path, text in gen_reference.pages().items():
        files.append(File.generated(config, path, content=text))
    return files
