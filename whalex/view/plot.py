"""The plan as pictures (matplotlib): `plan.plot()` and the image in the notebook view.

One Figure, built without pyplot (no global figure state):
  * the device mesh, one cell per device, coloured by device kind;
  * each device's load (batch rows, or the balanced unit), beside the even plan's on a heterogeneous plan;
  * each device's predicted compute per step (the cost model of `whalex.view.timing.predict`);
  * each device's memory (parameters, gradients, optimizer state, activations) against its capacity;
  * for pipelines, the schedule: stages x ticks, forward and backward tasks, and the bubble;
  * the collective traffic of each TaskGraph, by kind of collective.
Axes carry labels ("mesh", "loads", "time", "memory", "schedule", "traffic") for tests and tools.
"""
from __future__ import annotations

import io

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from whalex.view.format import fmt_bytes, fmt_time
from whalex.view.timing import predict

KIND_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")
MEMORY_COLORS = {"params": "#4C72B0", "grads": "#DD8452", "opt state": "#55A868", "activations": "#C44E52"}
FWD_COLOR, BWD_COLOR, WGT_COLOR, IDLE_COLOR = "#4C72B0", "#DD8452", "#55A868", "#EEEEEE"
TASK_COLORS = {"F": FWD_COLOR, "B": BWD_COLOR, "W": WGT_COLOR}
COMM_COLORS = {"all-reduce": "#4C72B0", "all-gather": "#55A868", "reduce-scatter": "#8172B3",
               "all-to-all": "#C44E52"}


def _scale(values, units=(("B", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40))):
    """The largest unit in which max(values) is at least 1."""
    top = max([abs(v) for v in values] + [0.0])
    best = units[0]
    for name, size in units:
        if top >= size:
            best = (name, size)
    return best


TIME_UNITS = (("us", 1e-6), ("ms", 1e-3), ("s", 1.0))


def kind_colors(kinds) -> dict[str, str]:
    """A colour per device kind, in order of first appearance (the same in every panel)."""
    out: dict[str, str] = {}
    for k in kinds:
        if k not in out:
            out[k] = KIND_COLORS[len(out) % len(KIND_COLORS)]
    return out


def _used(plan) -> int:
    return len(plan.memory) or plan.cluster.size


def _kinds(plan) -> tuple[str, ...]:
    return tuple(plan.cluster.kinds[: _used(plan)])


def _device_axis(ax, n: int) -> None:
    """x: one tick per device (up to 32 devices; matplotlib chooses beyond)."""
    ax.set_xlabel("device")
    if n <= 32:
        ax.set_xticks(range(n))


def _legend_on_top(ax, handles=None) -> None:
    """A one-row legend inside the top of the axes, with headroom so that it covers no bar."""
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi + 0.3 * (hi - lo))
    kw = {"handles": handles} if handles is not None else {}
    ax.legend(**kw, fontsize=8, loc="upper center", ncol=5, frameon=False, columnspacing=1.0, handlelength=1.5)


def draw_mesh(ax, plan, colors) -> None:
    names, sizes = plan.layout.axis_names, plan.layout.axis_sizes
    kinds = _kinds(plan)
    if len(sizes) == 1:
        rows, cols, ylabel, xlabel = 1, sizes[0], "", f"{names[0]} ({sizes[0]})"
    else:
        rows, cols = sizes[0], int(np.prod(sizes[1:]))
        ylabel = f"{names[0]} ({sizes[0]})"
        xlabel = " x ".join(f"{n} ({s})" for n, s in zip(names[1:], sizes[1:]))
    n = min(rows * cols, len(kinds))
    for i in range(n):
        r, c = divmod(i, cols)
        ax.add_patch(Rectangle((c + 0.04, r + 0.04), 0.92, 0.92, facecolor=colors[kinds[i]], edgecolor="white"))
        if rows * cols <= 64:
            ax.text(c + 0.5, r + 0.5, str(i), ha="center", va="center", color="white", fontsize=10,
                    fontweight="bold")
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_aspect("equal" if rows * cols <= 64 else "auto")
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"Device mesh: {n} devices, coloured by kind", fontsize=10)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()], loc="center left",
              bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    ax.set_label("mesh")


