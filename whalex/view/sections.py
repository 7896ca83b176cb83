"""What a plan says, as data: titled sections of lines and tables.

`plan.summary()` (text) and `plan._repr_html_()` (notebooks) both render `sections(plan)`, so the
two cannot drift. A body item says where it shows: "both" (the default), "text" only (a heading
line whose words the HTML section title already gives) or "html" only (a fact grid, the schedule's
text picture, the traffic of each collective).
"""
from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from whalex.memory.offload import fetch_per_leaf
from whalex.memory.remat import summary_lines
from whalex.records.schedules import RECOMPUTE_COSTS, render as render_schedule
from whalex.view.calibration import calibrated_range_lines, micro_batch_range_lines, speed_lines
from whalex.view.format import fmt_bytes, fmt_devices, fmt_flops, fmt_pct, fmt_speed, fmt_time
from whalex.view.timing import exchange

TASKGRAPH_COLUMNS = ("TaskGraph", "strategy", "devices/replica", "device ids", "nested DP", "params",
                     "FLOPs (fwd+bwd)", "comm/device")
PATTERN_COLUMNS = ("TaskGraph", "unit", "parameter", "pattern", "candidate costs")
COVERAGE_COLUMNS = ("TaskGraph", "parameter", "shape", "layout", "note")
MEMORY_COLUMNS = ("device ids", "kind", "batch", "params", "grads", "opt state", "activations", "host", "peak",
                  "capacity")
BALANCE_COLUMNS = ("device", "kind", "capacity", "fixed", "per unit", "even", "balanced", "share", "predicted time",
                   "predicted memory", "memory")
REFINE_COLUMNS = ("speed scale", "rows", "step (median)", "spread", "timed steps", "/ predicted (paired)", "")
TRAFFIC_COLUMNS = ("TaskGraph", "collective", "mesh axes", "bytes/device", "why")


@dataclasses.dataclass(frozen=True)
class Line:
    text: str
    indent: int = 0
    where: str = "both"          # "both" | "text" | "html"


@dataclasses.dataclass(frozen=True)
class Table:
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    numeric: tuple[bool, ...]    # per column: right-aligned in HTML (numbers with units)
    where: str = "both"
    facts: bool = False          # a label | value grid (HTML shows labels as row headers)
    units: tuple[str, ...] = ()  # per column: the unit of bare numbers, shown under the HTML heading


@dataclasses.dataclass(frozen=True)
class Pre:
    """Preformatted text (a picture made of characters), shown as is."""

    text: str
    caption: str
    where: str = "html"


@dataclasses.dataclass(frozen=True)
class Section:
    key: str                     # stable name: "overview", "taskgraphs", "pipeline", ...
    title: str                   # the heading in HTML
    body: tuple
    collapsed: bool = False      # long detail: folded in HTML

    def items(self, where: str) -> tuple:
        return tuple(x for x in self.body if x.where in ("both", where))


def _table(columns, rows, numeric, units=None) -> Table:
    """A table; `numeric` names the right-aligned columns, `units` maps a column to its unit."""
    units = units or {}
    return Table(tuple(columns), tuple(tuple(r) for r in rows), tuple(c in numeric for c in columns),
                 units=tuple(units.get(c, "") for c in columns))


def mesh_text(plan) -> str:
    return " x ".join(f"{n}={s}" for n, s in zip(plan.layout.axis_names, plan.layout.axis_sizes))


def _lines(texts, where="both") -> list[Line]:
    """Lines as the summary prints them; a leading two-space indent becomes indent level 1."""
    out = []
    for t in texts:
        indent = (len(t) - len(t.lstrip(" "))) // 2
        out.append(Line(t[2 * indent:], indent, where))
    return out


