"""``import fxdist as fx`` then ``fx.node``, ``fx.graph``, ``fx.proxy``, ``fx.passes``, ``fx.subgraph_rewriter``,
``fx.experimental`` (and their usual submodules) work in a fresh interpreter, as they do for ``torch.fx``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# attribute paths code written for torch.fx uses right after ``import torch.fx as fx``
PATHS = [
    "node.Node", "node.map_arg", "graph.Graph", "proxy.Proxy", "proxy.TraceError", "graph_module.GraphModule",
    "interpreter.Interpreter", "subgraph_rewriter.replace_pattern", "immutable_collections.immutable_list",
    "passes.shape_prop.ShapeProp", "passes.graph_drawer.FxGraphDrawer", "passes.reinplace.reinplace",
    "passes.utils.matcher_utils.SubgraphMatcher", "experimental.proxy_tensor.make_fx",
]

PROBE = """
import importlib, json, sys
lib = importlib.import_module(sys.argv[1])
fresh = [name for name in ("node", "passes", "experimental") if name in vars(lib)]
found = {}
for path in json.loads(sys.argv[2]):
    obj = lib
    try:
        for part in path.split("."):
            obj = getattr(obj, part)
        found[path] = getattr(obj, "__name__", type(obj).__name__)
    except AttributeError as e:
        found[path] = "AttributeError: " + str(e)
print(json.dumps({"fresh": fresh, "found": found}))
"""


def _probe(library: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", PROBE, library, json.dumps(PATHS)], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_submodules_resolve_in_a_fresh_interpreter_like_torch_fx():
    ours, theirs = _probe("fxdist"), _probe("torch.fx")
    assert ours["fresh"] == []  # not imported by `import fxdist` itself: resolved on first access
    assert not [v for v in theirs["found"].values() if v.startswith("AttributeError")]  # the reference
    assert ours["found"] == theirs["found"]
