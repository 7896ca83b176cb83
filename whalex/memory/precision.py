"""Mixed precision (`Config.amp`) and half-precision gradient communication (`Config.comm_dtype`).

amp: the loss is captured with its floating parameters and batch leaves cast to bf16/fp16 and the
loss cast back to fp32; the state keeps fp32 master weights and optimizer state, and gradients
arrive in fp32 (the transpose of the cast). The casts are moved next to each value's first use so
they belong to the TaskGraph (and pipeline stage) that reads it. Re-binding an fp32 jaxpr at bf16
would not work: equations carry dtypes in their params, so the cast is traced, not rewritten.

fp16 adds dynamic loss scaling: the loss is multiplied by `TrainState.loss_scale.scale` before
differentiation and the gradients divided by it; a step whose gradients are not all finite leaves
params and optimizer state unchanged and halves the scale; after `Config.loss_scale_period`
finite steps in a row the scale doubles (up to 2**15: the backward pass starts from the scale in
fp16, whose largest finite value is 65504).

comm_dtype: each data-parallel TaskGraph segment runs in a `shard_map` over its batch axes; its
parameters enter tiled, one copy per device (`_tile`), whose backward sums the per-device
gradients in bf16/fp16: the all-reduce XLA emits is in that dtype.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from whalex import _compat as C
from whalex.jaxpr import capture as capture_mod
from whalex.jaxpr.batch_dependence import analyse as batch_dependence
from whalex.jaxpr.segments import segments
from whalex.records.memory_options import HALF, Precision

MAX_SCALE = 2.0 ** 15
NOT_SHARDED = "its batch is not sharded"
INITIAL_SCALE = 2.0 ** 15


# ----------------------------------------------------------------------------------- amp capture
class AmpLoss:
    """`loss_fn` with its floating inputs cast to a half dtype and the loss returned in fp32."""

    def __init__(self, loss_fn: Callable, amp: str, has_aux: bool):
        self.loss_fn, self.dtype, self.has_aux = loss_fn, HALF[amp], has_aux

    def __call__(self, params, batch, **kwargs):
        out = self.loss_fn(cast(params, self.dtype), cast(batch, self.dtype), **kwargs)
        if "model_state" in kwargs:          # (loss, new state) or (loss, (new state, aux)): state keeps its dtypes
            loss, rest = out
            like = kwargs["model_state"]
            keep = lambda new: jax.tree.map(lambda x, y: jnp.asarray(x).astype(y.dtype), new, like)  # noqa: E731
            rest = (keep(rest[0]), rest[1]) if self.has_aux else keep(rest)
            return jnp.asarray(loss).astype(jnp.float32), rest
        if self.has_aux:
            loss, aux = out
            return jnp.asarray(loss).astype(jnp.float32), aux
        return jnp.asarray(out).astype(jnp.float32)


def amp_loss(loss_fn: Callable, amp: str | None, has_aux: bool) -> Callable:
    return loss_fn if amp is None else AmpLoss(loss_fn, amp, has_aux)


def cast(tree, dtype):
    """Floating leaves of `tree` in `dtype`; other leaves unchanged."""
    return jax.tree.map(lambda x: jnp.asarray(x).astype(dtype)
                        if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating) else x, tree)


def capture(loss_fn: Callable, params, batch, *, has_aux: bool = False, **inputs):
    """`capture.capture`, with an `AmpLoss`'s input casts moved to their first use."""
    cap = capture_mod.capture(loss_fn, params, batch, has_aux=has_aux, **inputs)
    if not isinstance(loss_fn, AmpLoss):
        return cap
    return _sink_casts(cap)


def _is_cast(eqn) -> bool:
    return eqn.primitive.name == "convert_element_type" and capture_mod.scope_of(eqn) is None