# -- the sections, in the order the summary prints them -------------------------------------------
def overview(plan) -> Section:
    c = plan.cluster
    kinds: dict[str, int] = {}
    for k in c.kinds:
        kinds[k] = kinds.get(k, 0) + 1
    facts = [("cluster", repr(c)),
             ("devices", ", ".join(f"{n} x {k}" for k, n in kinds.items())),
             ("mesh", mesh_text(plan)),
             ("global batch", f"{plan.global_batch} samples"),
             ("micro-batches", str(plan.config.num_micro_batch)),
             ("TaskGraphs", str(len(plan.task_graphs))),
             ("collective traffic", f"{fmt_bytes(plan.predicted_comm_bytes)} per step and device")]
    if plan.schedule is not None:
        facts.append(("pipeline bubble", fmt_pct(plan.schedule.bubble_fraction)))
        facts.append(("pipeline utilisation", f"{fmt_pct(plan.schedule.utilisation(*RECOMPUTE_COSTS))} in lockstep "
                                              "ticks (a backward costs three forwards: it recomputes one)"))
    for r in (plan.balance, plan.head_balance):
        if r is not None:
            facts.append(("balance" if r is plan.balance else "head balance",
                          f"{r.kind}: " + (f"predicted speedup {r.predicted_speedup:.2f}x" if r.applied
                                           else "even plan")))
    header = (f"whalex plan: {c!r}, mesh ({mesh_text(plan)}), global batch {plan.global_batch}, "
              f"{plan.config.num_micro_batch} micro-batch(es)")
    facts_table = Table(("fact", "value"), tuple(facts), (False, False), where="html", facts=True)
    placement = (Line(f"plan: {plan.placement}"),) if plan.placement else ()
    return Section("overview", "Plan", (Line(header, where="text"), *placement, facts_table))


def taskgraphs(plan) -> Section:
    rows = [[t.name, t.strategy + ("" if t.annotated else " (default)"), str(t.device_count),
             fmt_devices(t.devices), str(t.nested_dp), f"{t.num_params:,}", fmt_flops(t.flops),
             fmt_bytes(t.comm_bytes)] for t in plan.task_graphs]
    numeric = {"devices/replica", "nested DP", "params", "FLOPs (fwd+bwd)", "comm/device"}
    units = {"devices/replica": "devices", "device ids": "indices", "nested DP": "replicas", "params": "elements",
             "FLOPs (fwd+bwd)": "per step", "comm/device": "per step"}
    return Section("taskgraphs", "TaskGraphs", (_table(TASKGRAPH_COLUMNS, rows, numeric, units),))


def speeds(plan) -> Section | None:
    lines = speed_lines(plan.cluster)
    return Section("speeds", "Calibrated speeds", tuple(_lines(lines))) if lines else None


def _split_backward(plan) -> str:
    buffers = plan.report.stage_buffers()
    row = f" of {fmt_bytes(buffers.weight_row_bytes)}" if buffers and buffers.weight_row_bytes else ""
    return (f", backward split into B and W (a W's inputs held until it runs: up to {plan.schedule.weight_stash[0]} "
            f"rows{row} per stage)")


def pipeline(plan) -> Section | None:
    s = plan.schedule
    if s is None:
        return None
    reps = plan.layout.axis_sizes[0]
    chunks = f", {s.virtual_stages} chunks per stage" if s.virtual_stages > 1 else ""
    held = "chunk input(s)" if s.virtual_stages > 1 else "micro-batch(es)"
    body = [Line(f"pipeline: {s.num_stages} stages x {reps} replica{'s' if reps > 1 else ''}, schedule "
                 f"{s.name}{chunks}, {s.num_micro_batch} micro-batches, {s.num_ticks} ticks, bubble "
                 f"{s.bubble_fraction:.1%}, lockstep utilisation {s.utilisation(*RECOMPUTE_COSTS):.1%}, "
                 f"{s.stash[0]} stashed {held} per stage"
                 + (_split_backward(plan) if s.split_backward else ""))]
    seconds, source = exchange(plan)
    moving = seconds[seconds > 0]
    if len(moving):
        low, high = fmt_time(float(moving.min())), fmt_time(float(moving.max()))
        each = low if low == high else f"{low} to {high}"
        body.append(Line(f"exchanges: {len(moving)} of {s.num_ticks} ticks move messages between stages, {each} "
                         f"each over the slowest link ({source} links), counted in the predicted step time", 1))
    for k, layers in enumerate(plan.stage_layers):
        if layers:
            body.append(Line(f"stage {k}: {len(layers)} layer{'s' if len(layers) > 1 else ''} "
                             f"({', '.join(layers)})", 1))
    body += [Line(t, 1) for t in micro_batch_range_lines(plan)]
    buffers = plan.report.stage_buffers()
    if buffers is not None and buffers.head_rows_split:
        mp = dict(zip(plan.layout.axis_names, plan.layout.axis_sizes)).get("model", 1)
        body.append(Line(f"loss head (the last stage after its last split layer): its rows split over model, each of "
                         f"the {mp} model devices computing 1/{mp} of every micro-batch's rows, its gradients "
                         "summed over model", 1))
    body.append(Pre(render_schedule(s), "the schedule tick by tick (F: forward, B: backward of a micro-batch"
                    + ("; c: through chunk" if s.virtual_stages > 1 else "") + "; .. idle)"))
    return Section("pipeline", "Pipeline schedule", tuple(body))


