"""Gradient all-reduces in a half dtype (`Config.comm_dtype`): each data-parallel TaskGraph segment
runs in a `shard_map` over its batch axes; its parameters enter tiled, one copy per device (`_tile`),
whose backward sums the per-device gradients in bf16/fp16: the all-reduce XLA emits is in that dtype.
Also the summary line of the step's precision (`describe`)."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from whalex.jaxpr.batch_dependence import analyse as batch_dependence
from whalex.jaxpr.segments import segments
from whalex.precision.amp import cast
from whalex.records.memory_options import Precision

NOT_SHARDED = "its batch is not sharded"


def _tile(n: int, dtype):
    """p -> n copies of p stacked (one per data-parallel device when sharded over the batch axes);
    the transpose sums the per-device gradients in `dtype`: the data-parallel all-reduce."""

    @jax.custom_vjp
    def tile(p):
        return jnp.broadcast_to(p[None], (n,) + p.shape)

    def fwd(p):
        return tile(p), None

    def bwd(_, ct):
        # lax.reduce_sum keeps the half dtype (jnp.sum would accumulate, and so all-reduce, in fp32)
        return (jax.lax.reduce_sum(ct.astype(dtype), (0,)).astype(ct.dtype),)

    tile.defvjp(fwd, bwd)
    return tile


def _batch(cap):
    """The batch dependence of the captured loss (every input after the parameters is batch)."""
    jaxpr = cap.jaxpr.jaxpr
    return batch_dependence(jaxpr, range(cap.num_params, len(jaxpr.invars)))


def comm_segments(cap, segs, prec: Precision, overrides: dict | None, axis_sizes: dict, cuts=()) -> dict:
    """{segment index: (manual axes, why not)}: the segments that run data-parallel in a shard_map.

    A segment qualifies when its TaskGraph's batch is sharded (over axes of size > 1), the loss
    traced at the per-device batch has the same segments, each value entering or leaving it is
    batch-major (leading dim = the batch) or batch-independent (only the loss, a mean over the
    batch, may leave otherwise: it is averaged), and none of its equations is replaced (uneven
    heads, experts) or belongs to another TaskGraph."""
    jaxpr = cap.jaxpr.jaxpr
    dep = _batch(cap)
    b = cap.global_batch
    loss = jaxpr.outvars[0]
    overridden = {p[0] for p in (overrides or {})}
    result = {}
    for k, seg in enumerate(segs):
        axes = tuple(a for a in (prec.batch_axes[seg.taskgraph] if seg.taskgraph < len(prec.batch_axes) else ())
                     if axis_sizes.get(a, 1) > 1)
        n = int(np.prod([axis_sizes[a] for a in axes])) if axes else 1
        why = None
        if not axes:
            why = NOT_SHARDED
        elif n not in prec.local:
            why = f"the batch of {b} does not divide over {n} devices"
        elif _shape(segments(prec.local[n], cuts)) != _shape(segs):
            why = "the loss traces differently at the per-device batch"
        elif any(seg.start <= i < seg.stop for i in overridden):
            why = "an equation of it is replaced (uneven head or experts)"
        elif {t for p, t in cap.assign.items() if seg.start <= p[0] < seg.stop} != {seg.taskgraph}:
            why = "it contains equations of other TaskGraphs"
        for v in seg.inputs:
            if why is None and v in dep.depends and not dep.batch_major(v, b):
                why = f"an input of shape {v.aval.shape} depends on the batch but is not batch-major"
        for v in seg.outputs:
            if why is None and v is not loss and not dep.batch_major(v, b):
                why = f"an output of shape {v.aval.shape} is not batch-major"
        result[k] = (axes if why is None else (), why)
    return result


def _shape(segs) -> list:
    return [(s.taskgraph, s.start, s.stop, len(s.inputs), len(s.outputs)) for s in segs]


def manual_segment(seg, axes: tuple, mesh, cap, dtype) -> Callable:
    """wrap(fn) for fn(*inputs) traced at the per-device batch (the segment of the loss captured
    at global_batch / n, inputs in `seg.inputs` order): run it in a shard_map
    manual over `axes`. Batch-major values are sharded over `axes`; floating parameters enter tiled
    (one copy per device, `_tile`), so their gradients leave per device and are summed in `dtype`;
    the loss is averaged over `axes`. check_vma=False: the captured equations are re-bound as
    traced, without varying-axis casts, and no replicated input takes a gradient through the
    shard_map's own fp32 psum, since the parameters are the tiled, mapped inputs."""
    jaxpr = cap.jaxpr.jaxpr
    dep = _batch(cap)
    params = set(jaxpr.invars[: cap.num_params])
    n = int(np.prod([dict(mesh.shape)[a] for a in axes]))
    tile = _tile(n, dtype)
    tiled = [v in params and jnp.issubdtype(v.aval.dtype, jnp.floating) for v in seg.inputs]
    spec_in = [P(axes) if t or dep.batch_major(v, cap.global_batch) else P() for v, t in zip(seg.inputs, tiled)]
    is_loss = [v is jaxpr.outvars[0] for v in seg.outputs]
    spec_out = [P() if lz else P(axes) for lz in is_loss]

    def wrap(fn):
        def body(*args):
            outs = fn(*[a[0] if t else a for a, t in zip(args, tiled)])
            return [jax.lax.pmean(o, axes) if lz else o for o, lz in zip(outs, is_loss)]

        smap = jax.shard_map(body, mesh=mesh, in_specs=tuple(spec_in), out_specs=spec_out, axis_names=set(axes),
                             check_vma=False)

        def run(*args):
            return smap(*[tile(a) if t else a for a, t in zip(args, tiled)])

        return run

    return wrap


