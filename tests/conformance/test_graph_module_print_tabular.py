"""``Graph.print_tabular`` prints torch.fx 2.13's table (both call ``tabulate`` the same way).

Without ``tabulate`` installed torch.fx prints an install hint and raises ImportError; fxdist prints the
same layout from its own formatter (a documented difference), checked here against torch.fx's text.
"""

import sys
from typing import Any

import pytest
import torch
import torch.fx

import fxdist as fx


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)
        self.p = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor, y: int = 3) -> Any:
        z = torch.relu(self.lin(x)) + self.p
        return z.clamp(min=0.0, max=1.0)[0, 1:], y * 2, {"a": z}


def _hand_built(lib: Any) -> Any:
    g = lib.Graph()
    a = g.placeholder("a")
    b = g.call_function(torch.add, (a, 1.5), {"alpha": 2})
    c = g.call_method("view", (b, -1))
    g.output([c, None, "text"])
    return g


GRAPHS = {
    "traced": lambda lib: lib.symbolic_trace(Model()).graph,
    "hand_built": _hand_built,
    "sequential": lambda lib: lib.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh())).graph,
}


def _printed(graph: Any, capsys: pytest.CaptureFixture[str]) -> str:
    graph.print_tabular()
    return capsys.readouterr().out


@pytest.mark.parametrize("build", GRAPHS.values(), ids=GRAPHS.keys())
def test_print_tabular_matches_torch_fx(build: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tabulate", reason="torch.fx's print_tabular needs the tabulate package")
    ours, theirs = _printed(build(fx), capsys), _printed(build(torch.fx), capsys)
    assert ours == theirs
    assert ours.splitlines()[0].split() == ["opcode", "name", "target", "args", "kwargs"]


@pytest.mark.parametrize("build", GRAPHS.values(), ids=GRAPHS.keys())
def test_print_tabular_without_tabulate(build: Any, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tabulate", reason="the reference text comes from torch.fx with tabulate")
    reference = _printed(build(torch.fx), capsys)
    monkeypatch.setitem(sys.modules, "tabulate", None)  # import tabulate now raises ImportError
    assert _printed(build(fx), capsys) == reference
    with pytest.raises(ImportError):
        build(torch.fx).print_tabular()
    assert "pip install tabulate" in capsys.readouterr().out
