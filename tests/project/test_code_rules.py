"""Rules the code keeps that a reader relies on: functions of one phase (none over 60 lines in whalex/
or bench/),
and comments that explain rather than keep a lab notebook (no benchmark figures or issue numbers in a
docstring or comment of whalex/ or tests/; figures live in docs/benchmarks.md, history in git).

Everything is read with `ast` and `tokenize`; nothing is imported.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[2]
LIBRARY = PROJECT / "whalex"
BENCH = PROJECT / "bench"

# ------------------------------------------------------------------------------------ function length
MAX_FUNCTION_LINES = 60


def _functions(source: str):
    """(qualified name, first line, lines) of every function and method, nested ones too, counted
    from the `def` line to the last line of its body."""
    found = []

    def visit(node, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                found.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def _long_functions(top: Path = LIBRARY) -> list[str]:
    """Every function under `top` over MAX_FUNCTION_LINES, as "where name: N lines"."""
    long = []
    for path in sorted(top.rglob("*.py")):
        rel = path.relative_to(PROJECT).as_posix()
        long.extend(f"{rel}:{line} {name}: {n} lines" for name, line, n in _functions(path.read_text())
                    if n > MAX_FUNCTION_LINES)
    return long


def test_no_function_is_over_60_lines():
    """A function does one phase: past 60 lines it mixes several (validate, decide, build, report)."""
    long = _long_functions()
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them by phase):\n" + "\n".join(long)


def test_no_bench_function_is_over_60_lines():
    """A bench reads like the library: its main parses, builds, runs and reports in functions of one
    phase each."""
    long = _long_functions(BENCH)
    assert not long, f"bench functions over {MAX_FUNCTION_LINES} lines (split them by phase):\n" + "\n".join(long)


def test_function_lengths_are_counted_from_def_to_the_last_line():
    src = "class K:\n    def m(self):\n        def inner():\n            return 1\n\n        return inner\n\n" \
          "def f(\n    x,\n):\n    return x\n"
    assert _functions(src) == [("K.m", 2, 5), ("K.m.inner", 3, 2), ("f", 8, 4)]


# ----------------------------------------------------------------------------- comments that explain
# What a comment or docstring may not hold, sentence by sentence (N a number; FLAGGED below has examples):
# - history: "issue N", "Build N", "Acceptance N" (git and the issue tracker hold it);
# - a run's figures: a time or a byte size (N ms, N s, N KB, N GiB) in a sentence that says it was
#   measured (measured, took, timed, profiled, ran, on N cores, bench/); a figure right after
#   "measured" (measured Nx, measured: N ms; not "measured Nx slower", which is a setting); an
#   approximate run time (~N s, about N min, N s here); a before -> after figure with a unit; a ratio
#   or percentage in a sentence citing bench/.
# Constants stay legitimate (KEPT below): a timeout, a device's memory, a test's synthetic timings, a
# mesh's shape, a tolerance.
_NUM = r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?"                 # 12, 0.7, 60-97
_TIME = rf"{_NUM}\s?(?:ms|µs|us|ns|s|sec|seconds|min|minutes)\b"
_UNIT = r"(?:ms|µs|us|s|min|[KMGT]i?B|x|%)"
HISTORY = re.compile(r"\b(?:[Ii]ssues?|[Aa]cceptance)[\s-]+#?\d+|\bBuilds?[\s-]+\d+\b")
FIGURE = re.compile(rf"{_TIME}|{_NUM}\s?[KMGT]i?B\b")
MEASURED = re.compile(r"\bmeasur(?:ed|ing)\b|\btook\b|\btimed\b|\bprofiled\b|\bran\b|"
                      r"\bon (?:one|two|\d+)(?: shared)? cores?\b|\bbench/", re.I)
RUN_FIGURE = re.compile(rf"\bmeasured:?\s+(?:at\s+)?{_NUM}\s?{_UNIT}(?!\w)(?!\s+(?:faster|slower))|"
                        rf"(?:~|≈|\babout |\baround ){_TIME}|{_TIME} here\b|"
                        rf"{_NUM}\s?{_UNIT}?\s?->\s?{_NUM}\s?{_UNIT}(?!\w)")
BENCH_RATIO = re.compile(rf"{_NUM}(?:x|%)(?!\w).*\bbench/|\bbench/.*{_NUM}(?:x|%)(?!\w)")


def _comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every docstring and comment; consecutive whole-line comments are one text."""
    found, block = [], []
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        row, text = tok.start[0], tok.string.lstrip("#")
        whole_line = not lines[row - 1][:tok.start[1]].strip()
        if block and whole_line and block[-1][0] == row - 1 and block[-1][2]:
            block.append((row, text, whole_line))
            continue
        if block:
            found.append((block[0][0], " ".join(t for _, t, _ in block)))
        block = [(row, text, whole_line)]
    if block:
        found.append((block[0][0], " ".join(t for _, t, _ in block)))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, doc))
    return found


