"""The README's snippets run as written: the quickstart and the plan view (in a fresh interpreter),
the loss contract, model state, NNX and checkpoints."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SECTIONS = ("## The loss contract", "## Model state and randomness", "## Flax NNX", "## Checkpoints")


def _blocks():
    text = README.read_text()
    out = []
    for title in SECTIONS:
        start = text.index(title)
        end = text.index("\n## ", start + 1)
        out += [(title, b) for b in re.findall(r"```python\n(.*?)```", text[start:end], re.S)]
    return out


@pytest.mark.parametrize("title,code", _blocks(), ids=lambda x: x[:30] if isinstance(x, str) else None)
def test_readme_snippet_runs(title, code):
    exec(compile(code, f"README.md ({title})", "exec"), {})


def _first_block(title: str) -> str:
    text = README.read_text()
    start = text.index(title)
    return re.search(r"```python\n(.*?)```", text[start:text.index("\n## ", start + 1)], re.S).group(1)


def test_quickstart_and_plan_view_run_as_written_in_a_fresh_python(tmp_path):
    """The quickstart, then the notebook-view section that continues it, in a new interpreter whose
    XLA_FLAGS is unset: the snippet itself must ask for the 8 simulated CPU devices."""
    code = _first_block("## Quickstart") + "\n" + _first_block("## Seeing a plan")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(README.parent)] + [p for p in [env.get("PYTHONPATH")] if p])
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "whalex plan:" in out.stdout and "split(8)" in out.stdout          # the summary
    assert out.stdout.count("\n") > 10 and "<whalex.Plan: 8 x " in out.stdout   # the one-line repr
    assert "measured" in out.stdout and "predicted" in out.stdout             # time_steps
    assert (tmp_path / "plan.png").stat().st_size > 10_000                    # the picture
