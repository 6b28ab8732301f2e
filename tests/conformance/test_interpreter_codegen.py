"""Interpreter and Transformer with custom CodeGens, and ``boxed_run``'s argument check, against torch.fx.

torch.fx calls ``CodeGen.generate_output``/``gen_fn_def`` with only the keyword arguments an override's
signature names, so CodeGens written with or without ``repr_fn``/``descs`` work; the Interpreter runs
the graph through ``process_inputs``/``process_outputs`` and the Transformer keeps the codegen.
"""

from typing import Any

import pytest
import torch
import torch.fx

import fxdist as fx


def _codegens(lib: Any) -> dict[str, type]:
    class DictOut(lib.CodeGen):
        """Overrides generate_output with torch.fx 2.13's full signature."""

        def generate_output(self, output_args: Any, *, descs: Any = None, repr_fn: Any = None) -> str:
            repr_fn = repr if repr_fn is None else repr_fn
            return f"return {{'out': {repr_fn(output_args)}}}"

        def process_outputs(self, outputs: Any) -> Any:
            return {"out": outputs}

    class ReprOnly(lib.CodeGen):
        """Overrides generate_output with repr_fn only, and calls the base implementation."""

        def generate_output(self, output_args: Any, *, repr_fn: Any = None) -> str:
            return super().generate_output([output_args], repr_fn=repr_fn)

        def process_outputs(self, outputs: Any) -> Any:
            return [outputs]

    class Plain(lib.CodeGen):
        """An override from before repr_fn existed."""

        def generate_output(self, output_args: Any) -> str:
            return f"return ({output_args!r},)"

        def process_outputs(self, outputs: Any) -> Any:
            return (outputs,)

    class ListIn(lib.CodeGen):
        """Inputs as one list (process_inputs) and a typed signature (gen_fn_def)."""

        def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str, **kwargs: Any) -> str:
            return f"def forward(self, args_list){maybe_return_annotation}:\n    {', '.join(free_vars)}, = args_list"

        def process_inputs(self, *inputs: Any) -> Any:
            assert len(inputs) == 1
            return inputs[0]

    class Described(lib.CodeGen):
        """Passes descs to the base generate_output: one output a line with a comment."""

        def generate_output(self, output_args: Any, *, descs: Any = None, repr_fn: Any = None) -> str:
            return super().generate_output((output_args, output_args), descs=["first", "second"], repr_fn=repr_fn)

        def process_outputs(self, outputs: Any) -> Any:
            return (outputs, outputs)

    return {"DictOut": DictOut, "ReprOnly": ReprOnly, "Plain": Plain, "ListIn": ListIn, "Described": Described}


def f(x, y):  # noqa: ANN001, ANN201 - ListIn unpacks the parameters, which cannot carry annotations
    return torch.relu(x) + y * 2


class NegToSigmoid:
    """Mixin: a Transformer that rewrites relu to sigmoid."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is torch.relu:
            target = torch.sigmoid
        return super().call_function(target, args, kwargs)  # type: ignore[misc]


def _run(lib: Any, codegen_name: str) -> tuple[Any, ...]:
    gm = lib.symbolic_trace(f)
    gm.graph.set_codegen(_codegens(lib)[codegen_name]())
    gm.recompile()
    x, y = torch.arange(3.0) - 1, torch.ones(3)
    inputs = ([x, y],) if codegen_name == "ListIn" else (x, y)
    transformer = type("T", (NegToSigmoid, lib.Transformer), {})
    new = transformer(gm).transform()
    return gm.code, gm(*inputs), lib.Interpreter(gm).run(*inputs), new.code, new(*inputs), gm._lineno_map


@pytest.mark.parametrize("codegen_name", ["DictOut", "ReprOnly", "Plain", "ListIn", "Described"])
def test_custom_codegen_with_interpreter_and_transformer(codegen_name: str) -> None:
    ours, theirs = _run(fx, codegen_name), _run(torch.fx, codegen_name)
    assert ours[0] == theirs[0]  # the generated code
    assert ours[5] == theirs[5]  # generated line -> node index, also inside multi-line statements
    assert ours[3] == theirs[3] and "torch.sigmoid" in ours[3]  # the transformed module keeps the codegen
    for mine, ref in zip(ours[1:3] + ours[4:5], theirs[1:3] + theirs[4:5]):
        torch.testing.assert_close(mine, ref)
    torch.testing.assert_close(ours[1], ours[2])  # Interpreter == generated code


@pytest.mark.parametrize("n_args", [1, 3])
def test_boxed_run_argument_check_matches_torch_fx(n_args: int) -> None:
    messages = []
    for lib in (fx, torch.fx):
        gm = lib.symbolic_trace(f)
        with pytest.raises(RuntimeError) as info:
            lib.Interpreter(gm).boxed_run([torch.ones(1)] * n_args)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert ("extra arguments" if n_args > 2 else "missing arguments") in messages[0]


def test_boxed_run_clears_the_list_like_torch_fx() -> None:
    for lib in (fx, torch.fx):
        args = [torch.ones(2), torch.full((2,), 3.0)]
        out = lib.Interpreter(lib.symbolic_trace(f)).boxed_run(args)
        assert args == []
        torch.testing.assert_close(out, torch.full((2,), 7.0))
