"""Uneven rows for a hybrid (Whale Example 2 on a heterogeneous cluster, section 3.3.1): the
replicate backbone of a hybrid gets speed-proportional rows (Algorithm 1 over the batch) while
the split head keeps its layout (the whole batch, classes sharded evenly or unevenly), with a
bridge between the two (`whalex.lowering.uneven_hybrid`).

Scope: the loss's top-level equations are a per-sample backbone (replicate TaskGraphs and
un-annotated equations) followed by the split TaskGraph(s) and whatever follows them. A backbone
that couples samples (BatchNorm-style statistics) is refused with a PlanError; anything else the
program does not carry out (micro-batches, ZeRO, amp, remat, offload, model state with leaves, rng,
ops whalex does not look into) keeps the even plan, and the plan's balance report says why.
"""
from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from whalex.balance import cost
from whalex.balance.algorithm import balance, even
from whalex.balance.profile import taskgraph_flops
from whalex.errors import PlanError
from whalex.jaxpr.batch_dependence import analyse as batch_dependence, shape_of, traces_alike
from whalex.loss.align import refusal
from whalex.lowering.step import Program
from whalex.lowering.uneven import UnevenProgram
from whalex.lowering.uneven_hybrid import Backbone, HybridProgram
from whalex.memory import residual_bytes
from whalex.plan import Plan
from whalex.planner.assemble import with_program
from whalex.planner.common import Request

WAY_OUT = "use wh.Config(hardware_aware=False) (an even batch: the statistic over the whole batch, exact)"


def backbone_cut(cap) -> int | None:
    """The number of top-level equations of the replicate backbone when the loss is a backbone
    (replicate or un-annotated equations, at least one replicate scope) followed by split
    TaskGraph(s) with no replicate scope after them; None for any other shape."""
    eqns = cap.jaxpr.jaxpr.eqns
    tgs = [cap.taskgraphs[cap.assign[(i,)]] for i in range(len(eqns))]
    first = next((i for i, t in enumerate(tgs) if t.strategy.kind == "split"), None)
    if not first:
        return None
    if not any(t.annotated and t.strategy.kind == "replicate" for t in tgs[:first]):
        return None
    if any(t.annotated and t.strategy.kind == "replicate" for t in tgs[first:]):
        return None
    return first


def _unsupported(req: Request, cap, plan, cut: int) -> str | None:
    """Why the backbone keeps the even batch (None: the uneven hybrid program can run it)."""
    config = req.config
    for name, default in (("num_micro_batch", 1), ("zero_level", 0), ("amp", None), ("remat", None),
                          ("offload", None), ("comm_dtype", None)):
        value = getattr(config, name)
        if value != default and value not in (None, ()):
            return f"{name}={value!r} is not lowered for uneven hybrid rows yet"
    given = [name for name, value in sorted(req.inputs.items()) if jax.tree.leaves(value)]
    if given:           # an empty model state (an NNX model with no BatchStat or Rngs) reads nothing
        return f"{' and '.join(given)} inputs are not lowered for uneven hybrid rows yet"
    if not isinstance(plan.program, Program) or plan.program.sharding.experts:
        return "the head's program is not a plain GSPMD program (experts or ZeRO)"
    defined = {v for e in cap.jaxpr.jaxpr.eqns[:cut] for v in e.outvars}
    if any(v in defined for v in cap.jaxpr.jaxpr.outvars):
        return "a loss output is computed in the backbone"
    return None


def check_per_sample(part, whole, cut: int) -> str | None:
    """PlanError naming the operation when the backbone (equations [0, cut)) couples samples: uneven
    per-device rows would change what it computes. Returns why the even plan is kept where whalex
    cannot tell (a higher-order op it does not look into), else None."""
    jp, jg = part.jaxpr.jaxpr, whole.jaxpr.jaxpr
    if not traces_alike(jp, jg):
        raise PlanError(refusal(part, whole, "uneven hybrid rows (the backbone on per-device chunks)",
                                f"{WAY_OUT}, or a larger global batch (larger per-device chunks)"))
    found = batch_dependence(jp, range(part.num_params, len(jp.invars)), jg, (part.global_batch, whole.global_batch),
                             eqns=cut).couplings
    refused = [c for c in found if c.refused]
    if refused:
        lines = "\n  - ".join(f"{c.why} at {c.where}" for c in refused)
        raise PlanError(
            "the replicate backbone of this hybrid couples the samples of the batch (e.g. BatchNorm statistics), "
            "so it cannot run on uneven per-device rows:\n  - " + lines +
            f"\nMove the operation under wh.split (the head sees the whole batch), or {WAY_OUT}.")
    if found:
        return f"{found[0].why} at {found[0].where}"
    return None


def _note(plan: Plan, reason: str) -> Plan:
    """The even plan, its balance report saying why the batch stays even."""
    r = plan.balance
    cluster = plan.cluster
    what = f"the batch stays even over the replicate TaskGraphs: {reason}"
    if r is None:
        b, k = plan.global_batch, plan.layout.size
        r = cost.report(cluster.specs, cluster.speeds, even(b, k), even(b, k), source=cluster.speed_source, unit=1,
                        applied=False, shifted=0, flops_per_sample=0.0, state_bytes=0.0, act_base=0.0,
                        act_per_sample=0.0)
        return dataclasses.replace(plan, balance=dataclasses.replace(r, kind=f"batch ({what})"))
    return dataclasses.replace(plan, balance=dataclasses.replace(r, kind=f"{r.kind}; {what}"))