def draw_loads(ax, plan, colors) -> None:
    r = plan.balance
    if r is not None:
        ids = [d.device for d in r.devices]
        load = [d.rows for d in r.devices]
        even = [d.even_rows for d in r.devices]
        ax.bar(np.array(ids) + 0.2, even, 0.4, color="none", edgecolor="#888888", hatch="//", label="even")
        ax.bar(np.array(ids) - 0.2, load, 0.4, color=[colors.get(d.kind, KIND_COLORS[0]) for d in r.devices],
               label="load")
        _legend_on_top(ax, [Patch(color="#888888", label="balanced (colour: kind)"),
                            Patch(facecolor="none", edgecolor="#888888", hatch="//", label="even plan")])
        what = "batch rows" if r.of_batch else r.kind
        ax.set_title(f"Load per device: {what}, {'balanced' if r.applied else 'even (not balanced)'}", fontsize=10)
        ax.set_ylabel(f"{what} per step")
    else:
        kinds = _kinds(plan)
        sizes = plan.batch_sizes
        ax.bar(range(len(sizes)), sizes, 0.6, color=[colors.get(k, KIND_COLORS[0]) for k in kinds[: len(sizes)]],
               label="load")
        ax.set_title(f"Batch rows per device (global batch {plan.global_batch})", fontsize=10)
        ax.set_ylabel("rows per step")
    _device_axis(ax, len(r.devices) if r is not None else len(plan.batch_sizes))
    ax.set_label("loads")


def draw_time(ax, plan, colors) -> None:
    p = predict(plan)
    kinds = _kinds(plan)
    name, unit = _scale(p.device_times + (p.even_times or ()), TIME_UNITS)
    ids = np.arange(len(p.device_times))
    cs = [colors.get(kinds[i], KIND_COLORS[0]) if i < len(kinds) else KIND_COLORS[0] for i in ids]
    if p.even_times is not None:
        ax.bar(ids + 0.2, [t / unit for t in p.even_times], 0.4, color="none", edgecolor="#888888",
               hatch="//", label="even")
        ax.bar(ids - 0.2, [t / unit for t in p.device_times], 0.4, color=cs, label="predicted")
        _legend_on_top(ax, [Patch(color="#888888", label="balanced (colour: kind)"),
                            Patch(facecolor="none", edgecolor="#888888", hatch="//", label="even plan")])
    else:
        ax.bar(ids, [t / unit for t in p.device_times], 0.6, color=cs, label="predicted")
    ax.axhline(p.step_time / unit, color="#444444", linestyle="--", linewidth=1)
    ax.set_title(f"Predicted compute per step (step: slowest device, {fmt_time(p.step_time)})", fontsize=10)
    ax.set_ylabel(name)
    _device_axis(ax, len(ids))
    ax.set_label("time")


def draw_memory(ax, plan, colors) -> None:
    mem = plan.memory
    parts = {"params": [m.params for m in mem], "grads": [m.grads for m in mem],
             "opt state": [m.opt_state for m in mem], "activations": [m.activations for m in mem]}
    totals = [sum(v) for v in zip(*parts.values())]
    caps = [m.capacity for m in mem]
    draw_caps = bool(caps) and max(caps) <= 10 * max(totals + [1.0])
    name, unit = _scale(totals + (caps if draw_caps else []))
    ids = np.arange(len(mem))
    bottom = np.zeros(len(mem))
    for label, values in parts.items():
        v = np.array(values) / unit
        ax.bar(ids, v, 0.6, bottom=bottom, color=MEMORY_COLORS[label], label=label)
        bottom += v
    if draw_caps:
        ax.hlines([c / unit for c in caps], ids - 0.4, ids + 0.4, colors="#222222", linewidth=2, label="capacity")
        note = "black: capacity"
    else:
        lo, hi = min(caps, default=0), max(caps, default=0)
        used = max((t / c for t, c in zip(totals, caps) if c), default=0.0)
        span = fmt_bytes(lo) if lo == hi else f"{fmt_bytes(lo)} to {fmt_bytes(hi)}"
        note = f"capacity {span}, {100 * used:.1g}% used"
    ax.set_title(f"Memory per device ({note})", fontsize=10)
    ax.set_ylabel(name)
    _device_axis(ax, len(mem))
    _legend_on_top(ax)
    ax.set_label("memory")


