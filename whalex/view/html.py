"""The plan as HTML for notebooks: `plan._repr_html_()`, rendered from `sections(plan)`.

One self-contained fragment: a scoped <style> and a <div class="wx-plan">. Colours are CSS
variables that take JupyterLab's theme variables (`--jp-*`) where the page defines them, and
otherwise follow the browser's `prefers-color-scheme` (light or dark). Every section has a title;
numbers (with their units) are right-aligned in tabular figures; long sections fold (<details>).
"""
from __future__ import annotations

import base64
import html

from whalex.view.sections import Line, Pre, Section, Table

STYLE = """
.wx-plan {
  --wx-fg: var(--jp-content-font-color1, #1f2328);
  --wx-muted: var(--jp-content-font-color2, #59636e);
  --wx-bg: var(--jp-layout-color0, #ffffff);
  --wx-head: var(--jp-layout-color2, #f0f3f6);
  --wx-stripe: var(--jp-layout-color1, #f8f9fa);
  --wx-border: var(--jp-border-color2, #d1d9e0);
  --wx-accent: var(--jp-brand-color1, #0969da);
  --wx-code: var(--jp-code-font-family, ui-monospace, SFMono-Regular, Menlo, Consolas, monospace);
  color: var(--wx-fg); background: var(--wx-bg);
  font-family: var(--jp-ui-font-family, system-ui, -apple-system, "Segoe UI", sans-serif);
  font-size: 13px; line-height: 1.45; padding: 8px 12px; max-width: 1150px;
  border: 1px solid var(--wx-border); border-radius: 6px;
}
@media (prefers-color-scheme: dark) {
  .wx-plan {
    --wx-fg: var(--jp-content-font-color1, #e6edf3);
    --wx-muted: var(--jp-content-font-color2, #9198a1);
    --wx-bg: var(--jp-layout-color0, #0d1117);
    --wx-head: var(--jp-layout-color2, #212830);
    --wx-stripe: var(--jp-layout-color1, #151b23);
    --wx-border: var(--jp-border-color2, #3d444d);
    --wx-accent: var(--jp-brand-color1, #4493f8);
  }
}
body.vscode-dark .wx-plan {              /* VS Code notebooks say their theme with a class */
  --wx-fg: var(--vscode-editor-foreground, #e6edf3); --wx-muted: #9198a1;
  --wx-bg: var(--vscode-editor-background, #0d1117); --wx-head: #212830; --wx-stripe: #151b23;
  --wx-border: #3d444d; --wx-accent: #4493f8;
}
.wx-plan h2 { font-size: 16px; margin: 2px 0 8px; font-weight: 600; }
.wx-plan h2 .wx-sub { font-weight: 400; color: var(--wx-muted); font-size: 13px; }
.wx-plan details { border-top: 1px solid var(--wx-border); padding: 4px 0 6px; }
.wx-plan summary { cursor: pointer; font-weight: 600; font-size: 14px; color: var(--wx-accent); padding: 2px 0; }
.wx-plan summary .wx-count { font-weight: 400; color: var(--wx-muted); font-size: 12px; }
.wx-plan p { margin: 3px 0; white-space: pre-wrap; }
.wx-plan p.wx-i1 { margin-left: 1.5em; color: var(--wx-muted); }
.wx-plan p.wx-i2 { margin-left: 3em; color: var(--wx-muted); }
.wx-plan table { border-collapse: collapse; margin: 4px 0 6px; font-variant-numeric: tabular-nums; }
.wx-plan th, .wx-plan td { border: 1px solid var(--wx-border); padding: 2px 8px; text-align: left;
  vertical-align: top; color: var(--wx-fg); background: transparent; }
.wx-plan th { background: var(--wx-head); font-weight: 600; white-space: nowrap; }
.wx-plan tbody tr:nth-child(even) td { background: var(--wx-stripe); }
.wx-plan td.wx-num, .wx-plan th.wx-num { text-align: right; white-space: nowrap; }
.wx-plan table.wx-facts th { text-align: left; background: var(--wx-head); }
.wx-plan pre { font-family: var(--wx-code); font-size: 12px; background: var(--wx-stripe); color: var(--wx-fg);
  border: 1px solid var(--wx-border); padding: 6px 8px; overflow-x: auto; margin: 4px 0; }
.wx-plan .wx-caption { color: var(--wx-muted); font-size: 12px; }
.wx-plan th .wx-unit { font-weight: 400; color: var(--wx-muted); font-size: 11px; }
.wx-plan img { max-width: 100%; height: auto; border-radius: 4px; }
.wx-plan img.wx-dark { display: none; }
@media (prefers-color-scheme: dark) {
  .wx-plan img.wx-light { display: none; } .wx-plan img.wx-dark { display: inline; }
}
body[data-jp-theme-light="true"] .wx-plan img.wx-light { display: inline; }   /* JupyterLab says its theme */
body[data-jp-theme-light="true"] .wx-plan img.wx-dark { display: none; }
body[data-jp-theme-light="false"] .wx-plan img.wx-light, body.vscode-dark .wx-plan img.wx-light { display: none; }
body[data-jp-theme-light="false"] .wx-plan img.wx-dark, body.vscode-dark .wx-plan img.wx-dark { display: inline; }
body.vscode-light .wx-plan img.wx-light { display: inline; }
body.vscode-light .wx-plan img.wx-dark { display: none; }
"""