def balance(plan, report, key: str) -> Section:
    r = report
    how = (f"{'applied' if r.applied else 'not applied: even plan'}; speeds from the {r.source}; unit {r.unit}; "
           f"Algorithm 1 moved {r.shifted} units for memory")
    head = f"hardware-aware balance of the {r.kind} ({how}):"
    bound = r.bound
    rows = [[str(d.device), d.kind, fmt_speed(d.speed, d.spread), fmt_time(d.overhead), fmt_time(d.per_unit),
             str(d.even_rows), str(d.rows), fmt_pct(d.share(r.total)),
             fmt_time(d.time) + (" (bounds)" if d is bound else ""), fmt_bytes(d.memory), fmt_bytes(d.capacity)]
            for d in r.devices]
    load = "rows" if r.of_batch else r.kind.split()[0]
    per = "per row" if load == "rows" else "per unit"
    columns = tuple(per if c == "per unit" else c for c in BALANCE_COLUMNS)
    numeric = set(columns) - {"kind"}
    units = {"capacity": "speed", "fixed": "per step", per: "predicted", "even": load, "balanced": load,
             "share": load, "predicted time": "per step", "memory": "capacity"}
    d = bound
    loads = d.rows if r.applied else d.even_rows
    tail = [f"predicted step compute: even {fmt_time(r.even_time)}, balanced "
            f"{fmt_time(r.balanced_time)} ({r.predicted_speedup:.2f}x)",
            f"device {d.device} ({d.kind}) bounds the step: fixed {fmt_time(d.overhead)} + {loads} {load} x "
            f"{fmt_time(d.per_unit)} = {fmt_time(d.overhead + loads * d.per_unit)}"]
    body = [Line(head, where="text"), Line(how[0].upper() + how[1:] + ".", where="html"),
            _table(columns, rows, numeric, units), *(Line(t, 1) for t in tail)]
    body += [Line(t, 1) for t in calibrated_range_lines(plan, r)]
    if key == "balance":
        body += refinement_items(plan, r)
    return Section(key, f"Hardware-aware balance of the {r.kind}", tuple(body))


def _rows(rows, units=()) -> str:
    return "/".join(map(str, rows)) + (f" (head {'/'.join(map(str, units))})" if units else "")


def _ratio(t) -> str:
    return "" if t.paired is None else f"{t.paired:.3f}"


def refinement_items(plan, report) -> list:
    """The splits a refinement timed on the real step, predicted beside kept (a hybrid's head sweep after
    its rows', then its rows again); or that it is still to run."""
    ref = plan.refinement
    if ref is None:
        if plan.config.hardware_aware == "refine" and report.applied:
            return [Line("refinement on the real step (Config(hardware_aware='refine')): runs during the step's "
                         "first calls; step.plan then holds the split it keeps", 1)]
        return []
    p = ref.predicted
    items = [Line(f"refined on the real step ({len(ref.points)} splits timed in {ref.rounds} rounds, {ref.own_steps} "
                  f"steps): predicted rows {_rows(p.rows, p.units)} {fmt_time(p.seconds)} ± {fmt_pct(p.spread)}; "
                  f"{_kept(ref, 'the predicted speed')}", 1), _sweep_table(ref)]
    if ref.head is not None:
        h = ref.head
        items += [Line(f"then the head's classes alone at those rows ({len(h.points)} splits timed in {h.rounds} "
                       f"rounds, {h.steps} steps; {ref.steps} in all): {_kept(h, 'that speed on the classes')}", 1),
                  _sweep_table(h)]
    if ref.again is not None:
        a = ref.again
        items += [Line(f"then the rows alone again at the classes kept ({len(a.points)} splits timed in {a.rounds} "
                       f"rounds, {a.steps} steps): {_kept(a, 'the speed kept first')}", 1), _sweep_table(a)]
    return items


