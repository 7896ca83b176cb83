"""The plan's notebook view, pictures, short repr, schedule picture and measured-vs-predicted.

The four plans are tools/render_plans.py's (hybrid, pipeline, heterogeneous, MoE), built once.
"""
import html
import os
import shutil
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

import whalex as wh
from whalex.records.schedules import make_schedule, render
from whalex.view import StepTiming, plot as plot_view, text as view_text
from whalex.view.sections import Line, Pre, Table

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import render_plans  # noqa: E402

KINDS = ("hybrid", "pipeline", "heterogeneous", "moe")


@pytest.fixture(scope="module")
def plans():
    return render_plans.build_plans()


@pytest.fixture(scope="module")
def views(plans):
    return {name: plan._repr_html_() for name, plan in plans.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_html_holds_every_section_of_the_summary(plans, views, kind):
    plan, page = plans[kind], views[kind]
    sections = plan.sections()
    assert plan.summary() == view_text.render(sections)                    # the text renders the same sections
    for s in sections:
        assert f'data-section="{s.key}"' in page
        if s.key != "overview":
            assert f"<summary>{html.escape(s.title)}" in page, s.title
        for item in s.items("html"):
            if isinstance(item, Line):
                assert html.escape(item.text) in page, item.text
            elif isinstance(item, Table):
                for row in item.rows:
                    for cell in row:
                        assert html.escape(cell) in page, cell
            elif isinstance(item, Pre):
                assert html.escape(item.text) in page
    # every line the text summary prints outside a table reaches the HTML (or is a heading the title gives)
    text_only = {x.text for s in sections for x in s.body if isinstance(x, Line) and x.where == "text"}
    shown = [x.text for s in sections for x in s.items("html") if isinstance(x, Line)]
    for s in sections:
        for x in s.items("text"):
            if isinstance(x, Line):
                assert x.text in shown or x.text in text_only
    # the facts the old view dropped
    mesh = " x ".join(f"{n}={k}" for n, k in zip(plan.layout.axis_names, plan.layout.axis_sizes))
    assert html.escape(mesh) in page and "micro-batches" in page and "data:image/png;base64," in page
    assert "prefers-color-scheme: dark" in page and "--jp-layout-color0" in page and "wx-num" in page


def test_picture_follows_the_page_theme(views):
    """A light and a dark picture; the page's theme (browser, JupyterLab, VS Code) shows one."""
    import base64
    import io
    import re

    import matplotlib.image

    page = views["hybrid"]
    found = dict(re.findall(r'<img class="wx-(light|dark)"[^>]*src="data:image/png;base64,([^"]+)"', page))
    assert set(found) == {"light", "dark"}
    corner = {t: matplotlib.image.imread(io.BytesIO(base64.b64decode(d)))[2, 2, :3].mean() for t, d in found.items()}
    assert corner["light"] > 0.9 and corner["dark"] < 0.2                 # the background of each
    assert 'data-jp-theme-light="false"' in page and "body.vscode-dark .wx-plan img.wx-dark" in page


def test_each_kind_shows_its_own_sections(plans, views):
    keys = {name: {s.key for s in plan.sections()} for name, plan in plans.items()}
    assert "pipeline" in keys["pipeline"] and "bubble" in views["pipeline"]
    assert "balance" in keys["heterogeneous"] and "predicted speedup" in views["heterogeneous"]
    assert "experts" in keys["moe"] and "expert parallelism" in views["moe"]
    assert {"overview", "taskgraphs", "devices", "traffic"} <= keys["hybrid"]
    assert "patterns" in keys["hybrid"] and '<details data-section="patterns">' in views["hybrid"]   # folded


def _drawn(fig) -> np.ndarray:
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())