def _table(t: Table, facts: bool = False) -> str:
    esc = html.escape
    if facts:                                   # a two-column fact grid: label | value
        rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in t.rows)
        return f'<table class="wx-facts"><tbody>{rows}</tbody></table>'
    cls = ['class="wx-num"' if n else "" for n in t.numeric]
    units = t.units or ("",) * len(t.columns)
    head = "".join(f"<th {c}>{esc(h)}" + (f'<br><span class="wx-unit">{esc(u)}</span>' if u else "") + "</th>"
                   for c, h, u in zip(cls, t.columns, units))
    body = "".join("<tr>" + "".join(f"<td {c}>{esc(v)}</td>" for c, v in zip(cls, r)) + "</tr>" for r in t.rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _item(x) -> str:
    if isinstance(x, Line):
        cls = f' class="wx-i{min(x.indent, 2)}"' if x.indent else ""
        return f"<p{cls}>{html.escape(x.text)}</p>"
    if isinstance(x, Table):
        return _table(x, facts=x.facts)
    if isinstance(x, Pre):
        return (f'<details><summary class="wx-caption">{html.escape(x.caption)}</summary>'
                f"<pre>{html.escape(x.text)}</pre></details>")
    raise TypeError(f"unknown section item {x!r}")


def _count(section: Section) -> str:
    rows = sum(len(x.rows) for x in section.items("html") if isinstance(x, Table))
    lines = sum(1 for x in section.items("html") if isinstance(x, Line))
    n = rows or lines
    noun = ("row" if rows else "line") + ("" if n == 1 else "s")
    return f' <span class="wx-count">({n} {noun})</span>' if section.collapsed and n else ""


def render(sections: tuple[Section, ...], pictures: dict[str, bytes] | None = None, subtitle: str = "") -> str:
    """A notebook-ready HTML fragment: every section (titled, long ones folded) and the plan's picture,
    `pictures[theme]` a PNG per page theme ("light", "dark"); the page's theme shows one of them."""
    parts = [f"<style>{STYLE}</style>", '<div class="wx-plan">',
             f'<h2>whalex plan <span class="wx-sub">{html.escape(subtitle)}</span></h2>']
    for s in sections:
        body = "".join(_item(x) for x in s.items("html"))
        if s.key == "overview":
            parts.append(f'<div class="wx-section" data-section="overview">{body}</div>')
            continue
        parts.append(f'<details data-section="{html.escape(s.key)}"{"" if s.collapsed else " open"}>'
                     f"<summary>{html.escape(s.title)}{_count(s)}</summary>{body}</details>")
    if pictures:
        imgs = "".join(f'<img class="wx-{theme}" alt="the plan: device mesh, loads, predicted time, memory, '
                       f'schedule, traffic" src="data:image/png;base64,{base64.b64encode(data).decode("ascii")}">'
                       for theme, data in pictures.items())
        parts.append('<details data-section="picture" open><summary>Picture: devices, loads, memory'
                     f'</summary>{imgs}</details>')
    parts.append("</div>")
    return "\n".join(parts)
