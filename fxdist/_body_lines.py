"""The body lines of a generated ``forward`` and the node each comes from, after a body transformer.

``Graph.on_generate_code`` installs a transformer over the body: fxdist gives it one string per
statement (no trailing newline). It may return strings that end in a newline (torch.fx's transformers
do: ``["import pdb; pdb.set_trace()\\n", *body]``) or not, and strings holding several lines. Each
returned string is one or more lines of the body; one trailing newline ends it and makes no blank line.

The line -> node map (``PythonCode._lineno_map``) survives the transformer as torch.fx keeps it: a line
the transformer kept maps to its node; an added line maps to the node of the last kept line before it, or
to None before the first. Kept lines are recognised in order by their text.

Source: torch/fx/graph.py (``CodeGen._gen_python_code``: its ``# COUNTER`` markers and ``lineno_map``).
"""

from __future__ import annotations

__all__ = ["transformed_lines"]


def transformed_lines(lines: list[str], line_nodes: list[int | None],
                      transformed: list[str]) -> tuple[list[str], list[int | None]]:
    """The body after a transformer, one entry per source line, and the node index of each line.

    Args:
        lines: the statements given to the transformer.
        line_nodes: the node index of each of ``lines``.
        transformed: what the transformer returned.

    Returns:
        ``(lines, node indices)``, with multi-line strings split and one trailing newline dropped.

    Raises:
        TypeError: the transformer returned something other than strings, naming the item.
    """
    out: list[str] = []
    nodes: list[int | None] = []
    pending, current = 0, None
    for item in transformed:
        if not isinstance(item, str):
            raise TypeError(f"a body transformer (Graph.on_generate_code) returned {type(item).__name__} "
                            f"{item!r} among the lines; it must return a list of str")
        text = item[:-1] if item.endswith("\n") else item
        kept = next((k for k in range(pending, len(lines)) if lines[k] == text), None)
        if kept is not None:
            pending, current = kept + 1, line_nodes[kept]
        for part in text.split("\n"):
            out.append(part)
            nodes.append(current)
    return out, nodes