def _kept(ref, of: str) -> str:
    """What a sweep kept: the prediction, or the split kept and how it was found."""
    how = "the vertex of the V fitted to the rounds" if ref.fitted else "the least median of the splits timed"
    p = ref.predicted
    if ref.kept_rows == p.rows and ref.kept_units == p.units:
        return f"kept the prediction ({how})"
    return (f"kept rows {_rows(ref.kept_rows, ref.kept_units)} (device{'s' if len(ref.slow) > 1 else ''} "
            f"{fmt_devices(ref.slow)} at x{ref.kept:.3g} of {of}, {how}): {ref.gain:.2f}x the prediction's speed")


def _sweep_table(ref) -> Table:
    """Every split a sweep timed: its scale, rows, median step, spread, timed steps and paired ratio."""
    kept = lambda t: t.rows == ref.kept_rows and t.units == ref.kept_units      # noqa: E731
    table = [[f"x{t.scale:.3g}", _rows(t.rows, t.units), fmt_time(t.seconds), fmt_pct(t.spread), str(t.steps),
              _ratio(t), "predicted" if t.scale == 1.0 else ("kept" if kept(t) else "")] for t in ref.points]
    if not any(map(kept, ref.points)):
        table.append([f"x{ref.kept:.3g}", _rows(ref.kept_rows, ref.kept_units), "", "", "0", "", "fitted, kept"])
    return Table(REFINE_COLUMNS, tuple(map(tuple, table)), (True, False, True, True, True, True, False), where="html")


def experts(plan) -> Section | None:
    lines = []
    for e in plan.report.experts:
        a2a = sum(c.bytes for c in plan.comms if c.taskgraph == e.taskgraph and c.kind == "all-to-all")
        n = plan.layout.axis_size(e.expert_axes)
        lines.append(Line(f"expert parallelism: TG{e.taskgraph} experts over {'x'.join(e.expert_axes)} ({n} devices, "
                          f"{e.experts_per_device} per device), tokens over {'x'.join(e.token_axes)}; all-to-all "
                          f"dispatch and combine, {fmt_bytes(a2a)} per step and device"))
    return Section("experts", "Expert parallelism", tuple(lines)) if lines else None


def couplings(plan) -> Section | None:
    if not plan.couplings:
        return None
    body = [Line("batch couplings of the loss (reductions over the batch, and how this plan computes them):")]
    body += [Line(c, 1) for c in plan.couplings]
    return Section("couplings", "Batch couplings of the loss", tuple(body), collapsed=len(body) > 4)


def patterns(plan) -> Section | None:
    rows = [[f"TG{p.taskgraph}", p.unit, p.param, p.pattern,
             ", ".join(f"{k}={fmt_bytes(v)}" for k, v in p.costs)] for p in plan.patterns]
    if not rows:
        return None
    return Section("patterns", "Sharding patterns",
                   (Line("sharding patterns (least communication wins):", where="text"),
                    Line("least communication wins", where="html"),
                    _table(PATTERN_COLUMNS, rows, set())), collapsed=True)


def coverage_warnings(plan) -> list[str]:
    """One line per matrix a split TaskGraph leaves whole on every device, and why."""
    return [f"warning: {c.strategy} left {c.param} {c.shape} whole" + (f": {c.note}" if c.note else "")
            for c in plan.coverage if c.left_whole]


def coverage(plan) -> Section | None:
    """What each split TaskGraph reads and how it is laid out; warnings for matrices left whole."""
    if not plan.coverage:
        return None
    body = [Line(w) for w in coverage_warnings(plan)]
    for tg in sorted({c.taskgraph for c in plan.coverage}):
        cs = [c for c in plan.coverage if c.taskgraph == tg]
        split = sum(c.spec != P() for c in cs)
        body.append(Line(f"split coverage: TG{tg} {cs[0].strategy} reads {len(cs)} parameters, {split} split"))
    rows = [[f"TG{c.taskgraph}", c.param, "x".join(map(str, c.shape)) or "scalar", str(c.spec), c.note]
            for c in plan.coverage]
    body.append(_table(COVERAGE_COLUMNS, rows, set()))
    return Section("coverage", "Split coverage", tuple(body), collapsed=not coverage_warnings(plan))


