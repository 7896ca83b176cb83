"""One part of a micro-batch evaluated with a replicate TaskGraph's rows split per model shard.

In a collocated hybrid (replicate beside split on one mesh), a replicate TaskGraph spreads its rows
over the model axes too, so XLA sums its parameters' gradients over them inside the micro-batch
loop. Here its segments run under `vmap` over those shards (their SPMD axes) on the loss traced at
one shard's rows, reading one copy of each of its parameters per shard: the gradient leaves each
shard as that copy's, and the program sums the copies once after the loop. Other segments (the
split head) run as planned. docs/architecture.md#how-a-step-is-built
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from whalex.jaxpr.segments import Segment, run_segments, segment_function, segments
from whalex.memory.remat import comm_overrides, remat_segment, with_offload
from whalex.records.memory_options import RematPlan

SHARDS = "whalex_model_shards"      # the vmap axis of the model shards


@dataclasses.dataclass(frozen=True)
class ShardGroups:
    """Which segments run per model shard: the TaskGraphs, the model axes and their device count,
    and the parameter leaves that enter as per-shard copies (read by no other TaskGraph)."""

    axes: tuple[str, ...]
    size: int
    taskgraphs: frozenset
    copied: frozenset        # parameter leaf indices


def var_positions(jaxpr) -> dict:
    """{var: ("in" | "const", k) | (eqn index, out index)}: where each value of `jaxpr` is defined."""
    out = {v: ("const", k) for k, v in enumerate(jaxpr.constvars)}
    out.update({v: ("in", k) for k, v in enumerate(jaxpr.invars)})
    for i, eqn in enumerate(jaxpr.eqns):
        out.update({v: (i, j) for j, v in enumerate(eqn.outvars)})
    return out


def same_outputs(body, inner_pl) -> object:
    """The body of `inner_pl` (the loss at one shard's rows) returning the values `body` returns."""
    where = var_positions(body.jaxpr.jaxpr)
    jp = inner_pl.body_jaxpr

    def var(v):
        k = where.get(v)               # None: a literal
        if k is None:
            return v
        if k[0] in ("in", "const"):
            return (jp.invars if k[0] == "in" else jp.constvars)[k[1]]
        return jp.eqns[k[0]].outvars[k[1]]

    return inner_pl.body([var(v) for v in body.jaxpr.jaxpr.outvars])


def _kind(v, w, rows: int, size: int) -> str | None:
    """'rows' (batch-major: `rows` leading rows here, rows / size in the shard's trace), 'same', or None."""
    a, b = tuple(v.aval.shape), tuple(w.aval.shape)
    if a == b:
        return "same"
    if a and b and a[0] == rows and b[0] * size == rows and a[1:] == b[1:]:
        return "rows"
    return None


def _plan_segment(seg: Segment, inner: Segment, rows: int, groups: ShardGroups, params: dict):
    """Per input: 'rows' | 'copy' | 'same'; None when the segment cannot run per shard (a value
    that is neither batch-major nor of the same shape, or an output that is not batch-major)."""
    kinds = []
    for v, w in zip(seg.inputs, inner.inputs):
        k = "copy" if params.get(v) in groups.copied else _kind(v, w, rows, groups.size)
        if k is None:
            return None
        kinds.append(k)
    if any(_kind(v, w, rows, groups.size) != "rows" for v, w in zip(seg.outputs, inner.outputs)):
        return None
    return kinds


def runs_per_shard(body, inner_body, groups: ShardGroups, num_params: int) -> frozenset:
    """The copied parameter leaves that only segments able to run per shard read (in `body`): a
    leaf read elsewhere would be read as copy 0, its gradient gathered there in the loop."""
    jaxpr = body.jaxpr.jaxpr
    rows = _rows(body, num_params)
    params = {v: k for k, v in enumerate(jaxpr.invars[:num_params])}
    bad = set()
    for seg, inner in zip(segments(body), segments(inner_body)):
        ok = seg.taskgraph in groups.taskgraphs and _plan_segment(seg, inner, rows, groups, params) is not None
        if not ok:
            bad.update(params[v] for v in seg.inputs if v in params)
    return frozenset(groups.copied - bad)


def grouped_evaluator(body, inner_body, groups: ShardGroups, constraints: dict, inner_constraints: dict, mesh,
                      overrides: dict | None, num_params: int, draws=frozenset(),
                      remat: RematPlan | None = None) -> Callable[..., list]:
    """evaluate(*inputs) of `body` (parameters in `groups.copied` given as [size, ...] copies): the
    segments of `groups.taskgraphs` under vmap over the model shards (through `inner_body`, the
    same loss at one shard's rows), the others as planned, reading copy 0 of a copied parameter;
    each segment under its remat policy, as `program_evaluator` runs them."""
    jaxpr = body.jaxpr.jaxpr
    rows = _rows(body, num_params)
    params = {v: k for k, v in enumerate(jaxpr.invars[:num_params])}
    remat = remat if remat is not None and remat.active else None
    cuts = remat.cuts if remat is not None else ()
    outer = _tagged(body, constraints, mesh, overrides, remat)
    inner_ovr = _tagged(inner_body, inner_constraints, mesh, _shard_rows(overrides, draws, rows, groups.size), remat)
    parts = []
    for k, (seg, inner) in enumerate(zip(segments(body, cuts), segments(inner_body, cuts))):
        kinds = _plan_segment(seg, inner, rows, groups, params) if seg.taskgraph in groups.taskgraphs else None
        if kinds is None:
            fn = segment_function(body, seg, constraints, mesh, outer)
            fn = _first_copy(fn, [params.get(v) in groups.copied for v in seg.inputs])
        else:
            fn = _per_shard(segment_function(inner_body, inner, inner_constraints, mesh, inner_ovr), kinds, groups,
                            mesh)
        parts.append((seg, remat_segment(remat, k, seg, fn) if remat is not None else fn))
    return with_offload(remat, run_segments(body, parts))


def _tagged(cap, constraints: dict, mesh, overrides: dict | None, remat: RematPlan | None) -> dict | None:
    """Overrides with remat's tags at collective points (as `program_evaluator` adds them)."""
    if remat is None:
        return overrides
    split = {t.index for t in cap.taskgraphs if t.strategy.kind == "split"}
    return comm_overrides(cap, constraints, mesh, split, overrides)


def _shard_rows(overrides: dict | None, draws, rows: int, size: int) -> dict:
    """`overrides` for one shard's rows: a random draw (`draws`: their paths) gives the part's rows of
    the whole-batch draw, the shard takes its own (each shard draws the part's rows: `size` times
    the random bits of these segments, so the masks stay those of one device)."""
    def shard(fn):
        def run(*ins):
            bits = fn(*ins)[0]
            start = jax.lax.axis_index(SHARDS) * (rows // size)
            return [jax.lax.dynamic_slice_in_dim(bits, start, rows // size, axis=0)]
        return run
    return {p: shard(f) if p in draws else f for p, f in (overrides or {}).items()}


def _rows(body, num_params: int) -> int:
    """The part's rows: the leading dimension of its first batch input."""
    return int(body.jaxpr.jaxpr.invars[num_params].aval.shape[0])


def _first_copy(fn, copies):
    def run(*args):
        return fn(*[a[0] if c else a for a, c in zip(args, copies)])
    return run


def _per_shard(fn, kinds, groups: ShardGroups, mesh):
    """fn (one shard's rows) over every shard: batch-major inputs cut into [size, rows / size, ...],
    copies mapped, the rest shared; outputs joined back into rows."""
    axes = groups.axes if len(groups.axes) > 1 else groups.axes[0]
    spread = NamedSharding(mesh, P(axes))

    def run(*args):
        ins = []
        for a, k in zip(args, kinds):
            if k == "rows":
                a = jax.lax.with_sharding_constraint(a.reshape((groups.size, -1) + a.shape[1:]), spread)
            ins.append(a)
        outs = jax.vmap(fn, in_axes=tuple(0 if k != "same" else None for k in kinds), axis_name=SHARDS,
                        spmd_axis_name=groups.axes)(*ins)
        return [o.reshape((-1,) + o.shape[2:]) for o in outs]

    return run