@pytest.fixture(scope="module")
def figures(plans):
    return {name: plan.plot() for name, plan in plans.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_plot_draws(figures, kind):
    fig = figures[kind]
    image = _drawn(fig)
    assert image.shape[0] > 400 and image.shape[1] > 800 and image[..., :3].std() > 10   # not blank
    labels = {ax.get_label() for ax in fig.axes}
    assert {"mesh", "loads", "time", "memory", "traffic"} <= labels
    assert ("schedule" in labels) == (kind == "pipeline")
    assert len(plot_view.png(fig)) > 10_000


def _bars(fig, axes_label, container_label):
    ax = next(a for a in fig.axes if a.get_label() == axes_label)
    bars = next(c for c in ax.containers if c.get_label() == container_label)
    return [p.get_height() for p in bars]


def test_heterogeneous_per_device_bars_differ(figures):
    fig = figures["heterogeneous"]
    loads = _bars(fig, "loads", "load")
    assert len(loads) == 8 and loads[0] > loads[-1]                 # V100s take more rows than T4s
    even = _bars(figures["hybrid"], "loads", "load")
    assert len(set(even)) == 1                                      # the homogeneous plan is even


def test_repr_is_one_short_line(plans):
    for plan in plans.values():
        r = repr(plan)
        assert "\n" not in r and len(r) < 400 and r.startswith("<whalex.Plan:") and "param_specs" not in r
    assert "pipeline=1f1b 4 stages" in repr(plans["pipeline"])
    assert "4 x V100-32GB, 4 x T4-16GB" in repr(plans["heterogeneous"])


def test_schedule_prints_as_its_picture(plans):
    s = plans["pipeline"].schedule
    text = str(s)
    assert render(s) in text and text.count("stage ") == 4 and "bubble" in text.splitlines()[0]
    assert "\n" not in repr(s) and "bubble=" in repr(s)
    assert s == make_schedule("1f1b", 4, 4) and make_schedule("1f1b", 4, 4) == s


def test_step_timing_shows_measured_beside_predicted():
    t = StepTiming((0.010, 0.012, 0.011), predicted=0.005, basis="test")
    assert t.measured == 0.011 and abs(t.ratio - 2.2) < 1e-9
    assert "measured 11.00 ms" in str(t) and "predicted 5.00 ms" in str(t) and "2.20x" in str(t)
    assert "measured / predicted" in t._repr_html_()


def test_too_few_devices_names_the_xla_flag():
    def loss_fn(p, b):
        with wh.replicate(16):
            return jnp.mean((b["x"] @ p) ** 2)

    with pytest.raises(wh.PlanError, match="XLA_FLAGS=--xla_force_host_platform_device_count=16"):
        wh.plan(loss_fn, jnp.ones((4, 2)), {"x": jnp.ones((32, 4))})


def test_render_page_and_chromium_screenshot(views, tmp_path):
    """tools/render_plans.py's page around a view; a headless Chromium screenshot where Chromium is installed."""
    html_path = tmp_path / "hybrid.html"
    html_path.write_text(render_plans.page(views["hybrid"], "hybrid plan"))
    assert html_path.read_text().startswith("<!doctype html>") and 'class="wx-plan"' in html_path.read_text()
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium (Debian: apt-get install -y chromium)")
    png = tmp_path / "hybrid.png"
    render_plans.screenshot(chromium, html_path, png, "1200,1600", dark=False)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_zero_bubble_picture_shows_b_and_w():
    """A split backward's picture: B and W in their own colours and named in the legend; the text picture
    names them W3 beside B3."""
    import types

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from whalex.view.plot import BWD_COLOR, WGT_COLOR, draw_schedule
    sched = make_schedule("zb-h1", 4, 8)
    fig, ax = plt.subplots()
    draw_schedule(ax, types.SimpleNamespace(schedule=sched))
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["forward", "B (input gradient)", "W (weight gradient)", "idle"]
    colours = [matplotlib.colors.to_hex(p.get_facecolor()) for p in ax.patches[1:]]
    assert colours.count(WGT_COLOR.lower()) == colours.count(BWD_COLOR.lower()) == 4 * 8
    plt.close(fig)
    assert "W7" in render(sched) and "B7" in render(sched)