def hybrid_plan(req: Request, full, plan: Plan) -> Plan:
    """`plan` (the even GSPMD plan of `full`) with the replicate backbone of a hybrid on
    speed-proportional rows, or `plan` itself when the loss is no hybrid, the cluster is
    homogeneous, or the backbone keeps the even batch (its report says why)."""
    cluster, config = req.cluster, req.config
    cut = backbone_cut(full)
    if cut is None or len(set(cluster.speeds)) == 1 or plan.layout.size != cluster.size:
        return plan
    if not config.hardware_aware:
        return _note(plan, "hardware_aware=False")
    reason = _unsupported(req, full, plan, cut)
    if reason is not None:
        return _note(plan, reason)
    # decide: Algorithm 1 over the backbone's rows
    rows = _backbone_rows(req, full, plan, cut)
    if len(set(rows.rows)) == 1:
        return _note(plan, f"Algorithm 1 gives every device {rows.rows[0]} rows")
    # build: the rows program, the backbone at every part size it runs, the hybrid program over both
    program = _program(req, full, plan, cut, rows)
    if isinstance(program, str):
        return _note(plan, program)
    # report: the batch's balance; the head's stays as head_balance
    b, k = full.global_batch, cluster.size
    head_note = f"; uneven {plan.balance.kind}" if plan.balance is not None else ""
    report = cost.report(cluster.specs, cluster.speeds, rows.rows, even(b, k), source=cluster.speed_source,
                         unit=rows.unit, applied=True, shifted=rows.shifted, flops_per_sample=rows.flops_per_sample,
                         state_bytes=rows.state_bytes, act_base=0.0, act_per_sample=rows.per_row,
                         spreads=cluster.spread, overheads=cluster.overhead)
    kind = f"batch of the replicate TaskGraphs (the split head keeps its layout{head_note})"
    # assemble
    return with_program(plan, program, batch_sizes=tuple(rows.rows), balance=dataclasses.replace(report, kind=kind),
                        head_balance=plan.balance)


@dataclasses.dataclass(frozen=True)
class _Rows:
    """Algorithm 1's rows for the backbone, and what it weighed."""

    rows: list
    unit: int                  # the grain of rows the loads are counted in
    shifted: int
    flops_per_sample: float    # the backbone's
    per_row: float             # activation bytes kept per row (an upper bound)
    state_bytes: float         # the largest stored state of a device


def _backbone_rows(req: Request, full, plan: Plan, cut: int) -> _Rows:
    """Algorithm 1 over the batch for the backbone (equations [0, cut)): its FLOPs per sample, the
    activations it keeps per row, each device's stored state under the even plan."""
    cluster = req.cluster
    b, k = full.global_batch, cluster.size
    unit = cost.speed_grain(b, cluster.speeds)
    per_row = residual_bytes(full.jaxpr, full.num_params) / b        # activations kept per row (upper bound)
    state = [m.state for m in plan.memory]
    names = [f"device {i} ({s.name})" for i, s in enumerate(cluster.specs)]
    flops = taskgraph_flops(full.jaxpr, full.assign, len(full.taskgraphs), full.num_params)
    backbone_tgs = {full.assign[(i,)] for i in range(cut)}
    flops_per_sample = sum(f for t, f in enumerate(flops) if t in backbone_tgs) / b
    bal = balance(b // unit, cluster.speeds, [float(s.memory_bytes) for s in cluster.specs], state,
                  [per_row * unit] * k, names, overheads=cluster.overhead, work_per_unit=unit * flops_per_sample)
    return _Rows([u * unit for u in bal.loads], unit, bal.shifted, flops_per_sample, per_row, max(state))


def _program(req: Request, full, plan: Plan, cut: int, rows: _Rows) -> HybridProgram | str:
    """The hybrid program: the backbone on `rows` per device (an UnevenProgram's loops, the backbone
    traced at every part size they run), the head as `plan` runs it; or why the batch stays even."""
    b, unit = full.global_batch, rows.unit
    chunk = cost.chunk_rows(rows.rows, unit)
    head = plan.program
    rows_program = UnevenProgram(req.capture(chunk), head.mesh, req.optimizer, req.cluster.platform, tuple(rows.rows),
                                 chunk, b, grain=unit, exact_remainders=cost.exact_remainders(rows.rows, chunk, unit))
    reason = check_per_sample(rows_program.captured, full, cut)
    if reason is not None:
        return reason
    sizes = [chunk] + [s for j, s in enumerate(rows_program.sizes)
                       if any(bits[j] for bits in rows_program.remainder_bits)]
    backbones = []
    for s in sizes:
        part = rows_program.captured if s == chunk else req.capture(s)
        if s != chunk and check_per_sample(part, full, cut) is not None:
            return "the backbone traces differently at another part size"
        bb = Backbone(part, cut)
        reason = _boundary_problem(bb, Backbone(full, cut), s, b)
        if reason is not None:
            return reason
        backbones.append((s, bb))
    split_vd = next(vd for t, vd in zip(full.taskgraphs, plan.virtual_devices) if t.strategy.kind == "split")
    batch_axes = tuple(a for a in split_vd.batch_axes if plan.layout.axis_size((a,)) > 1)
    return HybridProgram.over(head, rows_program, tuple(backbones), cut, P(batch_axes) if batch_axes else P())


def _boundary_problem(part: Backbone, whole: Backbone, rows: int, b: int) -> str | None:
    """Why the backbone's outputs cannot cross the bridge row by row (None: they can)."""
    if len(part.outputs) != len(whole.outputs) or part.param_leaves != whole.param_leaves:
        return "the backbone traces differently at another batch size"
    for v, g in zip(part.outputs, whole.outputs):
        if shape_of(v)[:1] != (rows,) or shape_of(g)[:1] != (b,) or shape_of(v)[1:] != shape_of(g)[1:]:
            return (f"a value the head reads from the backbone ({list(shape_of(g))}) does not have the batch as "
                    "its leading dimension")
    return None
