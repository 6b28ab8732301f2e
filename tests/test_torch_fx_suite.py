"""scripts/torch_fx_suite.py on a made-up test folder: inside the test files ``torch.fx`` is fxdist, outside
(torch's own modules, this process) it stays torch.fx; the skip list and the counts line work."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TEST_FILE = '''
import unittest
import torch
import torch.fx
from torch.fx import Graph, symbolic_trace
from torch.fx.node import Node
import pippy.fx


class TestAlias(unittest.TestCase):
    def test_names_are_fxdist(self):
        import fxdist, fxdist.node
        assert Graph is fxdist.Graph and Node is fxdist.node.Node and symbolic_trace is fxdist.symbolic_trace
        assert torch.fx.Graph is fxdist.Graph and pippy.fx.Graph is fxdist.Graph
        assert torch.fx.proxy.TracerBase is fxdist.proxy.TracerBase

    def test_torch_itself_keeps_torch_fx(self):
        import sys
        assert sys.modules["torch.fx"].__name__ == "torch.fx"
        assert sys.modules["torch"].fx.Graph is not Graph

    def test_imul_code_print(self):
        raise AssertionError("listed in SKIPS, never runs")

    def test_fails(self):
        assert False
'''


def test_runner_aliases_torch_fx_in_test_files_only(tmp_path):
    (tmp_path / "test_fx.py").write_text(textwrap.dedent(TEST_FILE))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "torch_fx_suite.py"), str(tmp_path), "-p", "no:randomly"],
        capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert "fxdist torch_fx_suite: passed 2, failed 1, skipped 1, error 0" in proc.stdout, proc.stdout[-3000:]
    assert proc.returncode == 1
