"""The README's and docs/*.md's snippets run as written: the quickstart and the plan view (in a fresh
interpreter), the loss contract, model state, NNX and checkpoints. Every ```python block in README.md
and docs/*.md is accounted for: run here, or listed as illustrative with the reason. Links between
the pages, the files they name, and the code's citations of docs/architecture.md resolve."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README] + sorted((ROOT / "docs").glob("*.md"))

# Sections (file, heading prefix) whose ```python blocks run in this process, each in a new namespace.
RUN = (
    ("docs/loss-contract.md", "The loss contract"),
    ("docs/state-rng-nnx.md", "Model state and randomness"),
    ("docs/state-rng-nnx.md", "Flax NNX"),
    ("docs/checkpoints.md", "Checkpoints"),
)
# Sections whose first blocks run together, in this order, in a fresh interpreter.
FRESH = (
    ("README.md", "Quickstart"),
    ("docs/plan-view.md", "Seeing a plan"),
)
# Sections whose blocks are not run, and why: fragments of a model the reader writes, or several processes.
ILLUSTRATIVE = {
    ("docs/parallelism.md", "Pipelines"): "stage0 and stage1 are the reader's model",
    ("docs/parallelism.md", "3D parallelism"): "a fragment: d, loss_fn and the model are the reader's",
    ("docs/parallelism.md", "Heterogeneous GPUs"):
        "loss_fn, params and batch are the reader's (tests/balance/test_heterogeneous_balance.py runs it)",
    ("docs/parallelism.md", "Planning without hardware"):
        "params_shapes and batch_shapes are the reader's (tests/mesh/test_abstract_cluster.py)",
    ("docs/parallelism.md", "Mixture of Experts"):
        "model and task_loss are the reader's (examples/moe_transformer.py runs it)",
    ("docs/memory.md", "On many GPUs, without them: XLA's GPU compiler"):
        "loss_fn, params and batch are the reader's, and it needs the [cuda] extra (tests/gpu_compile runs it)",
}


def _parse(path: Path):
    """(heading path, fence info, code) for every fenced block; headings inside fences are not headings."""
    heads: list[tuple[int, str]] = []
    blocks, fence, body = [], None, []
    for line in path.read_text().splitlines():
        if fence is None:
            m = re.match(r"(#+) (.*)", line)
            if m:
                level = len(m.group(1))
                heads = [h for h in heads if h[0] < level] + [(level, m.group(2).strip())]
            elif line.startswith("```"):
                fence, body = line[3:].strip(), []
        elif line.startswith("```"):
            blocks.append((tuple(h for _, h in heads), fence, "\n".join(body) + "\n"))
            fence = None
        else:
            body.append(line)
    return blocks


def _python_blocks():
    """{(file, heading path): [code, ...]} for every ```python block of the README and docs."""
    out: dict = {}
    for page in PAGES:
        for heads, fence, code in _parse(page):
            if fence == "python":
                out.setdefault((page.relative_to(ROOT).as_posix(), heads), []).append(code)
    return out


def _owner(key, table):
    """The entry of `table` whose section holds the blocks under `key` (innermost heading first)."""
    name, heads = key
    for head in reversed(heads):
        for entry in table:
            if entry[0] == name and head.startswith(entry[1]):
                return entry
    return None


def _blocks_of(entry) -> list[str]:
    return [code for key, codes in _python_blocks().items() if _owner(key, [entry]) for code in codes]


def test_every_python_block_is_run_or_marked_illustrative():
    tables = (RUN, FRESH, tuple(ILLUSTRATIVE))
    for key in _python_blocks():
        owners = [e for t in tables if (e := _owner(key, t)) is not None]
        assert owners, (f"a ```python block in {key[0]} under {' > '.join(key[1])} is neither run nor marked: "
                        "add its section to RUN or FRESH in tests/project/test_readme.py, or to ILLUSTRATIVE "
                        "with the reason")
    for entry in RUN + FRESH + tuple(ILLUSTRATIVE):
        assert _blocks_of(entry), f"{entry}: no ```python block under that heading (renamed or moved?)"


