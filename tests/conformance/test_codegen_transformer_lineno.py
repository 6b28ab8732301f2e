"""``Graph.on_generate_code`` transformers keep ``GraphModule._lineno_map``, shifted as torch.fx shifts it.

A transformer written for torch.fx returns lines that end in a newline (``insert_pdb`` in torch.fx's
docstring: ``["import pdb; pdb.set_trace()\\n", *body]``). fxdist must print the same code (no blank line
per added line) and map each line to the same node: added lines before the first statement to None, the
statements to their nodes, a line appended after the last statement to the output node.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import nn

import fxdist as fx


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        y = self.lin(x) + 1
        return y.relu()


def prefix(body):
    return ["_ = 'start'\n", "_ = 'second'\n", *body]


def suffix(body):
    return [*body, "_ = 'after return'\n"]


def both(body):
    return prefix(suffix(body))


def _traced(lib, transformer):
    gm = lib.symbolic_trace(Small())
    gm.graph.on_generate_code(lambda previous: transformer)
    gm.recompile()
    return gm


@pytest.mark.parametrize("transformer", [prefix, suffix, both])
def test_transformed_code_and_line_map_match_torch_fx(transformer):
    ours, theirs = _traced(fx, transformer), _traced(torch.fx, transformer)
    plain = fx.symbolic_trace(Small())
    assert ours.code.replace("self._modules['lin']", "self.lin") == theirs.code
    assert "\n    \n" not in ours.code.rstrip()  # no stray blank line for the added lines
    assert ours._lineno_map == theirs._lineno_map
    added = 2 if transformer in (prefix, both) else 0
    assert len(ours._lineno_map) == len(plain._lineno_map) + added + (transformer is not prefix)
    x = torch.randn(2, 4)
    torch.testing.assert_close(ours(x), ours.lin(x).add(1).relu())


def test_context_manager_restores_the_previous_transformer():
    for lib in (fx, torch.fx):
        gm = lib.symbolic_trace(Small())
        before = dict(gm._lineno_map)
        with gm.graph.on_generate_code(lambda previous: prefix):
            gm.recompile()
            assert gm._lineno_map[1] is None and gm._lineno_map[3] == before[1]
        gm.recompile()
        assert gm._lineno_map == before
