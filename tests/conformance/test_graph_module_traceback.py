"""Generated code's file name, line map and error report, differentially against torch.fx 2.13.

torch.fx compiles ``forward`` under the file name ``<eval_with_key>.N from user.py:L in fn`` (registered
in ``linecache``) and, when an exception's innermost frame is a generated line, prints the traceback
plus "Call using an FX-traced Module, line X of the traced Module's generated forward function:" with
the surrounding generated lines to stderr, then re-raises the exception without its traceback.
fxdist numbers its files ``<eval_with_key>.fxdist.N``: torch.fx's ``<eval_with_key>.N`` names live in the
same ``linecache``, and a shared name made torch.jit.script compile the other library's source.
"""

import operator
import re
import traceback
from typing import Any

import pytest
import torch
import torch.fx

import fxdist as fx

_KEY = re.compile(r"<eval_with_key>\.(fxdist\.)?\d+")  # fxdist's N is fxdist.N (no clash with torch.fx's)


class Net(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x + 1)
        return torch.mm(y, y).sum()


def bad_shapes(x: torch.Tensor) -> torch.Tensor:
    y = torch.relu(x + 1)
    return torch.mm(y, y).sum()


def _filename(gm: Any) -> str:
    return type(gm).forward.__code__.co_filename


@pytest.mark.parametrize("root", [Net(), bad_shapes], ids=["module", "function"])
def test_co_filename_names_user_source_like_torch_fx(root: Any) -> None:
    ours, theirs = fx.symbolic_trace(root), torch.fx.symbolic_trace(root)
    assert _KEY.sub("KEY", _filename(ours)) == _KEY.sub("KEY", _filename(theirs))
    assert re.fullmatch(rf"<eval_with_key>\.fxdist\.\d+ from {re.escape(__file__)}:\d+ in (forward|bad_shapes)",
                        _filename(ours))
    assert ours._lineno_map == theirs._lineno_map
    assert ours._prologue_start == theirs._prologue_start


def test_hand_built_graph_has_plain_key() -> None:
    g = fx.Graph()
    g.output(g.call_function(torch.neg, (g.placeholder("x"),)))
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert re.fullmatch(r"<eval_with_key>\.fxdist\.\d+", _filename(gm))


def test_lineno_map_maps_generated_lines_to_nodes() -> None:
    gm = fx.symbolic_trace(bad_shapes)
    nodes = list(gm.graph.nodes)
    lines = gm.code.splitlines()
    for rel, index in gm._lineno_map.items():
        text = lines[rel + gm._prologue_start - 1].strip()
        node = nodes[index]
        if node.op not in ("placeholder", "output"):
            assert text.startswith(f"{node.name} = "), (rel, text, node.name)
    assert lines[gm._prologue_start - 1].startswith("def forward(")


def _failure(lib: Any, capsys: pytest.CaptureFixture[str]) -> tuple[BaseException, str]:
    gm = lib.symbolic_trace(bad_shapes)
    with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
        gm(torch.randn(2, 3))
    return info.value, capsys.readouterr().err


def test_error_in_generated_line_prints_torch_fx_report(capsys: pytest.CaptureFixture[str]) -> None:
    (ours, ours_err), (theirs, theirs_err) = _failure(fx, capsys), _failure(torch.fx, capsys)
    assert type(ours) is type(theirs) and str(ours) == str(theirs)
    marker = "Call using an FX-traced Module, line "
    assert marker in ours_err
    # The report after the traceback is the same text: line number, context lines, ~~~ marker.
    assert ours_err[ours_err.index(marker):] == theirs_err[theirs_err.index(marker):]
    assert "~~~ <--- HERE" in ours_err and "mm = torch.mm(relu, relu)" in ours_err
    # The printed traceback ends with the same generated frame and error line.
    tail = [_KEY.sub("KEY", e).split('File "KEY', 1)[1] for e in (ours_err, theirs_err)]
    assert tail[0] == tail[1]
    # Both re-raise without the generated frames (the traceback was printed instead).
    for exc in (ours, theirs):
        assert not any("eval_with_key" in f.filename for f in traceback.extract_tb(exc.__traceback__))


def test_error_outside_generated_code_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    for lib in (fx, torch.fx):
        gm = lib.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        with pytest.raises(RuntimeError) as info:
            gm(torch.randn(2, 5))
        assert capsys.readouterr().err == ""
        # the traceback is kept: its frames reach the generated forward
        assert any("eval_with_key" in f.filename for f in traceback.extract_tb(info.value.__traceback__))


def test_file_names_never_clash_with_torch_fx() -> None:
    """Interleaved fxdist and torch.fx modules each keep their own source in linecache."""
    import linecache

    pairs = []
    for i in range(3):
        for lib in (fx, torch.fx):
            g = lib.Graph()
            g.output(g.call_function(operator.add, (g.placeholder("x"), i)))
            gm = lib.GraphModule(torch.nn.Module(), g)
            pairs.append((gm, f"add = x + {i}"))
    names = [_filename(gm) for gm, _ in pairs]
    assert len(set(names)) == len(names)
    for gm, line in pairs:
        assert line in "".join(linecache.getlines(_filename(gm)))
        assert torch.jit.script(gm)(torch.zeros(1)).item() == int(line[-1])


def test_subclass_call_is_wrapped_like_torch_fx(capsys: pytest.CaptureFixture[str]) -> None:
    """A GraphModule subclass's own ``__call__`` runs, and errors in generated lines are still reported."""
    for lib in (fx, torch.fx):
        class Doubling(lib.GraphModule):  # type: ignore[name-defined, misc]
            def __call__(self, *args: Any) -> Any:
                return super().__call__(*args) * 2

        traced = lib.symbolic_trace(bad_shapes)
        gm = Doubling(traced, traced.graph)
        torch.testing.assert_close(gm(torch.ones(2, 2)), bad_shapes(torch.ones(2, 2)) * 2)
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            gm(torch.ones(2, 3))
        assert "Call using an FX-traced Module" in capsys.readouterr().err