def local_captures(cap, batch_axes, axis_sizes: dict, recapture: Callable) -> dict:
    """{n: the loss captured at global_batch / n rows} for each data-parallel degree n > 1."""
    out = {}
    for axes in batch_axes:
        n = int(np.prod([axis_sizes.get(a, 1) for a in axes])) if axes else 1
        if n > 1 and n not in out and cap.global_batch % n == 0:
            out[n] = recapture(cap.global_batch // n)
    return out


def strip_axes(constraints: dict, axes: tuple, all_axes: tuple) -> dict:
    """Constraints with the manual `axes` removed (inside a shard_map over them); none at all
    when every mesh axis is manual."""
    if set(all_axes) <= set(axes):
        return {}

    def clean(entry):
        if entry is None:
            return None
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(a for a in names if a not in axes)
        return None if not kept else (kept[0] if len(kept) == 1 else kept)

    return {k: P(*[clean(e) for e in spec]) for k, spec in constraints.items()}


def describe(prec: Precision | None, comm_report: dict | None = None) -> str:
    """One summary line: compute dtype and gradient communication dtype per TaskGraph."""
    if prec is None:
        return ""
    parts = []
    if prec.amp:
        parts.append(f"amp {prec.amp}: {prec.amp} compute, fp32 master weights and optimizer state"
                     + (f", dynamic loss scale (period {prec.period})" if prec.scaled else ""))
    if prec.comm:
        if comm_report:
            done = [f"TG{t}" for t, (axes, why) in comm_report.items() if axes]
            local = [f"TG{t}" for t, (axes, why) in comm_report.items() if why == NOT_SHARDED]
            left = [f"TG{t} ({why})" for t, (axes, why) in comm_report.items() if not axes and why != NOT_SHARDED]
            text = f"gradient all-reduce in {prec.comm}: " + (", ".join(done) or "none")
            if left:
                text += "; in the parameter dtype: " + ", ".join(left)
            if local:
                text += "; no data-parallel gradient all-reduce: " + ", ".join(local)
            parts.append(text)
        else:
            parts.append(f"gradient all-reduce in {prec.comm}")
    return "; ".join(parts)


def reduce_in(prec: Precision | None, reduce: Callable, grads):
    """`reduce(grads)` (a psum or reduce-scatter) with floating leaves sent in `prec`'s comm dtype
    and returned in their own dtype; unchanged without a comm dtype."""
    if prec is None or prec.comm is None:
        return reduce(grads)
    dtypes = jax.tree.map(lambda g: g.dtype, grads)
    return jax.tree.map(lambda g, d: g.astype(d), reduce(cast(grads, prec.comm_dtype)), dtypes)
