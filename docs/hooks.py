"""MkDocs hooks of the docs site (``hooks:`` in mkdocs.yml).

* ``on_files`` adds the generated reference pages (``docs/gen_reference.py``: the job config keys, the command
  line, the Prometheus metrics, the results.json keys, the exceptions) to the site as generated files, so they are
  made from the code at every build and never stored in ``docs/``.
* ``on_config`` and ``on_page_markdown`` put the security pages other engineers write
  (:data:`SECURITY_PAGES`) under "Security" in the navigation and link them from ``security.md`` as soon as each
  file exists; until then the strict build does not fail on a missing page.
* ``on_files`` also adds the pictures of the async split and prefetch (``docs/gen_diagrams.py``: the real graphs
  of a small model before and after the pass, drawn by fxdist's graph drawer with Graphviz) as
  ``concepts/img/*.svg``, so the site needs no diagram script from a CDN.
* ``on_page_markdown`` fills the Benchmarks page's ``<!-- benchmark: NAME -->`` markers with the tables of the
  benchmarks' JSON records in ``benchmarks/results/`` (``docs/gen_benchmarks.py``), and ``on_files`` adds their
  plots (SVG, drawn with matplotlib) as ``assets/benchmarks/*.svg``.
* ``on_page_content`` links an exception's ``See docs/troubleshooting.md#name.`` (the path a user of the
  repository has, which ``fxdist`` also prints) to that section on the reference pages.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gen_benchmarks  # noqa: E402
import gen_diagrams  # noqa: E402
import gen_reference  # noqa: E402

SECURITY_PAGES = {"security-transport.md": "Transports", "security-files-and-exposure.md": "Files and exposure"}


def _security_pages(config: Any) -> dict[str, str]:
    return {name: title for name, title in SECURITY_PAGES.items() if (Path(config["docs_dir"]) / name).is_file()}


def on_config(config: Any) -> Any:
    pages = _security_pages(config)
    for i, item in enumerate(config["nav"] or []):
        if isinstance(item, dict) and item.get("Security") == "security.md" and pages:
            config["nav"][i] = {"Security": [{"Threat model": "security.md"},
                                             *({title: name} for name, title in pages.items())]}
    return config


def on_files(files: Files, config: Any) -> Files:
    for path, text in gen_reference.pages().items():
        files.append(File.generated(config, path, content=text))
    for path, svg in gen_benchmarks.plots().items():
        files.append(File.generated(config, path, content=svg))
    for name, svg in gen_diagrams.diagrams().items():
        files.append(File.generated(config, f"concepts/img/{name}", content=svg))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if page.file.src_uri == "benchmarks.md":
        return gen_benchmarks.render(markdown)
    if page.file.src_uri != "security.md":
        return markdown
    pages = _security_pages(config)
    if not pages:
        return markdown
    links = "\n".join(f"- [{title}]({name})" for name, title in pages.items())
    return f"{markdown}\n\n## More\n\n{links}\n"


_TROUBLESHOOTING = re.compile(r"(?<![\w/\"'])docs/troubleshooting\.md#([a-z0-9_-]+)")


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    target = files.get_file_from_path("troubleshooting.md")
    if not page.file.src_uri.startswith("reference/") or target is None:
        return html
    url = target.url_relative_to(page.file)
    return _TROUBLESHOOTING.sub(lambda m: f'<a href="{url}#{m[1]}">{m[0]}</a>', html)
