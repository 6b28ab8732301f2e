"""The README's Python examples run exactly as printed (each block in a fresh namespace, as a script).

Blocks that train on parameter servers start their own ``LocalCluster`` (two local server processes), so none
needs data or a cluster from outside.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.MULTILINE | re.DOTALL)


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 3
    assert any("parameter_servers" in b for b in BLOCKS) and any("next_sparse_features=" in b for b in BLOCKS)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, capsys, monkeypatch):
    from scheduling.ps.client import PSClient

    created: list[PSClient] = []   # a LocalCluster closes its clients with it: keep them to read their counters
    init = PSClient.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        created.append(self)

    monkeypatch.setattr(PSClient, "__init__", recording_init)
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), namespace)
        out = capsys.readouterr().out
        if "table_state_dict" in BLOCKS[index]:
            assert "['item.weight', 'user.weight']" in out and "parameter_servers plan: 2 tables" in out
            assert {c.prefetch_hits for c in created} == {9}  # steps 2..10 prefetched
        if "next_sparse_features=" in BLOCKS[index]:  # torchrec's DLRM: 4 tables, 2 on each server
            assert {c.prefetch_hits for c in created} == {2 * 4}  # steps 2..5
    finally:  # clients a block left open outside a LocalCluster
        for client in created:
            client.close(flush=False)
