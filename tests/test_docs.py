"""Executable docs: every runnable Python block of the README and of the docs' Getting started, Tutorials and
Concepts pages runs as printed (each in a fresh namespace, as a script), so a page whose example breaks fails here.

Which blocks run: those fenced ```` ```python ```` (see ``tests/_docs_site.py``); blocks that need Ray, CUDA or
minutes are fenced ```` ```py ```` or ```` ```console ```` and are not run. Blocks that train on parameter servers
start their own ``LocalCluster`` (local server processes), so none needs data or a cluster from outside; a block
printed twice (the README's example is also Getting started's) runs once.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests._docs_site import DOCS, ROOT, runnable_blocks

PAGES = [ROOT / "README.md", *sorted((DOCS / "getting-started").glob("*.md")),
         *sorted((DOCS / "tutorials").glob("*.md")), *sorted((DOCS / "concepts").glob("*.md"))]


def _blocks() -> list[tuple[str, str]]:
    seen: set[str] = set()
    blocks = []
    for page in PAGES:
        for i, block in enumerate(runnable_blocks(page)):
            if block not in seen:
                seen.add(block)
                blocks.append((f"{page.relative_to(ROOT)}#{i}", block))
    return blocks


BLOCKS = _blocks()


def test_the_pages_have_runnable_examples():
    codes = [b for _, b in BLOCKS]
    assert len(codes) >= 5, [name for name, _ in BLOCKS]
    assert any("parameter_servers" in b for b in codes) and any("next_sparse_features=" in b for b in codes)
    assert runnable_blocks(ROOT / "README.md"), "the README keeps a runnable example"
    for page in ("getting-started/your-model.md", "tutorials/ps-model.md"):
        assert runnable_blocks(DOCS / page), f"{page} has no runnable example"


@pytest.mark.parametrize("name,block", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_docs_python_block_runs(name: str, block: str, capsys, monkeypatch):
    import scheduling.placement
    from scheduling.ps.client import PSClient

    created: list[PSClient] = []   # a LocalCluster closes its clients with it: keep them to read their counters
    init = PSClient.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        created.append(self)

    monkeypatch.setattr(PSClient, "__init__", recording_init)
    read_back: list[dict] = []   # what placement.table_state_dict returned: the tables the servers trained
    table_state_dict = scheduling.placement.table_state_dict

    def recording_table_state_dict(gm, *args, **kwargs):
        read_back.append(table_state_dict(gm, *args, **kwargs))
        return read_back[-1]

    monkeypatch.setattr(scheduling.placement, "table_state_dict", recording_table_state_dict)
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(block, f"{name} (python block)", "exec"), namespace)
        out = capsys.readouterr().out
        if "print(sorted(placement.table_state_dict(gm)))" in block:  # the tutorial's two tables
            assert "['item.weight', 'user.weight']" in out and "parameter_servers plan: 2 tables" in out
            assert {c.prefetch_hits for c in created} == {9}  # steps 2..10 prefetched
        if "next_sparse_features=" in block:  # torchrec's DLRM: 4 tables, 2 on each server
            assert {c.prefetch_hits for c in created} == {2 * 4}  # steps 2..5
        if "next_input=" in block:  # the 20-line example: one table, 20 steps, steps 2..20 prefetched
            assert {c.prefetch_hits for c in created} == {19} and "trained 20 steps" in out
            # then the trained table is back in the model, which predicts without the servers: 2 probabilities
            assert len(read_back) == 1 and torch.equal(namespace["model"][0].weight, read_back[0]["0.weight"])
            assert re.search(r"^tensor\(\[0\.\d+, 0\.\d+\]\)$", out, re.M), out
    finally:  # clients a block left open outside a LocalCluster
        for client in created:
            client.close(flush=False)


def test_page_paths_exist():
    assert all(Path(p).is_file() for p in PAGES)
