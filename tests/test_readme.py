"""The README's snippets for the loss contract, model state and NNX run as written."""
import re
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
