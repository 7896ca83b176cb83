"""The plan as plain text: `plan.summary()`, rendered from `sections(plan)`."""
from __future__ import annotations

from whalex.view.format import text_table
from whalex.view.sections import Line, Pre, Section, Table


def render(sections: tuple[Section, ...]) -> str:
    lines: list[str] = []
    for section in sections:
        for item in section.items("text"):
            if isinstance(item, Line):
                lines.append("  " * item.indent + item.text)
            elif isinstance(item, Table):
                lines += text_table(item.columns, item.rows)
            elif isinstance(item, Pre):
                lines += item.text.splitlines()
    return "\n".join(lines)
