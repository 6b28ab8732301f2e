"""Griffe extension for the docs build: reStructuredText idioms in docstrings render as Markdown.

Many fxdist docstrings are written in a Sphinx-ish style inside Google-style sections: roles that name objects
(``:class:`JobConfig```, ``:func:`~scheduling.placement.flush```), ``::`` literal blocks and bare ``>>>``
doctest blocks. Markdown knows none of them: a role prints with its colons, and a printed graph such as
``call_function[target=operator.add](args = ...)`` would be read as a link. This extension rewrites each
docstring when griffe loads it: a role becomes its target in backticks (``JobConfig``, ``flush``), and literal
and doctest blocks become fenced code blocks. Loaded by mkdocstrings-python (``extensions:`` in mkdocs.yml).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const|ref|doc|term):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    target = match.group(2)
    if match.group(1):  # ~a.b.C: show C
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _blocks(lines: list[str]) -> list[str]:
    """Fence ``::`` literal blocks and bare ``>>>`` doctest blocks (those not inside a fence already)."""
    out: list[str] = []
    i, fenced = 0, False
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
            out.append(line)
            i += 1
            continue
        if fenced:
            out.append(line)
            i += 1
            continue
        if stripped.startswith(">>>"):  # a doctest block: up to the next blank or less indented line
            pad = " " * _indent(line)
            j = i
            while j < len(lines) and lines[j].strip() and _indent(lines[j]) >= len(pad):
                j += 1
            out += [pad + "```pycon", *lines[i:j], pad + "```"]
            i = j
            continue
        if stripped.endswith("::") and not stripped.startswith(".."):
            # a literal block follows: the lines indented deeper than this one, after a blank line
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            base = _indent(line)
            k = j
            while k < len(lines) and (not lines[k].strip() or _indent(lines[k]) > base):
                k += 1
            while k > j and not lines[k - 1].strip():
                k -= 1
            if k > j:
                head = line.rstrip()[:-2].rstrip()
                if head:
                    out.append(head + ":")
                pad = " " * base
                body = [ln[base:] if ln.strip() else "" for ln in lines[j:k]]
                deeper = min(_indent(b) for b in body if b.strip())
                out += ["", pad + "```text", *[pad + b[deeper:] for b in body], pad + "```", ""]
                i = k
                continue
        out.append(line)
        i += 1
    return out


def rewrite(text: str) -> str:
    """The Markdown form of a docstring (see the module docstring)."""
    return "\n".join(_blocks(ROLE.sub(_role, text).split("\n")))


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
