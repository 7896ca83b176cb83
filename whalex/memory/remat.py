"""Rematerialization per TaskGraph (`Config.remat`) and activation offload (`offload="activations"`).

The captured loss is evaluated segment by segment: a segment is a run of consecutive top-level
equations of one TaskGraph, evaluated through `make_evaluator` (so the plan's sharding constraints
apply unchanged) and optionally wrapped, e.g. in `jax.checkpoint`. Per TaskGraph the level is
None (save everything), a `jax.checkpoint_policies` name, or "full" (save nothing but the segment's
inputs). Communication is never recomputed: values at collective points (constrained values and
reductions/calls in split TaskGraphs) are tagged with `checkpoint_name(COMM)` and every policy
saves them. `remat="auto"` measures the compiled step (`compiled_bytes`: XLA's memory_analysis of
the donated step) and remats the TaskGraphs that save the most until it fits `Config.memory_budget`.

With activation offload, segment outputs (the values at TaskGraph boundaries) are tagged
`BOUNDARY`; they and the COMM values go to `pinned_host` memory instead of staying on the device
(`save_and_offload_only_these_names`, an outer checkpoint for the boundaries, each TaskGraph's
policy for its collective outputs) and come back for the backward pass. Those are the values remat
keeps, so offload="activations" alone means remat="full" with them on the host.

`program_evaluator` also runs comm_dtype's data-parallel segments (whalex.precision.comm) on the
same segmentation: each in a shard_map, with remat inside it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, NamedSharding

from whalex import _compat as C
from whalex.errors import PlanError
from whalex.jaxpr.blocks import block_evaluator
from whalex.jaxpr.flops import training_flops
from whalex.jaxpr.interpret import call_prefixes
from whalex.jaxpr.primitive_table import REDUCTIONS
from whalex.jaxpr.segments import Segment, run_segments, segment_function, segments
from whalex.memory import offload as offload_lib, plan_memory, vjp_residual_bytes as residual_bytes
from whalex.memory.layers import find_layers
from whalex.precision.comm import comm_segments, describe, local_captures, manual_segment, strip_axes
from whalex.records.memory_options import Precision, RematPlan

COMM = "whalex_comm"            # values at collective points: always saved
BOUNDARY = "whalex_boundary"    # segment outputs: offloaded under offload="activations"
DOTS = "dots_with_no_batch_dims_saveable"   # the middle rung of remat="auto"


# ----------------------------------------------------------------------------------- collective points
def comm_overrides(cap, constraints: dict, mesh, split_taskgraphs: set, overrides: dict | None) -> dict:
    """Overrides that tag the values at collective points with `checkpoint_name(COMM)`: the
    constrained inputs and outputs of an equation, and the outputs of reductions and calls inside
    split TaskGraphs (reductions over a split dimension all-reduce). Existing overrides are kept."""
    overrides = dict(overrides or {})
    constrained: dict = {}
    for (path, kind, pos), spec in constraints.items():
        constrained.setdefault(path, []).append((kind, pos, NamedSharding(mesh, spec)))
    descended = call_prefixes(constrained)   # calls the evaluator enters
    out = dict(overrides)
    for path, eqn, _ in cap.walk():
        if len(path) > 1 and path[:-1] not in descended:
            continue                                    # inside a call evaluated as one equation
        if C.is_call(eqn) and path in descended:
            continue                                    # entered: its equations are tagged instead
        split = cap.assign.get(path) in split_taskgraphs
        if not (path in constrained or (split and (eqn.primitive.name in REDUCTIONS or C.is_call(eqn)))):
            continue
        cons = constrained.get(path, [])
        inner = overrides.get(path)

        def fn(*ins, eqn=eqn, cons=cons, inner=inner):
            ins = list(ins)
            for kind, pos, _ in cons:
                if kind == "in":
                    ins[pos] = checkpoint_name(ins[pos], COMM)
            outs = list(inner(*ins)) if inner is not None else C.bind(eqn, ins)
            for kind, pos, s in cons:
                if kind == "out":
                    outs[pos] = jax.lax.with_sharding_constraint(outs[pos], s)
            return [checkpoint_name(o, COMM) for o in outs]

        out[path] = fn
    return out


# ----------------------------------------------------------------------------------- policies
def _recompute_marker():
    off = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[], offload_src="device",
        offload_dst="pinned_host")
    return off(jax.lax.add_p)


def _offloading(names: list, otherwise):
    """Policy: values tagged with `names` go to pinned host; `otherwise(prim, ...)` decides the rest."""
    off = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=names, offload_src="device",
        offload_dst="pinned_host")
    recompute = _recompute_marker()

    def policy(prim, *args, **params):
        decision = off(prim, *args, **params)
        return otherwise(prim, *args, **params) if decision is recompute else decision

    return policy


def level_policy(level: str, offload: bool = False):
    """The checkpoint policy of one remat level. COMM-tagged values (collective outputs) are always
    kept: on the device, or in pinned host memory under offload="activations"."""
    base = None if level == "full" else getattr(jax.checkpoint_policies, level)
    if offload:
        return _offloading([COMM], base or jax.checkpoint_policies.nothing_saveable)
    keep = jax.checkpoint_policies.save_only_these_names(COMM)
    return keep if base is None else jax.checkpoint_policies.save_from_both_policies(base, keep)


def _refetching(level, offload: bool, derived: frozenset = frozenset()):
    """The level's policy (everything saveable at level None), except that parameter fetches
    (`offload.not_fetched`) and what is computed from the fetched parameters alone (`derived`: the
    types of those values, e.g. a bf16 cast or a reshape of a kernel) are recomputed, i.e. fetched
    again for the backward pass instead of kept on the device."""
    base = level_policy(level, offload) if level is not None else (
        offload_policy() if offload else jax.checkpoint_policies.everything_saveable)

    def policy(prim, *args, **params):
        if not offload_lib.not_fetched(prim) or offload_lib.from_fetched(args, derived):
            return False
        return base(prim, *args, **params)

    return policy


def fetching_segment(cap, seg: Segment, fetch: Sequence, fn: Callable) -> tuple[Callable, frozenset | None]:
    """fn reading the parameters among its inputs as (host array, delta) pairs, each moved to the
    device in its `fetch` sharding (`offload.fetch_leaf`); and the types of the values the segment
    computes from those parameters alone (`offload.derived_types`), None when it reads none."""
    position = {v: i for i, v in enumerate(cap.jaxpr.jaxpr.invars[: cap.num_params])}
    where = {j: fetch[position[v]] for j, v in enumerate(seg.inputs) if v in position}
    if not where:
        return fn, None

    def fetched(*args):
        return fn(*[offload_lib.fetch_leaf(*a, where[j]) if j in where else a for j, a in enumerate(args)])

    jaxpr = cap.jaxpr.jaxpr
    params = {seg.inputs[j] for j in where}
    return fetched, offload_lib.derived_types(jaxpr.eqns[seg.start:seg.stop], params, set(jaxpr.constvars))


def offload_policy():
    """Outer policy under offload="activations": values at TaskGraph boundaries and collective
    points go to pinned host, the rest is saved as usual (the per-TaskGraph remat inside decides)."""
    return _offloading([BOUNDARY, COMM], jax.checkpoint_policies.everything_saveable)



def remat_segment(plan: RematPlan, index: int, seg: Segment, fn: Callable,
                  derived: frozenset | None = None) -> Callable:
    """fn under its segment's checkpoint policy; outputs tagged BOUNDARY when offloading. `derived`
    (not None when fn fetches host-stored parameters, `fetching_segment`): the checkpoint, with the
    level's policy or saving everything, never keeps device copies of those parameters, nor values
    computed from them alone, for the backward pass. Saving everything else (level None), it adds no
    CSE barrier: the fetches are side-effecting moves XLA never merges, and a barrier would make XLA
    materialise every saved value it otherwise fuses into the backward pass (broadcast masks and
    zeros: several GB on a GPT-style model)."""
    level = plan.level(index, seg)
    if derived is not None:
        inner = jax.checkpoint(fn, policy=_refetching(level, plan.offload, derived),
                               prevent_cse=level is not None or bool(plan.offload))
    else:
        inner = jax.checkpoint(fn, policy=level_policy(level, plan.offload)) if level is not None else fn
    if not plan.offload:
        return in_order(inner) if level is not None else inner

    def tagged(*args):
        return [checkpoint_name(o, BOUNDARY) for o in inner(*args)]

    return tagged


def in_order(fn: Callable) -> Callable:
    """fn whose backward pass runs as one block: its recomputation starts only once the cotangent of
    its outputs has arrived (the saved values pass through an `optimization_barrier` with it), and
    its whole gradient, inputs' and weights' alike, leaves through another, so the previous segment's
    backward cannot start before this one's weight gradients are made. Without them, a scheduler that
    hides collectives (XLA:GPU's latency-hiding scheduler overlapping gradient all-reduces) defers
    weight-gradient matmuls to the end of the backward pass and holds every segment's recomputed
    activations until then."""

    @jax.custom_vjp
    def ordered(*args):
        return fn(*args)

    def backward(vjp, cotangents):
        vjp, cotangents = jax.lax.optimization_barrier((vjp, cotangents))
        return jax.lax.optimization_barrier(vjp(cotangents))

    ordered.defvjp(lambda *args: jax.vjp(fn, *args), backward)      # residuals: the vjp's saved values
    return ordered


def with_offload(plan: RematPlan | None, evaluate: Callable) -> Callable:
    """The whole evaluation under the outer offloading checkpoint, when activations are offloaded."""
    if plan is None or not plan.offload:
        return evaluate
    return jax.checkpoint(evaluate, policy=offload_policy())


def saved_bytes(cap, plan: RematPlan | None) -> float:
    """Bytes JAX keeps for the backward pass of one evaluation of the captured loss (global batch)
    under `plan`'s remat: the residuals of its vjp with respect to the parameters, as JAX counts them
    (the same on every backend; XLA's CPU compiler drops remat's barriers, so its compiled figure
    cannot show what remat saves)."""
    evaluate = program_evaluator(cap, {}, None, None, plan)[0]
    return residual_bytes(lambda *args: evaluate(*args)[0], [v.aval for v in cap.jaxpr.jaxpr.invars],
                          range(cap.num_params))


def step_flops(cap, plan: RematPlan | None) -> float:
    """Forward + backward FLOPs of the captured loss (global batch) under `plan`'s remat, the
    recomputed forwards included (whalex.jaxpr.flops): what remat costs in step time, on any backend."""
    evaluate = program_evaluator(cap, {}, None, None, plan)[0]
    jaxpr = jax.make_jaxpr(lambda *args: evaluate(*args)[0])(*[v.aval for v in cap.jaxpr.jaxpr.invars])
    return training_flops(jaxpr, [k < cap.num_params for k in range(len(cap.jaxpr.jaxpr.invars))], [True])


def choose(cap, layers, num_taskgraphs: int, budget: float, state: float, replicas: int,
           offload: bool = False) -> RematPlan:
    """remat="auto": per layer none, DOTS or "full" so that state + saved residuals per device fit
    `budget`, recomputing as little as it can: the layers that keep the most are rematerialized first,
    as few as fit (a bisection over their count), then the lighter DOTS policy where it still fits.
    A PlanError when even full remat of every layer does not fit."""
    segs = segments(cap, layers.cuts if layers is not None else ())
    count = len(segs)

    def plan_of(levels) -> RematPlan:
        return RematPlan((None,) * num_taskgraphs, "auto", layers, offload, budget, tuple(levels), state=state)

    def used(levels) -> float:
        return state + saved_bytes(cap, plan_of(levels)) / replicas

    base = saved_bytes(cap, plan_of((None,) * count)) / replicas

    def done(levels):
        return dataclasses.replace(plan_of(levels), saved=used(levels) - state, baseline=base)

    if state + base <= budget:
        return done((None,) * count)
    everything = used(("full",) * count)
    if everything > budget:
        raise PlanError(
            f"remat='auto' cannot fit the step in memory_budget={_mib(budget)} per device: the state takes "
            f"{_mib(state)} and the backward pass keeps {_mib(base)} without remat and still "
            f"{_mib(everything - state)} with full remat of every layer (residuals as JAX counts them). Raise "
            "memory_budget, use more devices, zero_level or offload, or a smaller batch.")
    order = sorted(range(count), key=lambda k: -_segment_saved(cap, segs[k]))
    lo, hi = 1, count                  # the fewest layers, largest first, whose full remat fits
    while lo < hi:
        mid = (lo + hi) // 2
        if used(_levels(count, order[:mid], "full")) <= budget:
            hi = mid
        else:
            lo = mid + 1
    levels = _levels(count, order[:lo], "full")
    lighter = _levels(count, order[:lo], DOTS)
    if used(lighter) <= budget:
        levels = lighter
    return done(levels)


def _levels(count: int, chosen, level) -> tuple:
    picked = set(chosen)
    return tuple(level if k in picked else None for k in range(count))


def _segment_saved(cap, seg: Segment) -> float:
    """What one segment's backward keeps of its own values (what its full remat can save)."""
    fn = segment_function(cap, seg, {}, None, None)
    floating = [k for k, v in enumerate(seg.inputs) if jax.numpy.issubdtype(v.aval.dtype, jax.numpy.floating)]
    if not floating:
        return 0.0
    return residual_bytes(lambda *args: sum(jax.numpy.sum(o) for o in fn(*args)
                                            if jax.numpy.issubdtype(o.dtype, jax.numpy.floating)),
                          [v.aval for v in seg.inputs], floating)


# ----------------------------------------------------------------------------------- composition
def program_evaluator(cap, constraints: dict, mesh, overrides: dict | None, plan: RematPlan | None,
                      prec=None, fetch: Sequence | None = None) -> tuple[Callable[..., list], dict | None]:
    """The captured loss evaluated with the plan's constraints, per-TaskGraph remat, activation
    offload and (prec.comm) data-parallel segments whose gradients are summed in bf16/fp16.
    Returns (evaluate, comm report {TaskGraph: (axes, reason when not)} or None).

    `fetch` (a sharding per parameter; not with comm segments): parameters offloaded per layer.
    `evaluate` then takes each parameter as a (host array, zero delta on the device) pair, and each
    segment (a layer: `plan.cuts`) moves those it reads to the device itself (`fetching_segment`)."""
    remat_on = plan is not None and plan.active
    comm_on = prec is not None and prec.comm is not None
    if fetch is not None and comm_on:
        raise ValueError("program_evaluator: per-layer parameter fetches do not run in comm_dtype segments")
    if not remat_on and not comm_on and fetch is None:
        return block_evaluator(cap, constraints, mesh, overrides), None
    if not remat_on:
        plan = RematPlan((None,) * len(cap.taskgraphs), layers=plan.layers if plan is not None else None)
    split = {t.index for t in cap.taskgraphs if t.strategy.kind == "split"}
    segs = segments(cap, plan.cuts)
    manual = comm_segments(cap, segs, prec, overrides, dict(mesh.shape), plan.cuts) if comm_on else {}
    tagged = comm_overrides(cap, constraints, mesh, split, overrides) if remat_on else overrides
    local_segs = {n: segments(c, plan.cuts) for n, c in (prec.local.items() if comm_on else ())}
    parts = []
    for k, seg in enumerate(segs):
        axes, _ = manual.get(k, ((), None))
        if axes:                     # traced at the per-device batch, run in a shard_map over `axes`
            n = int(np.prod([dict(mesh.shape)[a] for a in axes]))
            local, lseg = prec.local[n], local_segs[n][k]
            cons = strip_axes({key: s for key, s in constraints.items() if seg.start <= key[0][0] < seg.stop},
                                 axes, tuple(mesh.axis_names))
            inner = mesh.abstract_mesh.update_axis_types({a: AxisType.Manual for a in axes})   # as seen inside
            ovr = comm_overrides(local, cons, inner, split, None) if remat_on else None
            fn = remat_segment(plan, k, lseg, segment_function(local, lseg, cons, inner, ovr))
            fn = manual_segment(seg, axes, mesh, cap, prec.comm_dtype)(fn)
        else:
            fn, derived = segment_function(cap, seg, constraints, mesh, tagged), None
            if fetch is not None:
                fn, derived = fetching_segment(cap, seg, fetch, fn)
            fn = remat_segment(plan, k, seg, fn, derived)
        parts.append((seg, fn))
    report = None
    if comm_on:
        report = {}
        for k, (axes, why) in manual.items():
            tg = segs[k].taskgraph
            if tg not in report or (report[tg][0] and not axes):
                report[tg] = (axes, why)
    return with_offload(plan, run_segments(cap, parts)), report


# ----------------------------------------------------------------------------------- configuration
def configure(cap, axis_sizes: dict, layout, config, cluster, batch_axes=(),
              recapture: Callable | None = None) -> tuple[Precision | None, RematPlan | None]:
    """The precision and remat records of `config` for a program of the captured loss `cap` on a mesh
    of `axis_sizes`, whose stored state is `layout` (a StateLayout; remat="auto" fits its budget with
    it). `recapture(rows)` traces the loss at another batch size (comm_dtype's per-device segments)."""
    prec = Precision.from_config(config)
    if prec is not None:
        prec = dataclasses.replace(prec, batch_axes=tuple(tuple(a) for a in batch_axes))
        if prec.comm and recapture is not None:
            prec = dataclasses.replace(prec, local=local_captures(cap, prec.batch_axes, axis_sizes, recapture))
    offload = "activations" in (config.offload or ())
    mode = config.remat
    if mode is None and not offload:         # offload="params": the layers, where parameters are fetched
        return prec, (RematPlan((None,) * len(cap.taskgraphs), layers=find_layers(cap))
                      if "params" in (config.offload or ()) else None)
    n = len(cap.taskgraphs)
    layers = find_layers(cap)
    devices = int(np.prod(list(axis_sizes.values()))) if axis_sizes else 1
    replicas = max(1, axis_sizes.get("data", 1))        # the data-parallel replicas share the global batch
    kept = saved_bytes(cap, RematPlan(("full",) * n, "full", layers)) / replicas if offload else None
    if mode is None:                 # what is offloaded are the values remat saves: boundaries, collectives
        return prec, RematPlan(("full",) * n, "full, for offload='activations'", layers, True, offloaded=kept)
    if mode == "auto":
        budget = config.memory_budget
        if budget is None:
            budget = min(float(s.memory_bytes) for s in cluster.specs[:devices])
        state = max(m.state for m in plan_memory(layout, cluster.specs[:devices]))
        chosen = choose(cap, layers, n, float(budget), state, replicas, offload)
        return prec, _costed(cap, dataclasses.replace(chosen, offloaded=kept))
    plan = RematPlan((mode,) * n, mode, layers, offload, segment_levels=blocks_only(cap, layers, mode), offloaded=kept)
    return prec, _costed(cap, dataclasses.replace(plan, saved=saved_bytes(cap, plan) / replicas,
                                                  baseline=saved_bytes(cap, None) / replicas))


def _costed(cap, plan: RematPlan) -> RematPlan:
    """`plan` with the training FLOPs it costs and those without remat."""
    return dataclasses.replace(plan, flops=step_flops(cap, plan), baseline_flops=step_flops(cap, None))


def blocks_only(cap, layers, level) -> tuple | None:
    """Per remat segment: `level` in the model's repeated layers (its blocks) and None in the others
    (embedding, head), as `nn.remat` per block does: a head's recomputed forward costs a large share
    of a language model's step and keeps little. None (every segment at `level`) when no layer repeats."""
    if layers is None or not any(layers.repeats) or all(layers.repeats):
        return None
    return tuple(level if layers.repeated_at(seg.start) else None for seg in segments(cap, layers.cuts))


def summary_lines(remat: RematPlan | None, prec: Precision | None, comm_report: dict | None) -> list[str]:
    """plan.summary() lines: the remat chosen per TaskGraph or layer, compute and communication dtypes
    (`comm_report`: per TaskGraph, the mesh axes its gradients are summed over in the comm dtype)."""
    lines = []
    if remat is not None and (remat.active or remat.mode is not None):
        lines.append(remat.describe())
    if prec is not None:
        lines.append(describe(prec, comm_report if prec.comm else None))
    return lines


def _mib(n) -> str:
    return f"{n / 2**20:.2f} MiB"
