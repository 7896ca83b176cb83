"""The step program's contract and the Plan's record (docs/architecture.md#how-a-step-is-built): the
contract is split by reader and the Plan hands out each part typed; the Plan's fields name no `Any`;
no frozen record holds a mutable default but the ones named here, each with its reason."""
from __future__ import annotations

import ast
from pathlib import Path

import whalex.records.program as contract
from whalex.records.lazy import Lazy

ROOT = Path(__file__).resolve().parents[2] / "whalex"

# (module, class, field) of a frozen record whose value may change or is a mutable container: the reason
MUTABLE = {
    ("whalex/plan.py", "Plan", "compiled"):
        "what XLA compiled for the step, kept when first found (the Step's first call, plan.step_memory()) so "
        "the summary shows it: a memo of a deterministic compile, apart from the frozen decisions",
    ("whalex/records/memory_options.py", "Precision", "local"):
        "the loss captured at each data-parallel degree, given once by dataclasses.replace and never written",
}


def _classes(path: Path):
    return {n.name: n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}


def _fields(cls: ast.ClassDef) -> dict[str, ast.AnnAssign]:
    return {s.target.id: s for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def test_the_contract_is_its_three_parts():
    parts = (contract.ProgramState, contract.ProgramStep, contract.ProgramReport)
    assert contract.PARTS == parts and all(p in contract.StepProgram.__mro__ for p in parts)
    names = [{m for m in vars(p) if not m.startswith("_")} for p in parts]
    assert not (names[0] & names[1] or names[0] & names[2] or names[1] & names[2])   # each member has one reader
    assert set(contract.MEMBERS) == set().union(*names)


def test_the_plan_fields_name_no_any_and_no_cache():
    fields = _fields(_classes(ROOT / "plan.py")["Plan"])
    untyped = [n for n, f in fields.items() if "Any" in ast.unparse(f.annotation)]
    assert not untyped, f"Plan fields typed Any: {untyped}"
    assert not [n for n in fields if n.startswith("_")], "a Plan field that is no part of its record"


def _mutable_defaults() -> list[tuple[str, str, str]]:
    """(module, class, field) of frozen dataclasses whose field defaults to a dict, list or set, or to
    a class of this project that is not a frozen dataclass."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).as_posix()
        classes = _classes(path)
        frozen = {n for n, c in classes.items() if any("frozen=True" in ast.unparse(d) for d in c.decorator_list)}
        for name in sorted(frozen):
            for field, f in _fields(classes[name]).items():
                value = ast.unparse(f.value) if f.value is not None else ""
                factory = value.split("default_factory=")[1].split(",")[0].split(")")[0] if "default_factory=" in \
                    value else None
                if factory in ("dict", "list", "set") or (factory in classes and factory not in frozen):
                    found.append((rel, name, field))
    return found


def test_no_frozen_record_holds_mutable_state_but_those_named():
    found = _mutable_defaults()
    assert set(found) <= set(MUTABLE), f"frozen records with mutable state: {sorted(set(found) - set(MUTABLE))}"
    assert ("whalex/plan.py", "Plan", "compiled") in found         # the scan sees the one it allows


def test_lazy_finds_its_value_once():
    calls = []

    def find():
        calls.append(1)
        return (len(calls),)

    lazy = Lazy(find)
    assert not calls                                   # nothing found until read
    assert lazy.value == (1,) and lazy.get() == (1,) and lazy.value is lazy.value and len(calls) == 1
    assert Lazy.of(None).value is None and Lazy.of(()).get() == ()