def _sink_casts(cap):
    """Move the leading input casts next to their first consumer (with its source info, so they
    join its TaskGraph), retag the final loss cast with its producer's, and regroup."""
    jaxpr = cap.jaxpr.jaxpr
    inputs = set(jaxpr.invars)
    eqns = list(jaxpr.eqns)
    lead = 0
    while lead < len(eqns) and _is_cast(eqns[lead]) and eqns[lead].invars[0] in inputs:
        lead += 1
    pending = {e.outvars[0]: e for e in eqns[:lead]}
    loss = jaxpr.outvars[0]
    producer: dict = {}
    moved = []
    for eqn in eqns[lead:]:
        for v in eqn.invars:
            if not isinstance(v, C.Literal) and v in pending:
                moved.append(pending.pop(v).replace(source_info=eqn.source_info))
        if eqn.outvars[0] is loss and _is_cast(eqn) and eqn.invars[0] in producer:    # AmpLoss's fp32 cast
            eqn = eqn.replace(source_info=producer[eqn.invars[0]].source_info)
        moved.append(eqn)
        for v in eqn.outvars:
            producer[v] = eqn
    returned = [v for v in jaxpr.outvars if not isinstance(v, C.Literal) and v in pending]
    moved = [pending.pop(v) for v in returned] + moved        # an input returned as it is
    new = jaxpr.replace(eqns=moved)
    taskgraphs, assign = capture_mod._group(new, cap.num_params, cap.default)
    return dataclasses.replace(cap, jaxpr=C.ClosedJaxpr(new, cap.jaxpr.consts), taskgraphs=taskgraphs,
                               assign=assign)


# ----------------------------------------------------------------------------------- loss scaling
class LossScale(struct.PyTreeNode):
    """Dynamic loss scale (amp="fp16"): the scale and the finite steps since it last changed."""

    scale: jax.Array
    good_steps: jax.Array

    @classmethod
    def initial(cls) -> LossScale:
        return cls(jnp.asarray(INITIAL_SCALE, jnp.float32), jnp.asarray(0, jnp.int32))

    def adjust(self, finite, period: int) -> LossScale:
        """Halve on overflow; double after `period` finite steps in a row (at most MAX_SCALE)."""
        grown = self.good_steps + 1 >= period
        scale = jnp.where(finite, jnp.where(grown, jnp.minimum(self.scale * 2, MAX_SCALE), self.scale),
                          jnp.maximum(self.scale / 2, 1.0))
        good = jnp.where(finite & ~grown, self.good_steps + 1, 0)
        return LossScale(scale.astype(jnp.float32), good.astype(jnp.int32))


def value_and_grad(loss: Callable) -> Callable:
    """`jax.value_and_grad(loss, has_aux=True)` taking an optional loss scale: with one, the
    gradient of scale * loss, divided by the scale (the value returned is the unscaled loss)."""
    plain = jax.value_and_grad(loss, has_aux=True)

    def scaled_loss(params, batch, scale):
        value, aux = loss(params, batch)
        return value * scale.astype(value.dtype), (value, aux)

    scaled = jax.value_and_grad(scaled_loss, has_aux=True)

    def vg(params, batch, scale=None):
        if scale is None:
            return plain(params, batch)
        (_, (value, aux)), grads = scaled(params, batch, scale)
        return (value, aux), unscale(grads, scale)

    return vg


def unscale(grads, scale):
    return jax.tree.map(lambda g: (g / scale.astype(g.dtype)) if jnp.issubdtype(g.dtype, jnp.floating) else g, grads)


def all_finite(tree):
    leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)


def loss_scaled_step(value_and_grad: Callable, build: Callable, period: int) -> Callable:
    """Wrap the step `build(value_and_grad)` with dynamic loss scaling: value_and_grad(params,
    batch, scale) gives unscaled gradients; non-finite ones skip the update."""

    def step(state, batch):
        ls = state.loss_scale
        box = {}

        def vg(params, batch, extra=()):
            (value, aux, new_state), grads = value_and_grad(params, batch, extra, ls.scale)
            box["finite"] = all_finite(grads)
            return (value, aux, new_state), grads

        new, metrics = build(vg)(state.replace(loss_scale=None), batch)
        finite = box["finite"]
        keep = lambda a, b: jax.tree.map(lambda x, y: jnp.where(finite, x, y), a, b)  # noqa: E731
        new = new.replace(stored_params=keep(new.stored_params, state.stored_params),
                          opt_state=keep(new.opt_state, state.opt_state),
                          model_state=keep(new.model_state, state.model_state),
                          loss_scale=ls.adjust(finite, period))
        return new, {**metrics, "loss_scale": ls.scale, "grads_finite": finite}

    return step


# ----------------------------------------------------------------------------------- comm dtype
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
