"""Architecture checks: dependencies point one way, and modules stay readable.

Parses every module with ``ast`` (nothing is imported), so a forbidden edge fails here even if no test
exercises it. Rules (docs/CONTRACTS.md, ../shared/STYLE.md):

* nothing under ``fxdist/`` uses ``torch.fx`` or ``torch.export`` except ``fxdist/interop.py``;
* the IR (``node``, ``graph``, ``codegen``, ``_namespace``) imports no tracer, interpreter, pass,
  ``torch.distributed`` or Ray;
* ``fxdist/`` never imports ``recsys``, ``scheduling``, ``quant`` or ``jobs``; passes never import ``jobs`` or Ray
  (in ``scheduling`` only the Ray transport and Ray-call modules, ``RAY_MODULES``, do);
* ``recsys/`` is a leaf below the passes: it imports none of ``scheduling``, ``quant``, ``jobs`` or Ray;
* in ``jobs/`` the trainer side is below the launcher: ``jobs.trainer`` never imports ``jobs.launcher``, and the
  modules both use (``jobs/*.py``: config, entry, results, table sizes...) import neither;
* sibling packages do not import each other: ``scheduling`` never imports ``quant``, nor ``quant`` ``scheduling``
  (what both need goes to ``recsys``);
* no module imports or reads a private name (``_x``, or a name in a ``_module``) of another of our top-level
  packages (``PRIVATE_REACHES_ALLOWED`` would say why, and is empty): that package gets a public name instead;
* a module name written in a string (``"scheduling.ray_calls"``, ``"pkg.mod:attr"``) may not be an upward edge nor
  close an import circle: the lower module is imported by whoever needs it and registers itself;
* a module has at most ``MAX_MODULE_LINES`` lines and a function at most ``MAX_FUNCTION_LINES``;
* every module of ``fxdist/``, ``scheduling/``, ``quant/``, ``recsys/`` and ``jobs/`` has its tests where a newcomer
  looks for them: a mirrored file (``scheduling/ps/ordering.py`` -> ``tests/scheduling/test_ps_ordering.py``), or
  an entry of ``TESTED_ELSEWHERE`` naming the file that tests it.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from import_graph import cycles, find_modules, imports_of, module_edges  # noqa: E402  (scripts/import_graph.py)

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fxdist", "recsys", "scheduling", "quant", "jobs")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
RAY_MODULES = {"scheduling.ps.transport.ray_transport", "scheduling.ray_calls"}
"""The only modules of scheduling/ that import Ray: the ``ray`` transport and the Ray calls of traced models,
each imported only by code that asks for Ray (ray_calls registers its async pair when imported)."""
IR_MODULES = {"fxdist.node", "fxdist.graph", "fxdist.codegen", "fxdist._namespace", "fxdist._impure",
              "fxdist._graph_lint", "fxdist._graph_state", "fxdist.immutable_collections", "fxdist._pysource"}


def _modules() -> dict[str, Path]:
    return find_modules(ROOT, PACKAGES)


def _imports(module: str, path: Path) -> set[str]:
    """Every module name the file imports, plus ``torch.fx``/``torch.export`` attribute uses."""
    return imports_of(module, path)


def _hits(names: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden))


MODULES = _modules()


def _forbidden_for(module: str) -> tuple[str, ...]:
    forbidden: list[str] = []
    if module.startswith("fxdist") and module != "fxdist.interop":
        forbidden += ["torch.fx", "torch.export", "recsys", "scheduling", "quant", "jobs"]
    if module in IR_MODULES:
        forbidden += ["fxdist.proxy", "fxdist.tracer", "fxdist.interpreter", "fxdist.passes",
                      "fxdist.subgraph_rewriter", "fxdist.graph_module", "torch.distributed", "ray"]
    if module == "fxdist.codegen":
        forbidden += ["fxdist.graph"]
    if module.startswith(("fxdist.passes", "recsys", "scheduling", "quant")):
        forbidden += ["jobs"] + ([] if module in RAY_MODULES else ["ray"])
    if module.startswith("recsys"):
        forbidden += ["scheduling", "quant"]
    if module.startswith("scheduling"):
        forbidden += ["quant"]
    if module.startswith("quant"):
        forbidden += ["scheduling"]
    if module.startswith("jobs.trainer"):
        forbidden += ["jobs.launcher"]
    elif module.startswith("jobs.") and not module.startswith("jobs.launcher"):
        forbidden += ["jobs.launcher", "jobs.trainer"]
    return tuple(forbidden)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_forbidden_imports(module: str) -> None:
    hits = _hits(_imports(module, MODULES[module]), _forbidden_for(module))
    assert not hits, f"{MODULES[module].relative_to(ROOT)} imports {hits}; see docs/CONTRACTS.md for the allowed edges"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_and_function_size(module: str) -> None:
    path = MODULES[module]
    source = path.read_text()
    n_lines = source.count("\n")
    assert n_lines <= MAX_MODULE_LINES, f"{path.relative_to(ROOT)} has {n_lines} lines (max {MAX_MODULE_LINES}); split it"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.relative_to(ROOT)}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_checker_sees_a_forbidden_edge(tmp_path: Path) -> None:
    """The checker itself must catch each form of a torch.fx dependency."""
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom torch import fx\nx = torch.fx.Graph\nfrom torch.fx.node import Node\n")
    names = _imports("fxdist.bad", bad)
    assert _hits(names, ("torch.fx",)) == ["torch.fx", "torch.fx.node", "torch.fx.node.Node"]
    rel = tmp_path / "graph.py"
    rel.write_text("from .passes import shape_prop\nfrom . import tracer\n")
    assert _hits(_imports("fxdist.graph", rel), ("fxdist.passes", "fxdist.tracer")) == [
        "fxdist.passes", "fxdist.passes.shape_prop", "fxdist.tracer"]


def test_the_jobs_layers_rule_can_fail(tmp_path: Path) -> None:
    """A trainer module importing the launcher, or a common module importing either side, is a forbidden edge."""
    bad = tmp_path / "bad.py"
    bad.write_text("from jobs.launcher.plan import make_plan\nfrom jobs.trainer import worker\n")
    names = _imports("jobs.trainer.bad", bad)
    assert _hits(names, _forbidden_for("jobs.trainer.bad")) == ["jobs.launcher.plan", "jobs.launcher.plan.make_plan"]
    assert _hits(names, _forbidden_for("jobs.bad")) == [
        "jobs.launcher.plan", "jobs.launcher.plan.make_plan", "jobs.trainer", "jobs.trainer.worker"]
    assert _hits(names, _forbidden_for("jobs.launcher.bad")) == []


def test_no_file_cites_documents_the_repository_does_not_hold():
    """Sources are public (torch.fx's files, the torch.fx paper), never the project's private spec documents."""
    needle, bad = "seed " + "00", []
    for path in sorted(ROOT.rglob("*")):
        if path.suffix not in (".py", ".md", ".toml") or any(p in (".venv", ".git", "runs") for p in path.parts):
            continue
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if needle in line.lower():
                bad.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()[:80]}")
    assert not bad, "cite the public source instead:\n" + "\n".join(bad)


def test_fxdist_names_no_package_above_it_in_strings():
    """An import through a string (``importlib.import_module("scheduling...")``, a ``"quant:fuse"`` table) is an
    upward edge the import rules above cannot see: fxdist's strings name no module of scheduling, quant or jobs
    (their passes come from entry points, ``pyproject.toml``)."""
    import re

    upward = re.compile(r"^(scheduling|quant|jobs|recsys)([.:][A-Za-z_]|$)")
    bad = []
    for module, path in _modules().items():
        if module.split(".")[0] != "fxdist":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and upward.match(node.value):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not bad, "fxdist/ names a package above it by string:\n" + "\n".join(bad)


def test_no_two_modules_import_each_other_above_the_core():
    """In the layers above fxdist a cycle (lazy imports inside functions included) hides which module owns a
    concept; the shared piece goes to a third module. (fxdist's own ``graph``/``node`` pairs follow torch.fx.)
    ``scripts/import_graph.py`` prints the graph."""
    pairs = [(a, b) for a, b in cycles(module_edges(MODULES)) if not a.startswith("fxdist")]
    assert not pairs, "modules that import each other: " + ", ".join(f"{a} <-> {b}" for a, b in pairs)


def _dotted(expr: ast.AST) -> str | None:
    """``a.b.c`` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    return ".".join([expr.id, *reversed(parts)]) if isinstance(expr, ast.Name) else None


def _is_private(name: str) -> bool:
    """``pkg.mod._x`` or ``pkg._mod.x``: some part after the package is private (``__dunder__`` names are not)."""
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in name.split(".")[1:])


def private_reaches(module: str, source: str) -> list[str]:
    """The private names (``_x``, or anything in a ``_module``) of *another* of our top-level packages that
    ``source`` imports (``from fxdist.node import _x``, ``import fxdist._impure``) or reads through an imported
    name (``fxdist.node._x``, ``node._x`` after ``from fxdist import node``). Relative imports stay in the package."""
    top, bound, hits = module.split(".")[0], {}, set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            pairs = [(a.name, a.asname or a.name.split(".")[0], a.name if a.asname else a.name.split(".")[0])
                     for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            pairs = [(f"{node.module}.{a.name}", a.asname or a.name, f"{node.module}.{a.name}") for a in node.names]
        else:
            continue
        for full, local, target in pairs:
            if full.split(".")[0] in PACKAGES and full.split(".")[0] != top:
                (hits.add(full) if _is_private(full) else bound.__setitem__(local, target))
    for node in ast.walk(tree):
        dotted = _dotted(node) if isinstance(node, ast.Attribute) else None
        if dotted and dotted.split(".")[0] in bound:
            full = ".".join([bound[dotted.split(".")[0]], *dotted.split(".")[1:]])
            if _is_private(full):
                hits.add(full)
    return sorted(hits)


PRIVATE_REACHES_ALLOWED: dict[tuple[str, str], str] = {}
"""(module, private name of another package) -> why it may import it. Empty: give the other package a public name."""


def test_no_module_reaches_into_another_packages_private_names() -> None:
    bad = [f"{MODULES[m].relative_to(ROOT)}: {name}" for m in sorted(MODULES)
           for name in private_reaches(m, MODULES[m].read_text()) if (m, name) not in PRIVATE_REACHES_ALLOWED]
    assert not bad, ("private names of another package (make them public there, as fxdist.node.is_random_op, or "
                     "add a PRIVATE_REACHES_ALLOWED entry with its reason):\n" + "\n".join(bad))


def test_the_private_reach_checker_can_fail() -> None:
    source = ("from fxdist._impure import _RANDOM_FUNCTIONS\nfrom fxdist.node import Node, _get_qualified_name\n"
              "import fxdist.node\nfrom fxdist import node as n\nfrom .ps.client import _CLIENTS\n"
              "x = fxdist.node._get_qualified_name, n._x, n.Node, fxdist.__name__\n")
    assert private_reaches("scheduling.bad", source) == [
        "fxdist._impure._RANDOM_FUNCTIONS", "fxdist.node._get_qualified_name", "fxdist.node._x"]
    assert private_reaches("fxdist.bad", "from fxdist.node import _get_qualified_name\n") == []   # its own package


MODULE_IN_STRING = re.compile(r"^((?:fxdist|recsys|scheduling|quant|jobs)(?:\.\w+)+)(?::\w+)?$|"
                              r"^((?:fxdist|recsys|scheduling|quant|jobs)):\w+$")
"""``"scheduling.ray_calls"``, ``"pkg.mod:attr"`` (an entry-point style reference); a bare ``"fxdist"`` (a meta
key, a config section) is no module reference."""


def string_edges(module: str, source: str, modules: dict[str, Path] | set[str]) -> set[str]:
    """The project's modules that ``source`` names in a string literal (the longest known module of the name)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        match = MODULE_IN_STRING.match(node.value)
        if not match:
            continue
        parts = (match.group(1) or match.group(2)).split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in modules:
                found.add(".".join(parts[:n]))
                break
    return found - {module}


def _reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def bad_string_edges(edges: dict[str, set[str]], named: dict[str, set[str]]) -> list[str]:
    """String references that would be an upward edge (forbidden as an import) or close an import circle (the
    named module imports, directly or not, the one naming it)."""
    bad = []
    for module in sorted(named):
        for target in sorted(named[module]):
            if _hits({target}, _forbidden_for(module)):
                bad.append(f"{module} names {target!r}: an upward edge")
            elif module in _reachable(edges, target):
                bad.append(f"{module} names {target!r}, which imports {module}: a circle")
    return bad


STRING_EDGES_ALLOWED: dict[tuple[str, str], str] = {}
"""(module, module it names in a string) -> why the edge is fine. Keep it empty: register from the lower module."""


def test_no_string_names_a_module_that_makes_a_circle_or_an_upward_edge() -> None:
    named = {m: {t for t in string_edges(m, MODULES[m].read_text(), MODULES) if (m, t) not in STRING_EDGES_ALLOWED}
             for m in MODULES}
    bad = bad_string_edges(module_edges(MODULES), named)
    assert not bad, "module names in strings (an import the rules above cannot see):\n" + "\n".join(bad)


def test_the_string_edge_checker_can_fail() -> None:
    modules = {"scheduling.rpc_kinds", "scheduling.ray_calls", "recsys.embedding", "scheduling"}
    src = 'EXTENSIONS = {"ray": "scheduling.ray_calls"}\nlog = "scheduling"\nkey = "quant.enabled"\n'
    assert string_edges("scheduling.rpc_kinds", src, modules) == {"scheduling.ray_calls"}
    named = {"scheduling.rpc_kinds": {"scheduling.ray_calls"}, "recsys.embedding": {"scheduling"}}
    edges = {"scheduling.ray_calls": {"scheduling.rpc_kinds"}}
    assert bad_string_edges(edges, named) == [
        "recsys.embedding names 'scheduling': an upward edge",
        "scheduling.rpc_kinds names 'scheduling.ray_calls', which imports scheduling.rpc_kinds: a circle"]
    assert string_edges("jobs.x", 'f = importlib.import_module("recsys.embedding:fn")', modules) == {"recsys.embedding"}


TEST_DIRS = {"fxdist": ("tests/fx", "tests/passes"), "scheduling": ("tests/scheduling",), "quant": ("tests/quant",),
             "recsys": ("tests/recsys",), "jobs": ("tests/jobs",)}
"""Where the tests of each package's modules live."""

TESTED_ELSEWHERE = {
    # fxdist's private helpers, tested through the public API that uses them
    "fxdist._body_lines": "tests/fx/test_graph.py",                  # Graph.on_generate_code transformers
    "fxdist._graph_module_io": "tests/fx/test_graph_module.py",      # pickle, deepcopy, to_folder
    "fxdist._graph_state": "tests/fx/test_graph.py",                 # pickling a Graph
    "fxdist._impure": "tests/fx/test_node.py",                       # Node.is_impure
    "fxdist._mutable_ops": "tests/fx/test_tracer.py",                # check_mutable_operations
    "fxdist._patching": "tests/conformance/test_wrap_torch_fx_leaves.py",
    "fxdist._pysource": "tests/fx/test_codegen.py",
    "fxdist._pytree": "tests/conformance/test_pytree_retrace.py",
    "fxdist._pytree_codegen": "tests/conformance/test_pytree_retrace.py",
    "fxdist._stack_trace": "tests/fx/test_tracer.py",                # node.stack_trace, user frames
    "fxdist._symbolic_trace": "tests/conformance/test_placeholder_markers.py",
    # fxdist's public modules tested under another name
    "fxdist.annotate": "tests/conformance/test_annotate.py",
    "fxdist.immutable_collections": "tests/fx/test_node.py",
    "fxdist.passes.utils.matcher_utils": "tests/fx/test_subgraph_rewriter.py",
    "fxdist.proxy": "tests/fx/test_tracer.py",
    # scheduling: the passes' helpers, and the parameter-server runtime exercised through a cluster
    "scheduling.batch_replay": "tests/scheduling/test_prefetch_inputs.py",
    "scheduling.placement.conversions": "tests/scheduling/test_placement_table_groups.py",
    "scheduling.placement.eval_mode": "tests/scheduling/test_ps_peek.py",
    "scheduling.placement.find": "tests/scheduling/test_placement_table_groups.py",
    "scheduling.placement.plan": "tests/scheduling/test_placement.py",
    "scheduling.ray_calls": "tests/scheduling/transport/test_ray_transport.py",
    "scheduling.async_pairs": "tests/scheduling/transport/test_ray_transport.py",
    "scheduling.timeline": "tests/scheduling/test_prefetch.py",
    "scheduling.ps.client": "tests/scheduling/test_ps.py",
    "scheduling.ps.client_state": "tests/scheduling/test_ps_dynamic.py",      # PSClient.server_states, load_server_states
    "scheduling.placement.after": "tests/scheduling/test_placement.py",       # table_state_dict, load_table_state_dict
    "scheduling.ps.ebc": "tests/scheduling/test_ps.py",
    "scheduling.ps.transport.socket_wire": "tests/scheduling/transport/test_socket_transport.py",  # dumps, send_message, recv_message
    "scheduling.ps.endpoints": "tests/scheduling/test_ps_coalesce.py",
    "scheduling.ps.lifecycle": "tests/scheduling/test_local_cluster.py",
    "scheduling.ps.ops": "tests/scheduling/test_ps.py",
    "scheduling.ps.optimizer": "tests/scheduling/test_sgd_exactness.py",
    "scheduling.ps.transport.registry": "tests/scheduling/test_local_cluster.py",
    # quant: the PTQ steps, tested end to end, and the case-study models
    "quant.convert": "tests/quant/test_ptq.py",
    "quant.prepare": "tests/quant/test_ptq.py",
    "quant.errors": "tests/quant/test_ptq.py",
    "quant.models.deeprec": "tests/quant/test_data.py",
    "quant.models.digits_cnn": "tests/quant/test_fuse_conv_bn.py",
    "quant.models.resnet": "tests/quant/test_fuse_conv_bn.py",
    # jobs: the launcher and its helpers run end to end (Ray) in the job tests
    "jobs.config_sections": "tests/jobs/test_config.py",             # every key's range and default
    "jobs.config_rules": "tests/jobs/test_dynamic_job.py",           # dynamic_errors (train_errors: test_config.py)
    "jobs.criteo": "tests/jobs/test_trainer_workload.py",
    "jobs.entry": "tests/jobs/test_user_outputs.py",
    "jobs.launcher.launch": "tests/jobs/test_job.py",
    "jobs.movielens": "tests/jobs/test_user_model.py",
    "jobs.optimizers": "tests/jobs/test_user_outputs.py",
    "jobs.launcher.plan": "tests/jobs/test_trainer_protocols.py",
    "jobs.launcher.checks": "tests/jobs/test_memory_plan.py",
    "jobs.launcher.first_pass": "tests/jobs/test_table_sizes.py",
    "jobs.trainer.servers": "tests/jobs/test_job.py",
    "jobs.launcher.report": "tests/jobs/test_user_outputs.py",
    "jobs.launcher.runs": "tests/jobs/test_validation.py",
    "jobs.launcher.state": "tests/jobs/test_cluster_helpers.py",
    "jobs.trainer.evaluation": "tests/jobs/test_trainer_loop.py",
    "jobs.trainer.faults": "tests/jobs/test_job.py",
    "jobs.trainer.phases": "tests/jobs/test_trainer_loop.py",
    "jobs.trainer.pipeline": "tests/jobs/test_trainer_loop.py",
    "jobs.trainer.spec": "tests/jobs/test_trainer_protocols.py",
    "jobs.user_code": "tests/jobs/test_user_outputs.py",
}
"""Modules whose behaviour is tested in a file not named after them: module -> the test file to read."""


def _mirrored_names(module: str) -> set[str]:
    """``pkg/sub/name.py`` -> ``test_name.py`` or ``test_sub_name.py`` (a private ``_name`` drops its ``_``)."""
    *_, name = module.split(".")
    subs = module.split(".")[1:-1]
    names = {f"test_{name.lstrip('_')}.py"}
    if subs:
        names.add(f"test_{'_'.join(subs)}_{name.lstrip('_')}.py")
    return names


def _mirrored(module: str) -> list[str]:
    dirs = TEST_DIRS[module.split(".")[0]]
    return sorted(str(p.relative_to(ROOT)) for d in dirs for p in (ROOT / d).rglob("test_*.py")
                  if p.name in _mirrored_names(module))


def _public_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_")}


MIRRORED_MODULES = sorted(m for m in MODULES if m.split(".")[0] in TEST_DIRS and not m.endswith("__init__")
                          and MODULES[m].name != "__init__.py")
"""Package ``__init__`` files only re-export; their names are tested with the modules that define them."""


@pytest.mark.parametrize("module", MIRRORED_MODULES)
def test_every_module_has_a_mirrored_test_file_or_says_where_it_is_tested(module: str) -> None:
    mirrored = _mirrored(module)
    if module not in TESTED_ELSEWHERE:
        names, dirs = " or ".join(sorted(_mirrored_names(module))), " or ".join(TEST_DIRS[module.split(".")[0]])
        assert mirrored, (f"{MODULES[module].relative_to(ROOT)} has no test file named {names} under {dirs}: "
                          f"add one, or name the file that tests it in TESTED_ELSEWHERE")
        return
    assert not mirrored, f"{module} has its mirrored test file {mirrored}: remove it from TESTED_ELSEWHERE"
    test_file = ROOT / TESTED_ELSEWHERE[module]
    assert test_file.is_file(), f"TESTED_ELSEWHERE[{module!r}]: {TESTED_ELSEWHERE[module]} does not exist"
    text = test_file.read_text()
    path = str(MODULES[module].relative_to(ROOT))
    words = {module, path} | _public_names(MODULES[module])
    assert any(re.search(rf"(?<!\w){re.escape(w)}(?!\w)", text) for w in words), (
        f"TESTED_ELSEWHERE[{module!r}]: {TESTED_ELSEWHERE[module]} names neither {module} ({path}) nor any of its "
        f"public names {sorted(_public_names(MODULES[module]))}")


def test_tested_elsewhere_names_only_modules_that_exist() -> None:
    assert not set(TESTED_ELSEWHERE) - set(MODULES), f"no such module: {sorted(set(TESTED_ELSEWHERE) - set(MODULES))}"