@pytest.mark.parametrize("entry", RUN, ids=lambda e: f"{e[0]}:{e[1]}")
def test_doc_snippet_runs(entry):
    for code in _blocks_of(entry):
        exec(compile(code, f"{entry[0]} ({entry[1]})", "exec"), {})


def test_quickstart_and_plan_view_run_as_written_in_a_fresh_python(tmp_path):
    """The quickstart, then the notebook-view page that continues it, in a new interpreter whose
    XLA_FLAGS is unset: the snippet itself must ask for the 8 simulated CPU devices."""
    code = "\n".join(_blocks_of(entry)[0] for entry in FRESH)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "whalex plan:" in out.stdout and "split(8)" in out.stdout          # the summary
    assert out.stdout.count("\n") > 10 and "<whalex.Plan: 8 x " in out.stdout   # the one-line repr
    assert "measured" in out.stdout and "predicted" in out.stdout             # time_steps
    assert (tmp_path / "plan.png").stat().st_size > 10_000                    # the picture


# ---- links, named files, citations ----------------------------------------------------------------

def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {_anchor(m) for m in re.findall(r"^#+ (.*)$", text, re.M)}


def test_links_between_pages_resolve():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            assert dest.exists(), f"{page.relative_to(ROOT)} links to {target}: no such file"
            if anchor:
                assert anchor in _anchors(dest), f"{page.relative_to(ROOT)} links to {target}: no such heading"


def test_files_the_pages_name_exist():
    """A page that names a file by its path from the repository root names one that is there."""
    for page in PAGES:
        cited = re.findall(r"\b((?:whalex|tests|bench|examples|tools)/[\w/]+\.(?:py|ipynb))", page.read_text())
        for path in set(cited):
            assert (ROOT / path).exists(), f"{page.relative_to(ROOT)} names {path}, which does not exist"


def _module_map() -> set[str]:
    """The modules docs/architecture.md's module map names: `whalex/x.py` lines, and under a
    `whalex/pkg/` line the bare `name.py`s that follow it. A package's `__init__.py` may go unnamed."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"^## Module map\n.*?^```text\n(.*?)^```", text, re.S | re.M).group(1)
    named, package = set(), ""
    for line in block.splitlines():
        head = re.match(r"(whalex/[\w/]*?)(\w+\.py)?(?=\s|$)", line)
        if head and head.group(2):
            named.add(head.group(1) + head.group(2))
            package = ""
            continue
        if head:
            package, line = head.group(1), line[head.end():]
        named |= {package + name for name in re.findall(r"\b(\w+\.py)\b", line)} if package else set()
    return named


def test_module_map_names_every_module_and_only_those():
    """The design document's module map follows the code (the old README's named a `view/schedule.py`
    long after it had gone, and left out `planner/hybrid.py`)."""
    named = _module_map()
    stale = sorted(n for n in named if not (ROOT / n).exists())
    missing = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "whalex").rglob("*.py")
                     if p.name != "__init__.py" and p.relative_to(ROOT).as_posix() not in named)
    assert not stale, f"docs/architecture.md's module map names modules that do not exist: {stale}"
    assert not missing, f"modules missing from docs/architecture.md's module map: {missing}"


def test_code_cites_the_design_document_in_the_repository():
    """Comments and docstrings cite docs/architecture.md by anchor, and every cited section exists."""
    anchors = _anchors(ROOT / "docs" / "architecture.md")
    old = "DESIGN" + ".md"
    for folder in ("whalex", "tests", "bench", "tools", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            assert old not in text, \
                f"{path.relative_to(ROOT)} cites {old}, which is not in the repository: cite docs/architecture.md"
            for anchor in re.findall(r"docs/architecture\.md#([\w-]+)", text):
                assert anchor in anchors, \
                    f"{path.relative_to(ROOT)} cites docs/architecture.md#{anchor}: no such section"