def draw_schedule(ax, plan) -> None:
    s = plan.schedule
    T, S = s.num_ticks, s.num_stages
    idle = _idle_color()
    ax.add_patch(Rectangle((0, 0), T, S, facecolor=idle, edgecolor="none"))
    for t, row in enumerate(s.ticks):
        for k, task in enumerate(row):
            if task is None:
                continue
            ax.add_patch(Rectangle((t + 0.03, k + 0.06), 0.94, 0.88, facecolor=TASK_COLORS[task.kind],
                                   edgecolor="none", alpha=0.95))
            if T <= 80:
                label = str(task.microbatch) + (f"c{task.chunk}" if s.virtual_stages > 1 else "")
                ax.text(t + 0.5, k + 0.5, label, ha="center", va="center", color="white",
                        fontsize=8 if T <= 40 else 6)
    ax.set_xlim(0, T)
    ax.set_ylim(S, 0)
    ax.set_yticks(np.arange(S) + 0.5, [f"stage {k}" for k in range(S)])
    ax.set_xlabel("tick")
    ax.set_title(f"Pipeline schedule {s.name}: {S} stages x {s.num_micro_batch} micro-batches, {T} ticks, "
                 f"bubble {s.bubble_fraction:.1%} (numbers: micro-batch"
                 + (", c: chunk" if s.virtual_stages > 1 else "") + ")", fontsize=10)
    kinds = [Patch(color=FWD_COLOR, label="forward"), Patch(color=BWD_COLOR, label="backward")]
    if s.split_backward:
        kinds = [kinds[0], Patch(color=BWD_COLOR, label="B (input gradient)"),
                 Patch(color=WGT_COLOR, label="W (weight gradient)")]
    ax.legend(handles=kinds + [Patch(color=idle, label="idle")], fontsize=8, loc="upper left",
              bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_label("schedule")


def draw_traffic(ax, plan) -> None:
    tgs = [t.index for t in plan.task_graphs]
    kinds = sorted({c.kind for c in plan.comms})
    per = {(t, k): 0.0 for t in tgs for k in kinds}
    for c in plan.comms:
        per[(c.taskgraph, c.kind)] = per.get((c.taskgraph, c.kind), 0.0) + c.bytes
    total = sum(c.bytes for c in plan.comms)
    ax.set_title(f"Collective traffic per step and device, by TaskGraph (total {fmt_bytes(total)})", fontsize=10)
    ax.set_label("traffic")
    if not plan.comms:
        ax.text(0.5, 0.5, "no collectives", ha="center", va="center", transform=ax.transAxes)
        ax.set_yticks(range(len(tgs)), [f"TG{t}" for t in tgs])
        return
    name, unit = _scale([sum(per[(t, k)] for k in kinds) for t in tgs])
    left = np.zeros(len(tgs))
    for k in kinds:
        v = np.array([per[(t, k)] for t in tgs]) / unit
        ax.barh(range(len(tgs)), v, 0.6, left=left, color=COMM_COLORS.get(k, "#8C8C8C"), label=k)
        left += v
    ax.set_yticks(range(len(tgs)), [t.name + " " + t.strategy for t in plan.task_graphs])
    ax.invert_yaxis()
    ax.set_xlabel(f"{name} per step and device")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def _idle_color() -> str:
    """Idle ticks: light grey on a light page, dark grey on a dark one (the theme's rcParams)."""
    import matplotlib
    return "#2d333b" if matplotlib.colors.to_rgb(matplotlib.rcParams["axes.facecolor"])[0] < 0.5 else IDLE_COLOR


def plot(plan, width: float = 12.0) -> Figure:
    """The plan's picture: mesh, loads, predicted time, memory, [pipeline schedule], traffic."""
    colors = kind_colors(_kinds(plan))
    pipeline = plan.schedule is not None
    ntg = len(plan.task_graphs)
    heights = [2.9, 2.9] + ([0.6 + 0.35 * plan.schedule.num_stages] if pipeline else []) + [0.9 + 0.3 * ntg]
    fig = Figure(figsize=(width, sum(heights) + 0.6), layout="constrained")
    grid = fig.add_gridspec(len(heights), 2, height_ratios=heights)
    draw_mesh(fig.add_subplot(grid[0, 0]), plan, colors)
    draw_loads(fig.add_subplot(grid[0, 1]), plan, colors)
    draw_time(fig.add_subplot(grid[1, 0]), plan, colors)
    draw_memory(fig.add_subplot(grid[1, 1]), plan, colors)
    row = 2
    if pipeline:
        draw_schedule(fig.add_subplot(grid[row, :]), plan)
        row += 1
    draw_traffic(fig.add_subplot(grid[row, :]), plan)
    mesh = " x ".join(f"{n}={s}" for n, s in zip(plan.layout.axis_names, plan.layout.axis_sizes))
    fig.suptitle(f"whalex plan: {_used(plan)} devices, mesh {mesh}, global batch {plan.global_batch}, "
                 f"{ntg} TaskGraph{'s' if ntg > 1 else ''}", fontsize=11)
    return fig


def png(fig: Figure, dpi: int = 80) -> bytes:
    """The figure as PNG bytes (the Agg renderer; no display needed)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


# Text, axes and backgrounds for a dark notebook theme (the data colours stay: they read on both).
DARK_RC = {"figure.facecolor": "#0d1117", "axes.facecolor": "#0d1117", "savefig.facecolor": "#0d1117",
           "text.color": "#e6edf3", "axes.labelcolor": "#e6edf3", "axes.edgecolor": "#9198a1",
           "xtick.color": "#c9d1d9", "ytick.color": "#c9d1d9", "grid.color": "#3d444d",
           "legend.facecolor": "#151b23", "legend.edgecolor": "#3d444d"}


def themed_pngs(plan) -> dict[str, bytes]:
    """The plan's picture drawn for a light and for a dark page: {"light": png, "dark": png}."""
    import matplotlib
    out = {"light": png(plot(plan))}
    with matplotlib.rc_context(DARK_RC):
        out["dark"] = png(plot(plan))
    return out