def devices(plan) -> Section:
    peak = plan.predicted_memory()
    rows = []
    groups: dict = {}
    for m, b in zip(plan.memory, plan.batch_sizes):
        key = (m.kind, b, round(m.params), round(m.opt_state))
        groups.setdefault(key, []).append(m)
    for (kind, b, _, _), ms in groups.items():
        m = ms[0]
        rows.append([fmt_devices(tuple(x.device for x in ms)), kind, str(b), fmt_bytes(m.params),
                     fmt_bytes(m.grads), fmt_bytes(m.opt_state), fmt_bytes(m.activations),
                     fmt_bytes(m.host), fmt_bytes(peak.total) if peak is not None else "-", fmt_bytes(m.capacity)])
    numeric = set(MEMORY_COLUMNS) - {"device ids", "kind"}
    return Section("devices", "Per device: batch rows and memory",
                   (Line("per device:", where="text"),
                    _table(MEMORY_COLUMNS, rows, numeric, {"batch": "rows", "host": "pinned", "peak": "predicted",
                                                           "capacity": "device"}),
                    *_lines(peak_lines(plan))))


def peak_lines(plan) -> list[str]:
    """The predicted per-device peak of the step, and XLA's figure once the step has been compiled."""
    peak, xla = plan.predicted_memory(), plan.compiled_step_memory
    if peak is None:
        return []

    def parts(p, temp: str) -> str:
        return (f"{fmt_bytes(p.total)} = arguments {fmt_bytes(p.arguments)} + outputs {fmt_bytes(p.outputs)} + "
                f"{temp} {fmt_bytes(p.temp)}")

    lines = [f"predicted peak per device: {parts(peak, 'temporaries')} (buffers live at once in a replay of the step's "
             "jaxpr; activations: the peak less params, grads and optimizer state)"]
    if xla is not None:
        off = peak.total / xla.total - 1 if xla.total else 0.0
        lines.append(f"  XLA's compiled step: {parts(xla, 'temp')} (memory_analysis, not counting outputs written "
                     f"into the donated state); predicted {'+' if off >= 0 else '-'}{fmt_pct(abs(off))}")
    copies = plan.compiled.host_copies
    if copies is not None and copies.count:
        when = ("each leaf fetched once its gradient is made" if fetch_per_leaf(plan.layout.size) else
                "the state fetched once every gradient is all-reduced, so that the all-reduces overlap the backward")
        lines.append(f"  its host transfers: {copies.count} copies ({copies.count - copies.to_host} to the device, "
                     f"{copies.to_host} to the host), {fmt_bytes(copies.bytes)}; {copies.overlapped} with compute "
                     f"scheduled between start and done ({copies.overlapping_matmuls} with a matmul); {when}")
    return lines


def host_lines(plan) -> list[str]:
    """Host RAM per node and device (what offload may use), and whether the offloaded state fits it."""
    c = plan.cluster
    if not c.nodes:
        return []
    used = len(plan.memory)
    share = c.host_bytes[:used]
    if min(share) == float("inf"):
        return ["host memory: unknown (a device kind without a typical node; nothing bounds offload)"]
    nodes = {(len(n), ram) for n, ram in zip(c.nodes, c.host_memory) if n[0] < used}
    desc = ", ".join(f"{fmt_bytes(ram)} per node of {k} device{'s' if k > 1 else ''}" for k, ram in sorted(nodes))
    lines = [f"host memory ({c.host_source}): {desc}; {fmt_bytes(min(share))} per device"]
    worst = max(range(used), key=lambda d: plan.memory[d].host - share[d])
    host = plan.memory[worst].host
    if host > share[worst]:
        lines.append(f"  does not fit: host memory is the limit (offload keeps {fmt_bytes(host)} per device on the "
                     f"host, which holds {fmt_bytes(share[worst])} per device)")
    elif host > 0:
        lines.append(f"  offload keeps {fmt_bytes(host)} per device on the host: fits")
    return lines


def host_link_lines(plan) -> list[str]:
    """What offload moves over the host link a step (the device that moves the most), and the least
    time that takes at its kind's host bandwidth."""
    moved = [t for t in plan.host_traffic() if t is not None]
    if not moved:
        return []
    t = max(moved, key=lambda x: max(x.to_device, x.to_host))
    parts = ", ".join(f"{x.what} {fmt_bytes(x.to_device)}" for x in t.transfers)
    when = (f"at least {fmt_time(t.seconds)} at {t.device_kind}'s {t.bandwidth / 1e9:.1f} GB/s each way"
            if t.seconds is not None else f"time unknown ({t.device_kind} declares no host bandwidth)")
    lines = [f"host link per step and device: {fmt_bytes(t.to_device)} to the device and {fmt_bytes(t.to_host)} "
             f"back ({parts}, each way); {when}"]
    if plan.config.offload and "params" in plan.config.offload:
        lines.append("offloaded parameters: fetched per layer (for its forward, again for its backward, for the update)"
                     if plan.params_fetched_per_layer else
                     "offloaded parameters: fetched whole at the start of the step (per layer needs one step without "
                     "micro-batches, padded or ZeRO-3 storage, or comm_dtype)")
    return lines


