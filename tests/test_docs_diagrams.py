"""The pictures of the "Async split and prefetch" page (``docs/gen_diagrams.py``, added to the site by
``docs/hooks.py``): drawn from the real passes at build time, cached by the sources' digest, and a placeholder
that says why where Graphviz is missing. The drawing itself is checked on the built site (``make docs``; built
here when missing or stale, as ``tests/test_docs_site.py`` does)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests._docs_site import DOCS, built_site

sys.path.insert(0, str(DOCS))

import gen_diagrams  # noqa: E402


def test_without_graphviz_each_picture_says_why(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(gen_diagrams.shutil, "which", lambda name: None)
    pictures = gen_diagrams.diagrams(cache=tmp_path)
    assert set(pictures) == set(gen_diagrams.NAMES)
    assert all(svg.startswith("<svg") and "apt-get install graphviz" in svg for svg in pictures.values())
    assert list(tmp_path.iterdir()) == []  # nothing drawn, nothing cached


def test_unchanged_sources_reuse_the_cache_and_a_failed_drawing_raises(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(gen_diagrams.shutil, "which", lambda name: "/usr/bin/dot")
    folder = tmp_path / gen_diagrams.sources_digest()[:16]
    folder.mkdir()
    for name in gen_diagrams.NAMES:
        (folder / name).write_text(f"<svg>{name}</svg>")
    assert gen_diagrams.diagrams(cache=tmp_path) == {n: f"<svg>{n}</svg>" for n in gen_diagrams.NAMES}
    # another digest: drawn again, by a child that fails here (no such interpreter)
    monkeypatch.setattr(gen_diagrams, "sources_digest", lambda: "0" * 64)
    monkeypatch.setattr(gen_diagrams, "__file__", str(tmp_path / "missing.py"))
    with pytest.raises(RuntimeError, match="gen_diagrams.py exited with"):
        gen_diagrams.diagrams(cache=tmp_path)


def test_the_digest_follows_the_passes_source():
    assert re.fullmatch(r"[0-9a-f]{64}", gen_diagrams.sources_digest())
    assert gen_diagrams.sources_digest() == gen_diagrams.sources_digest()


def test_the_built_page_shows_the_real_graphs_before_and_after_the_pass():
    if gen_diagrams.shutil.which("dot") is None:
        pytest.skip("Graphviz's dot is not installed (scripts/bootstrap.sh adds it): the pictures are placeholders")
    site = built_site()
    page = (site / "concepts" / "async-prefetch" / "index.html").read_text()
    assert "mermaid" not in page
    assert 'src="../img/async-before.svg"' in page and 'src="../img/async-after.svg"' in page
    before = (site / "concepts" / "img" / "async-before.svg").read_text()
    after = (site / "concepts" / "img" / "async-after.svg").read_text()
    assert "ps_lookup" in before and "ps_lookup_start" not in before and 'stroke="#cd0000"' not in before
    for name in ("ps_lookup_start", "ps_lookup_wait", "next_users", "next_items", "next_kjt"):
        assert name in after, name

    def position(svg: str, name: str) -> int:
        found = re.search(rf"#(\d+) %{name}<", svg)
        assert found, name
        return int(found.group(1))

    # the hoist: both lookups start before the bottom layer runs, and each wait comes after its start
    assert max(position(after, "ps_lookup_start"), position(after, "ps_lookup_start_1")) < position(after, "bottom")
    assert position(after, "ps_lookup_wait") > position(after, "ps_lookup_start")
    assert 'stroke="#cd0000"' in after  # the pass's nodes are outlined (red3)
