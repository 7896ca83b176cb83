"""whalex's import structure (docs/architecture.md#layers-and-data-flow): data flows one way, so imports do too.

Every module under whalex/ is parsed with `ast` (nothing is imported) into a module import graph;
the tests fail on a cycle between modules, a cycle between packages, an import that goes up the
layering below, and an import statement inside a function (a cycle dodged at run time), except
the few allowed by name here, with their reason.

A step program (`whalex.records.program.StepProgram`) can travel up and down untyped, where the import
graph does not see it, so its uses are checked too (`test_no_layer_below_lowering_takes_a_program`
and the tests after it): memory and balance take plain records, programs are read through the Plan,
and no code probes a program for what it has.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "whalex"

# Units (whalex/<pkg>/ packages; top-level modules are their own unit), bottom to top. A unit may
# import only units on a lower line; units on one line do not import each other.
LAYERS = (
    ("whalex.errors", "whalex._compat", "whalex.state", "whalex.nnx"),
    ("whalex.validate",),             # checks of the user's inputs (reads only whalex.errors)
    ("whalex.distributed",),          # joins the process group (reads whalex._compat lazily)
    ("whalex.primitives",),           # recording user intent
    ("whalex.mesh", "whalex.records"),  # clusters, device specs, meshes | plain records the layers hand each other
    ("whalex.jaxpr",),                # capture, the evaluator, segments, primitive table, FLOPs, HLO, batch dependence
    ("whalex.loss",),                 # the loss contract: its analysis, its evaluation in parts, random rows
    ("whalex.precision",),            # amp on the loss and its capture, loss scaling, half-precision all-reduces
    ("whalex.memory",),               # ZeRO, remat, offload, the per-device accounting and fit
    ("whalex.columns",),              # uneven columns and the split head's program (run by lowering, timed by balance)
    ("whalex.balance", "whalex.moe", "whalex.ops"),  # decides loads | MoE layers, ops (call names are records)
    ("whalex.lowering",),             # carries out a plan, decides nothing about balance
    ("whalex.view",),                 # the Plan's text, HTML, pictures, timing: functions of a Plan given to them
    ("whalex.plan",),                 # the Plan (data) and its views
    ("whalex.planner",),              # calls balance, hands its decisions to lowering, builds the Plan
    ("whalex.refining",),             # a Step's refinement: times the real step at splits, builds their plans
    ("whalex.api",),                  # the public face
    ("whalex.checkpoint",),           # plan-independent checkpoints (orbax): saves and restores Steps' states
    ("whalex", "whalex.launch"),      # the package itself; the multi-process launcher
)

# Imports between units that the layering allows but the design does not, with the reason.
FORBIDDEN = {
    ("whalex.lowering", "whalex.balance"):
        "lowering carries out a plan and decides nothing about balance; the planner hands balance's decisions down",
    ("whalex.lowering", "whalex.moe"):
        "the MoE call names the sharding patterns recognise live in whalex.records.call_names",
    ("whalex.plan", "whalex.lowering"):
        "a Plan holds plain records (whalex.records.sharding_plan, whalex.records.schedules), never lowering's types",
    ("whalex.view", "whalex.lowering"):
        "the view reads only the Plan and the plain records it holds",
}

# Imports inside a function that are allowed: optional dependencies, by top-level name...
OPTIONAL = {"matplotlib", "IPython"}
# ... and deliberate lazy imports, by (file, module): the reason.
LAZY = {
    ("whalex/plan.py", "whalex.view.plot"):
        "Plan.plot and the HTML picture load matplotlib on first use: it adds a quarter to `import whalex`'s time",
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
    missing = sorted({_unit(m) for m in modules} - set(_rank()))
    assert not missing, f"units not placed in LAYERS (tests/project/test_imports.py): {missing}"
    wrong = _upward(edges)
    assert not wrong, "imports that do not go down the layers:\n" + "\n".join(wrong)
    banned = _forbidden(edges)
    assert not banned, "forbidden imports:\n" + "\n".join(banned)


def _rank() -> dict[str, int]:
    return {u: i for i, line in enumerate(LAYERS) for u in line}


def _upward(edges) -> list[str]:
    """The imports between units that do not go down LAYERS, with where they are."""
    rank = _rank()
    return [f"{ua} -> {ub}: {a} imports {b} at {_where(edges, a, b)}"
            for ua, bs in sorted(_unit_edges(edges).items()) for ub, (a, b) in sorted(bs.items())
            if rank[ub] >= rank[ua]]


def _forbidden(edges) -> list[str]:
    """The imports between units that FORBIDDEN names, with where they are and why not."""
    units = _unit_edges(edges)
    return [f"{ua} -> {ub}: {units[ua][ub][0]} imports {units[ua][ub][1]} at {_where(edges, *units[ua][ub])} "
            f"({why})" for (ua, ub), why in FORBIDDEN.items() if ub in units.get(ua, {})]


@pytest.mark.parametrize("importer, imported", [
    ("whalex.plan", "whalex.lowering.step"),
    ("whalex.view.sections", "whalex.lowering.fused_collectives"),
])
def test_plan_and_view_importing_lowering_is_found(importer, imported):
    """A Plan holds plain records and the view reads only the Plan: an import of lowering by either fails."""
    _, edges, _, _ = _graph()
    edges = {**edges, importer: {**edges[importer], imported: ("whalex/x.py", 1)}}
    assert any(line.startswith(f"{_unit(importer)} -> whalex.lowering:") for line in _forbidden(edges))


@pytest.mark.parametrize("importer, imported", [
    ("whalex.memory.fit", "whalex.balance.profile"),
    ("whalex.memory.layers", "whalex.planner.common"),
])
def test_memory_importing_balance_or_the_planner_is_found(importer, imported):
    """Memory sits below balance and the planner: no module of whalex/memory imports either (its
    accounting, fit and layers are functions of plain records), and an import that does is found."""
    rank = _rank()
    assert rank["whalex.memory"] < min(rank["whalex.balance"], rank["whalex.planner"])
    _, edges, _, _ = _graph()
    edges = {**edges, importer: {**edges[importer], imported: ("whalex/x.py", 1)}}
    assert any(line.startswith(f"whalex.memory -> {_unit(imported)}:") for line in _upward(edges))


@pytest.mark.parametrize("importer, imported", [
    ("whalex.records.program", "whalex.jaxpr.capture"),
    ("whalex.records.schedules", "whalex.memory.remat"),
])
def test_records_importing_a_higher_layer_is_found(importer, imported):
    """The record layer is plain data the layers hand each other: it sits below the jaxpr layer, the loss
    contract and everything that makes or reads its records, and an import of any of them is found."""
    rank = _rank()
    assert rank["whalex.records"] < min(rank[u] for u in ("whalex.jaxpr", "whalex.loss", "whalex.memory",
                                                          "whalex.lowering", "whalex.plan"))
    assert rank["whalex.jaxpr"] < rank["whalex.loss"] < rank["whalex.memory"]
    _, edges, _, _ = _graph()
    edges = {**edges, importer: {**edges[importer], imported: ("whalex/x.py", 1)}}
    assert any(line.startswith(f"whalex.records -> {_unit(imported)}:") for line in _upward(edges))


def test_no_import_inside_a_function():
    _, _, _, inside = _graph()
    assert not inside, ("imports inside functions (move them to the top; a cycle means something is in the "
                        "wrong package):\n" + "\n".join(inside))


@pytest.mark.parametrize("source, expected", [
    ("from whalex import _compat as C", ["whalex._compat"]),
    ("from whalex.memory import MemoryOptions, zero", ["whalex.memory", "whalex.memory.zero"]),
    ("import whalex.jaxpr.capture", ["whalex.jaxpr.capture"]),
    ("from . import zero", ["whalex.memory.zero"]),
    ("from ..jaxpr import capture", ["whalex.jaxpr.capture"]),
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


# ----------------------------------------------------------------------------------- step programs
PROJECT = ROOT.parent
SCANNED = ("whalex", "bench", "tools", "examples")        # the code that must read programs through the Plan

# Modules below lowering that may still receive a program, with the reason (nothing else may).
TAKES_A_PROGRAM: dict = {}


def _contract() -> tuple[set[str], set[str]]:
    """(methods, properties) of `StepProgram` and the protocols it joins (`ProgramState`,
    `ProgramStep`, `ProgramReport`), read from whalex/records/program.py's AST."""
    tree = ast.parse((ROOT / "records" / "program.py").read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    top = classes["StepProgram"]
    parts = [top] + [classes[b.id] for b in top.bases if isinstance(b, ast.Name) and b.id in classes]
    methods, props = set(), set()
    for cls in parts:
        for f in cls.body:
            if isinstance(f, ast.FunctionDef):
                is_prop = any(isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list)
                (props if is_prop else methods).add(f.name)
    return methods, props


def test_the_contract_is_read_whole():
    """Every part of the contract is read, and it names what `@step_program` checks."""
    methods, props = _contract()
    assert {"holds", "jitted", "comm_report", "collectives"} <= methods and {"captured", "param_view"} <= props
    assert len(methods | props) > 30


LIBRARIES = {"jax", "jnp", "lax", "np", "optax", "nn"}        # `jax.value_and_grad(...)` is not a program's


def _below_lowering_names() -> tuple[set[str], set[str]]:
    """The contract's names that mark a program in memory and balance: its methods, called (less
    `lower`, which jax's traced functions share), and the records no plain record carries."""
    methods, props = _contract()
    return methods - {"lower"}, {"captured", "memory_options", "param_view", "param_shardings",
                                 "batch_shardings"} & props


def _program_uses(source: str, rel: str, methods: set[str], props: set[str]) -> list[str]:
    """Where a module handles a program: a parameter named `program` or annotated with `StepProgram`,
    an import of the contract or of lowering / the planner / the Plan (even for typing only), a call
    of a contract method (`x.train_step()`, `x.param_shapes()`, ...), a read of a record only programs
    carry (`x.captured`, `x.memory_options`, ...), or `x.program` (a Plan's)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        where = f"{rel}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.arg) and (node.arg == "program" or (
                node.annotation is not None and "StepProgram" in ast.unparse(node.annotation))):
            out.append(f"{where}: takes a program ({node.arg})")
        elif isinstance(node, ast.ImportFrom) and (
                any(a.name in ("StepProgram", "step_program") for a in node.names)
                or (node.module or "").startswith(("whalex.lowering", "whalex.planner", "whalex.plan"))):
            out.append(f"{where}: imports {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in methods \
                and ast.unparse(node.func.value) not in LIBRARIES:
            out.append(f"{where}: calls a program's {node.func.attr}()")
        elif isinstance(node, ast.Attribute) and node.attr in props | {"program"}:
            out.append(f"{where}: reads .{node.attr}")
    return out


def test_no_layer_below_lowering_takes_a_program():
    """memory and balance are functions of plain records (`StateLayout`, `TracedStep`, `Captured`, specs,
    policies): none takes a step program or calls back into one, which the import graph alone cannot
    see (a program arrives untyped). The names checked are the `StepProgram` contract's, read from its
    source, so a member added there is covered too; `TAKES_A_PROGRAM` names the one exception."""
    methods, props = _below_lowering_names()
    found = []
    for unit in ("memory", "balance"):
        for path in sorted((ROOT / unit).rglob("*.py")):
            rel = path.relative_to(PROJECT).as_posix()
            if rel not in TAKES_A_PROGRAM:
                found += _program_uses(path.read_text(), rel, methods, props)
    assert not found, "memory and balance take plain records, never a program:\n" + "\n".join(found)


def test_a_program_taken_below_lowering_is_found():
    methods, props = _below_lowering_names()
    found = _program_uses("from whalex.lowering.step import Program\n\n"
                          "def f(program, cap):\n    return program.train_step(), cap.jaxpr, plan.program.captured, "
                          "jax.value_and_grad(f)\n\n"
                          "def g(state: 'StepProgram'):\n    return state.param_shapes, state.memory\n", "m.py",
                          methods, props)
    assert [f.split(": ", 1)[1] for f in found if "m.py:1" in f] == ["imports from whalex.lowering.step import Program"]
    assert {"takes a program (program)", "calls a program's train_step()", "reads .program", "reads .captured",
            "takes a program (state)"} <= {f.split(": ", 1)[1] for f in found}
    assert not any("param_shapes" in f or ".memory" in f or "value_and_grad" in f for f in found)  # records, jax


def _plan_program_reads(source: str, rel: str) -> list[str]:
    """`x.program` and `getattr(x, "program")` in a module, except the Plan's own `self.program`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        own = rel == "whalex/plan.py" and isinstance(node, ast.Attribute) and \
            isinstance(node.value, ast.Name) and node.value.id == "self"
        if isinstance(node, ast.Attribute) and node.attr == "program" and not own:
            out.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "program":
            out.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_plan_program_is_read_only_by_the_planner_and_lowering():
    """The Plan carries its step program for the planner and lowering; the api, checkpoints, the view,
    the benches, tools and examples read it through the Plan, each part typed by its reader
    (`plan.storage.holds(...)`, `plan.functions.traced_step()`, `plan.report.experts`) or a documented
    convenience (`plan.jitted()`, `plan.caller_state(...)`), never `plan.program`."""
    found = []
    for top in SCANNED:
        for path in sorted((PROJECT / top).rglob("*.py")):
            rel = path.relative_to(PROJECT).as_posix()
            if not rel.startswith(("whalex/planner/", "whalex/lowering/")):
                found += _plan_program_reads(path.read_text(), rel)
    assert not found, "plan.program read outside the planner and lowering (use the Plan's methods):\n" + \
        "\n".join(found)


def test_plan_program_reads_are_found():
    src = "def f(plan):\n    return plan.program.jitted(), getattr(plan, 'program')\n\nclass Plan:\n" \
          "    def g(self):\n        return self.program\n"
    assert len(_plan_program_reads(src, "bench/x.py")) == 3
    assert len(_plan_program_reads(src, "whalex/plan.py")) == 2          # the Plan's own self.program is its field


def test_no_code_probes_a_program():
    """No `hasattr(x, m)` / `getattr(x, m, ...)` with `m` a member of the `StepProgram` contract: every
    program has every member (defaults in `lowering.emit.Emitter`), so a probe means an undeclared one."""
    methods, props = _contract()
    members = methods | props
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(PROJECT).as_posix()
        if rel in TAKES_A_PROGRAM:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("getattr", "hasattr") and len(node.args) > 1 and \
                    isinstance(node.args[1], ast.Constant) and node.args[1].value in members:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "probes of a step program's members (declare them in StepProgram instead):\n" + "\n".join(found)


def test_every_program_class_is_declared():
    """Every class in whalex/lowering built on `Emitter` (directly or through another program class) is
    decorated `@step_program`, which holds it to the `StepProgram` contract."""
    bases, declared = {}, set()
    for path in sorted((ROOT / "lowering").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {ast.unparse(b).split(".")[-1] for b in node.bases}
                if any(ast.unparse(d).split(".")[-1] == "step_program" for d in node.decorator_list):
                    declared.add(node.name)

    def is_program(name, seen=()):
        return any(b == "Emitter" or (b in bases and b not in seen and is_program(b, seen + (b,)))
                   for b in bases.get(name, ()))

    programs = {n for n in bases if is_program(n)}
    assert {"Program", "UnevenProgram", "HybridProgram", "PipelineProgram"} <= programs
    assert programs <= declared, f"program classes not declared @step_program: {sorted(programs - declared)}"


MAX_MODULE_LINES = 500


def test_no_module_is_over_500_lines():
    """A module holds one job: past 500 lines it holds several (split it, and list the new module in
    docs/architecture.md's module map)."""
    long = {path.relative_to(PROJECT).as_posix(): n for path in sorted(ROOT.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
