"""Print the import graph of the project's packages, as tests/test_layout.py sees it (``ast`` only: nothing is
imported).

Default: edges between packages and sub-packages (``fxdist``, ``fxdist.passes``, ``scheduling``,
``scheduling.ps``, ``quant``, ``jobs``, ``recsys``...) with the number of module-level imports behind each,
the import cycles between two modules (lazy imports inside functions included), and the modules over the
size cap. ``--modules``: every module-to-module edge instead of the package summary. ``--root``: another
checkout (e.g. an older commit's worktree), to compare.

Run: ``.venv/bin/python scripts/import_graph.py [--modules] [--root PATH]``.
"""

from __future__ import annotations

import argparse
import ast
import collections
from pathlib import Path

PACKAGES = ("fxdist", "recsys", "scheduling", "quant", "jobs")
MAX_MODULE_LINES = 600


def find_modules(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of ``packages`` under ``root``."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _dotted(expr: ast.AST) -> str | None:
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if isinstance(expr, ast.Name):
        parts.append(expr.id)
        return ".".join(reversed(parts))
    return None


def imports_of(module: str, path: Path, known: set[str] | frozenset[str] = frozenset()) -> set[str]:
    """Every module name the file imports (at any depth: lazy imports too), plus ``torch.fx`` / ``torch.export``
    attribute uses. With ``known`` (the project's modules), ``from package import submodule`` does not count as
    an import of the package itself (its ``__init__``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, path, node)
            full = [f"{base}.{alias.name}" for alias in node.names]
            if not known or any(name not in known for name in full):
                names.add(base)
            names.update(full)
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted and dotted.split(".")[:2] in (["torch", "fx"], ["torch", "export"]):
                names.add(".".join(dotted.split(".")[:2]))
    return names


def module_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project's modules it imports (a name ``a.b.c`` counts for the longest known module)."""
    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for name in imports_of(module, path, set(modules)):
            parts = name.split(".")
            for n in range(len(parts), 0, -1):
                candidate = ".".join(parts[:n])
                if candidate in modules:
                    if candidate != module:
                        targets.add(candidate)
                    break
        edges[module] = targets
    return edges


def group_of(module: str, modules: dict[str, Path]) -> str:
    """The module's package or sub-package (``scheduling.ps.client`` -> ``scheduling.ps``)."""
    parts = module.split(".")
    path = modules[module]
    return ".".join(parts if path.name == "__init__.py" else parts[:-1]) or parts[0]


def cycles(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs of modules that import each other."""
    return sorted((a, b) for a, targets in edges.items() for b in targets if a < b and a in edges.get(b, ()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    p.add_argument("--modules", action="store_true", help="every module edge instead of the package summary")
    args = p.parse_args()
    modules = find_modules(args.root)
    edges = module_edges(modules)
    sizes = {m: path.read_text().count("\n") for m, path in modules.items()}
    print(f"{len(modules)} modules, {sum(sizes.values()):,} lines under {args.root}")
    if args.modules:
        for module in sorted(edges):
            print(f"{module} -> {', '.join(sorted(edges[module])) or '-'}")
    else:
        counts: collections.Counter[tuple[str, str]] = collections.Counter()
        for a, targets in edges.items():
            for b in targets:
                ga, gb = group_of(a, modules), group_of(b, modules)
                if ga != gb:
                    counts[ga, gb] += 1
        for (ga, gb), n in sorted(counts.items()):
            print(f"  {ga:<22} -> {gb:<22} {n:>3}")
    pairs = cycles(edges)
    print(f"import cycles between two modules: {len(pairs)}")
    for a, b in pairs:
        print(f"  {a} <-> {b}")
    over = sorted(m for m, n in sizes.items() if n > MAX_MODULE_LINES)
    print(f"modules over {MAX_MODULE_LINES} lines: {', '.join(over) if over else 'none'}")


if __name__ == "__main__":
    main()