def _lab_notes(source: str) -> list[tuple[int, str]]:
    """(line, sentence) of each sentence of a comment or docstring that holds history or a run's figures."""
    found = []
    for line, text in _comments_and_docstrings(source):
        for sentence in re.split(r"(?<=[.;])\s+|\n\s*\n", text):
            s = " ".join(sentence.split())
            if HISTORY.search(s) or RUN_FIGURE.search(s) or BENCH_RATIO.search(s) or \
                    (FIGURE.search(s) and MEASURED.search(s)):
                found.append((line, s))
    return found


def test_no_benchmark_figures_or_issue_numbers_in_comments():
    """Docstrings and comments of whalex/ and tests/ say what the code does and why; run times,
    benchmark figures and issue numbers belong in docs/benchmarks.md, bench/results and git."""
    found = [f"{path.relative_to(PROJECT).as_posix()}:{line}: {s[:160]}"
             for top in ("whalex", "tests") for path in sorted((PROJECT / top).rglob("*.py"))
             for line, s in _lab_notes(path.read_text())]
    assert not found, "history or benchmark figures in comments (move them to docs/benchmarks.md):\n" + \
        "\n".join(found)


FLAGGED = [
    "Issue 12, Build 4: host RAM bounds offload.",
    "(acceptance 5)",
    "Issue-6 options: ZeRO level, remat",
    "8 heads took 304 ms in chunks of 4, on CPU.",
    "a 262 KB all-gather per step (measured in bench/moe_dispatch.py).",
    "measured 1.16x: one buffer over",
    "print(timing)  # measured 41.2 ms per step",
    "~0.7 s here, half of measuring each TaskGraph",
    "the suite 900 -> 625 s on 2 cores",
    "2.9x faster to produce than replicated leaves (bench/params_view.py)",
    "XLA CPU ran the jnp.pad as one 60-97 ms loop fusion per step.",
]
KEPT = [
    "gives up after 30 s, and a slow device's timings end later",
    "a V100 DGX-1: 512 GB for 8 GPUs",
    "two devices: 2 ms fixed + 10 us/row, and 6 ms fixed + 30 us/row (3x slower at everything)",
    "pretend half the devices measured 3x slower: the plan follows the measurement",
    "the mesh is data 4 x model 2; 5% noise -> one speed",
    "relative spread of each measured speed (0.05: +-5%)",
    "Build the mesh first; issue the collectives after the loop.",
]


@pytest.mark.parametrize("text, flagged", [(t, True) for t in FLAGGED] + [(t, False) for t in KEPT])
def test_lab_notes_are_told_from_constants(text, flagged):
    assert bool(_lab_notes(f"# {text}\n")) == flagged
    assert bool(_lab_notes(f'def f():\n    """{text}"""\n')) == flagged


def test_consecutive_comment_lines_are_one_text():
    src = "x = 1  # a trailing note\n# a comment on\n# two lines\ny = 2  # another\n"
    assert _comments_and_docstrings(src) == [(1, " a trailing note"), (2, " a comment on  two lines"),
                                             (4, " another")]
