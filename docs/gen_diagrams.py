"""The pictures of the docs' "Async split and prefetch" page, drawn from real graphs at every docs build.

A small recommender (a dense feature through a bottom layer, a user and an item ``nn.EmbeddingBag``, a top layer)
is traced and rewritten by the real passes, on two local parameter servers (:class:`scheduling.ps.LocalCluster`):

* ``async-before.svg``: after ``parameter_servers`` alone: each table's lookup is one blocking ``ps_lookup``.
* ``async-after.svg``: after ``parameter_servers`` then ``async_rpc_prefetch``: each lookup is split into
  ``ps_lookup_start`` and ``ps_lookup_wait``, and the gradient push also carries the next batch's ids
  (``next_users``, ``next_items``): the nodes the pass added or changed are outlined in red.

Each node is drawn by fxdist's own :class:`fxdist.passes.graph_drawer.FxGraphDrawer` (Graphviz ``dot``), its
label cut to its position in the graph (``#3``), name and target, so the hoisted starts are seen above the bottom layer.

:func:`diagrams` is what ``docs/hooks.py`` calls: it returns the SVGs from a cache under ``build/diagrams/``
keyed by the SHA-256 of this file and of every ``.py`` file of ``fxdist/`` and ``scheduling/``, and otherwise draws
them in a child process (``python docs/gen_diagrams.py OUT_DIR``: the servers are spawned processes, and a
docs build should not hold a parameter-server group). Without Graphviz's ``dot`` each picture is a small SVG
that says so (the build does not fail; ``scripts/bootstrap.sh`` installs graphviz).
"""

from __future__ import annotations

import hashlib
import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("async-before.svg", "async-after.svg")
CACHE = ROOT / "build" / "diagrams"
NEW_OPS = ("ps_lookup_start", "ps_lookup_wait", "ps_prefetch")
HIGHLIGHT = {"color": "red3", "penwidth": "3"}


def sources_digest() -> str:
    """SHA-256 of this file and of the code the pictures are drawn from (``fxdist/``, ``scheduling/``)."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for package in ("fxdist", "scheduling"):
        for path in sorted((ROOT / package).rglob("*.py")):
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def placeholder_svg(reason: str) -> str:
    """A small SVG that shows ``reason`` in place of a picture that could not be drawn."""
    text = html.escape(reason)
    return ('<svg xmlns="http://www.w3.org/2000/svg" width="640" height="60" viewBox="0 0 640 60">'
            '<rect width="640" height="60" fill="#f5f5f5" stroke="#999"/>'
            f'<text x="12" y="35" font-family="sans-serif" font-size="14">{text}</text></svg>')


def diagrams(cache: Path = CACHE, timeout_s: float = 300.0) -> dict[str, str]:
    """The pictures, ``{file name: SVG text}``: from ``cache`` when the sources are unchanged, else drawn now.

    Raises:
        RuntimeError: drawing failed (the child's exit status and the end of its output): the passes or the
            drawer changed in a way this page's pictures do not survive.
    """
    if shutil.which("dot") is None:
        reason = "Graphviz's dot is not installed (apt-get install graphviz): the graph is not drawn."
        return {name: placeholder_svg(reason) for name in NAMES}
    folder = cache / sources_digest()[:16]
    if not all((folder / name).is_file() for name in NAMES):
        folder.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(folder)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"docs/gen_diagrams.py exited with {done.returncode}: "
                               f"{(done.stdout + done.stderr)[-2000:]}")
    return {name: (folder / name).read_text() for name in NAMES}


def _model():  # type: ignore[no-untyped-def]
    import torch
    from torch import nn

    class SmallRecommender(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bottom = nn.Linear(3, 4)
            self.user = nn.EmbeddingBag(100, 4, mode="sum")
            self.item = nn.EmbeddingBag(100, 4, mode="sum")
            self.top = nn.Linear(12, 1)

        def forward(self, dense, users, items):  # type: ignore[no-untyped-def]
            return self.top(torch.cat([self.bottom(dense), self.user(users), self.item(items)], dim=1))

    return SmallRecommender()


def _short_label(label: str, position: int) -> str:
    """The drawer's record label cut to its name (prefixed ``#position``), its target and a ``next_kjt`` argument."""
    rows = re.split(r"(?<!\\)\|", label.strip('"')[1:-1])
    kept = [row for row in rows if row.startswith(("name=", "target=")) or "next_kjt" in row]
    kept[0] = kept[0].replace("name=", f"#{position} ", 1)
    return '"{' + "|".join(kept) + '}"'


def _draw(gm, name: str, before_names: set[str] | None) -> str:  # type: ignore[no-untyped-def]
    from fxdist.passes.graph_drawer import FxGraphDrawer

    dot = FxGraphDrawer(gm, name, ignore_parameters_and_buffers=True).get_dot_graph()
    dot.set_graph_defaults(fontname="sans-serif")
    position = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    for node in dot.get_nodes():
        key = node.get_name().strip('"')
        if key not in position:
            continue
        node.set("label", _short_label(node.get("label") or "", position[key]))
        target = next(n for n in gm.graph.nodes if n.name == key)
        changed = before_names is not None and (key not in before_names or "next_kjt" in target.kwargs
                                                or getattr(target.target, "__name__", "") in NEW_OPS)
        if changed:
            for attribute, value in HIGHLIGHT.items():
                node.set(attribute, value)
    return dot.create_svg().decode()


def draw(out: Path) -> None:
    """Write ``async-before.svg`` and ``async-after.svg`` into ``out`` (starts two local servers)."""
    import functools

    import fxdist
    import scheduling
    from scheduling.ps import LocalCluster

    blocking = functools.partial(scheduling.parameter_servers, verbose=False, group_tables=False)
    with LocalCluster(num_servers=2):
        before = fxdist.optimize(_model(), passes=(blocking,))
        after = fxdist.optimize(_model(), passes=(blocking, "async_rpc_prefetch"))
        pictures = {"async-before.svg": _draw(before, "before", None),
                    "async-after.svg": _draw(after, "after", {n.name for n in before.graph.nodes})}
    out.mkdir(parents=True, exist_ok=True)
    for name, svg in pictures.items():
        (out / name).write_text(svg)


if __name__ == "__main__":
    draw(Path(sys.argv[1]))