def memory(plan) -> Section | None:
    """Each memory optimization's share of the per-device memory (from the plan's shardings), host
    memory and what offload keeps there, and a ZeRO level that found nothing to shard."""
    shares = plan.memory[0].shares if plan.memory else ()
    body: list = []
    if shares:
        body.append(Line("memory optimizations, per device:", where="text"))
        width = max(len(x.component) for x in shares)
        body += [Line(f"{x.component:<{width}}  {fmt_bytes(x.before)} -> {fmt_bytes(x.after)} ({x.by})", 1, "text")
                 for x in shares]
        body.append(Table(("component", "before", "after", "by"),
                          tuple((x.component, fmt_bytes(x.before), fmt_bytes(x.after), x.by) for x in shares),
                          (False, True, True, False), where="html"))
    body += _lines(host_lines(plan) + host_link_lines(plan))
    level = plan.config.zero_level
    if level and not any(x.by.startswith("zero") for x in shares):
        why = ("the pipeline already stores parameters and optimizer state spread over every device"
               if plan.schedule is not None else
               "no parameter has a data-parallel axis of more than one device and a dimension it divides")
        body.append(Line(f"zero {level}: nothing to shard ({why})"))
    return Section("memory", "Memory optimizations and host memory", tuple(body)) if body else None


def traffic(plan) -> Section:
    rows = [[f"TG{c.taskgraph}", c.kind, "x".join(c.axes) if not isinstance(c.axes, str) else c.axes,
             fmt_bytes(c.bytes), c.reason] for c in plan.comms]
    body = [Line(f"predicted collective traffic per step and device: {fmt_bytes(plan.predicted_comm_bytes)}")]
    compiled = plan.compiled_step_collectives
    if compiled is not None:
        off = plan.predicted_comm_bytes / compiled.ring_bytes - 1 if compiled.ring_bytes else 0.0
        body.append(Line(
            f"XLA's compiled step: {compiled.count} collectives, {fmt_bytes(compiled.ring_bytes)} per step and device "
            f"(predicted {'+' if off >= 0 else '-'}{fmt_pct(abs(off))}); {compiled.asynchronous} asynchronous, "
            f"{compiled.overlapped} with compute scheduled between start and done ({compiled.overlapping_matmuls} "
            "with matrix multiplications)"))
    if rows:
        body.append(Table(TRAFFIC_COLUMNS, tuple(map(tuple, rows)), (False, False, False, True, False), where="html"))
    return Section("traffic", "Collective traffic", tuple(body), collapsed=len(rows) > 8)


def precision(plan) -> Section | None:
    report = plan.report                               # remat per TaskGraph, amp, comm dtype
    lines = summary_lines(report.remat, report.precision, report.comm_report())
    return Section("precision", "Remat and precision", tuple(_lines(lines))) if lines else None


def xla_memory(plan, compiled_memory: bool) -> Section | None:
    if not (compiled_memory or plan.compiled.memory is not None):
        return None
    m = plan.compiled_memory()
    return Section("xla-memory", "XLA memory analysis", (Line("XLA memory analysis per device: " + ", ".join(
        f"{k.replace('_size_in_bytes', '')} {fmt_bytes(v)}" for k, v in m.items())),))


def sections(plan, compiled_memory: bool = False) -> tuple[Section, ...]:
    """Everything the plan says, in the summary's order; sections with nothing to say are left out."""
    out = [overview(plan), taskgraphs(plan), speeds(plan), pipeline(plan)]
    out += [balance(plan, r, key) for r, key in ((plan.balance, "balance"), (plan.head_balance, "head-balance"))
            if r is not None]
    out += [experts(plan), couplings(plan), patterns(plan), coverage(plan), devices(plan), memory(plan), traffic(plan),
            precision(plan), xla_memory(plan, compiled_memory)]
    return tuple(s for s in out if s is not None)
