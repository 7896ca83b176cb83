"""whalex's import structure (docs/architecture.md#layers-and-data-flow): data flows one way, so imports do too.

Every module under whalex/ is parsed with `ast` (nothing is imported) into a module import graph;
the tests fail on a cycle between modules, a cycle between packages, an import that goes up the
layering below, and an import statement inside a function (a cycle dodged at run time), except
the few allowed by name here, with their reason.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "whalex"

# Units (whalex/<pkg>/ packages; top-level modules are their own unit), bottom to top. A unit may
# import only units on a lower line; units on one line do not import each other.
LAYERS = (
    ("whalex.errors", "whalex._compat", "whalex.state", "whalex.nnx"),
    ("whalex.distributed",),          # joins the process group (reads whalex._compat lazily)
    ("whalex.primitives",),           # recording user intent
    ("whalex.mesh",),                 # clusters, device specs, VirtualDevices, meshes
    ("whalex.core",),                 # capture, the jaxpr evaluator, the loss contract: read by all above
    ("whalex.balance", "whalex.moe", "whalex.ops"),  # decides loads | MoE layers, ops (call names live in core)
    ("whalex.memory",),               # ZeRO, remat, precision, offload: functions of specs and policies
    ("whalex.lowering",),             # carries out a plan, decides nothing about balance
    ("whalex.view",),                 # the Plan's text, HTML, pictures, timing: functions of a Plan given to them
    ("whalex.plan",),                 # the Plan (data) and its views
    ("whalex.planner",),              # calls balance, hands its decisions to lowering, builds the Plan
    ("whalex.api",),                  # the public face
    ("whalex.checkpoint",),           # plan-independent checkpoints (orbax): saves and restores Steps' states
    ("whalex", "whalex.launch"),      # the package itself; the multi-process launcher
)

# Imports between units that the layering allows but the design does not, with the reason.
FORBIDDEN = {
    ("whalex.lowering", "whalex.balance"):
        "lowering carries out a plan and decides nothing about balance; the planner hands balance's decisions down",
    ("whalex.lowering", "whalex.moe"):
        "the MoE call names the sharding patterns recognise live in whalex.core.names",
    ("whalex.plan", "whalex.lowering"):
        "a Plan holds plain records (whalex.core.sharding_plan, whalex.core.schedules), never lowering's types",
    ("whalex.view", "whalex.lowering"):
        "the view reads only the Plan and the plain records it holds",
}

# Imports inside a function that are allowed: optional dependencies, by top-level name...
OPTIONAL = {"matplotlib", "IPython"}
# ... and deliberate lazy imports, by (file, module): the reason.
LAZY = {
    ("whalex/plan.py", "whalex.view.plot"):
        "Plan.plot and the HTML picture load matplotlib on first use: it adds ~0.55 s to `import whalex` (~2 s)",
    ("whalex/distributed.py", "jax"):
        "the process group is joined from os.environ before JAX is imported (import whalex joins first)",
    ("whalex/distributed.py", "whalex._compat"):
        "same reason: whalex._compat imports JAX",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _under_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(path: Path):
    """(lineno, imported module names, inside a function) for every import statement that runs."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _under_type_checking(child):
                for sub in child.orelse:
                    visit_one(sub, in_function)
                continue
            visit_one(child, in_function)

    def visit_one(node, in_function: bool):
        if isinstance(node, ast.Import):
            found.append((node.lineno, node, in_function))
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node, in_function))
        else:
            visit(node, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def _targets(name: str, is_package: bool, node, modules) -> list[str]:
    """The whalex modules an import statement in module `name` reads ([] for other packages)."""
    if isinstance(node, ast.Import):
        out = []
        for alias in node.names:
            mod = alias.name
            while mod and mod not in modules and "." in mod:
                mod = mod.rsplit(".", 1)[0]
            out.append(mod)
        return [m for m in out if m == "whalex" or m.startswith("whalex.")]
    if node.level:
        package = name if is_package else name.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
            package = package.rsplit(".", 1)[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module
    if not (base == "whalex" or base.startswith("whalex.")):
        return []
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.append(sub if sub in modules else base)     # `from whalex.x import y`: y may be a submodule
    return out


def _graph():
    modules = _modules()
    edges: dict[str, dict[str, tuple[str, int]]] = {m: {} for m in modules}
    unknown, inside = [], []
    for name, path in modules.items():
        rel = path.relative_to(ROOT.parent).as_posix()
        for lineno, node, in_function in _imports(path):
            targets = _targets(name, path.name == "__init__.py", node, modules)
            for t in targets:
                if t not in modules:
                    unknown.append(f"{rel}:{lineno}: imports {t}, which is not a module of whalex")
                elif t != name:
                    edges[name].setdefault(t, (rel, lineno))
            if in_function:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [("." * node.level) + (node.module or "")]
                if not all(mod.split(".")[0] in OPTIONAL or any(
                        f == rel and (mod == m or mod.startswith(m + ".")) for f, m in LAZY)
                        for mod in targets or names):
                    inside.append(f"{rel}:{lineno}: `{ast.unparse(node)}` inside a function")
    return modules, edges, unknown, inside


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = dfs(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = dfs(n)
            if found:
                return found
    return None


def _unit(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return module
    if (ROOT / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module


def _where(edges, a: str, b: str) -> str:
    rel, lineno = edges[a][b]
    return f"{rel}:{lineno}"


def test_every_import_resolves():
    _, _, unknown, _ = _graph()
    assert not unknown, "\n".join(unknown)


def test_no_cycle_between_modules():
    _, edges, _, _ = _graph()
    cycle = _find_cycle({a: set(bs) for a, bs in edges.items()})
    assert cycle is None, "import cycle between modules: " + " -> ".join(cycle) + "\n" + "\n".join(
        f"  {a} -> {b} at {_where(edges, a, b)}" for a, b in zip(cycle, cycle[1:]))


def _unit_edges(edges):
    units: dict[str, dict[str, tuple[str, str]]] = {}
    for a, bs in edges.items():
        for b in bs:
            ua, ub = _unit(a), _unit(b)
            if ua != ub:
                units.setdefault(ua, {}).setdefault(ub, (a, b))
    return units


def test_no_cycle_between_packages():
    _, edges, _, _ = _graph()
    units = _unit_edges(edges)
    cycle = _find_cycle({a: set(bs) for a, bs in units.items()})
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle) + "\n" + "\n".join(
        f"  {ua} -> {ub}: {units[ua][ub][0]} imports {units[ua][ub][1]} at {_where(edges, *units[ua][ub])}"
        for ua, ub in zip(cycle, cycle[1:]))


def test_imports_go_down_the_layers():
    modules, edges, _, _ = _graph()
    rank = {u: i for i, line in enumerate(LAYERS) for u in line}
    missing = sorted({_unit(m) for m in modules} - set(rank))
    assert not missing, f"units not placed in LAYERS (tests/test_imports.py): {missing}"
    wrong = [f"{ua} -> {ub}: {a} imports {b} at {_where(edges, a, b)}"
             for ua, bs in sorted(_unit_edges(edges).items()) for ub, (a, b) in sorted(bs.items())
             if rank[ub] >= rank[ua]]
    assert not wrong, "imports that do not go down the layers:\n" + "\n".join(wrong)
    banned = _forbidden(edges)
    assert not banned, "forbidden imports:\n" + "\n".join(banned)


def _forbidden(edges) -> list[str]:
    """The imports between units that FORBIDDEN names, with where they are and why not."""
    units = _unit_edges(edges)
    return [f"{ua} -> {ub}: {units[ua][ub][0]} imports {units[ua][ub][1]} at {_where(edges, *units[ua][ub])} "
            f"({why})" for (ua, ub), why in FORBIDDEN.items() if ub in units.get(ua, {})]


@pytest.mark.parametrize("importer, imported", [
    ("whalex.plan", "whalex.lowering.step"),
    ("whalex.view.sections", "whalex.lowering.schedules"),
])
def test_plan_and_view_importing_lowering_is_found(importer, imported):
    """A Plan holds plain records and the view reads only the Plan: an import of lowering by either fails."""
    _, edges, _, _ = _graph()
    edges = {**edges, importer: {**edges[importer], imported: ("whalex/x.py", 1)}}
    assert any(line.startswith(f"{_unit(importer)} -> whalex.lowering:") for line in _forbidden(edges))


def test_no_import_inside_a_function():
    _, _, _, inside = _graph()
    assert not inside, ("imports inside functions (move them to the top; a cycle means something is in the "
                        "wrong package):\n" + "\n".join(inside))


@pytest.mark.parametrize("source, expected", [
    ("from whalex import _compat as C", ["whalex._compat"]),
    ("from whalex.memory import MemoryOptions, zero", ["whalex.memory", "whalex.memory.zero"]),
    ("import whalex.core.capture", ["whalex.core.capture"]),
    ("from . import zero", ["whalex.memory.zero"]),
    ("from ..core import capture", ["whalex.core.capture"]),
    ("import numpy as np", []),
])
def test_resolution(source, expected):
    """The resolver behind the tests: relative imports, and names that are submodules."""
    node = ast.parse(source).body[0]
    assert _targets("whalex.memory.remat", False, node, _modules()) == expected


def test_a_cycle_and_an_inner_import_are_found(tmp_path):
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
    src = tmp_path / "m.py"
    src.write_text("import os\n\nclass K:\n    import re\n\n    def f(self):\n        from whalex import plan\n")
    assert [(line, inner) for line, _, inner in _imports(src)] == [(1, False), (4, False), (7, True)]
