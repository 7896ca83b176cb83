"""Uneven `split` of the classification head, MLPs and attention (Whale section 3.3.1, intra-TaskGraph
balance for split).

Device i of the model axis owns `counts[i]` classes, hidden units or heads (proportional to its speed,
under memory; chosen by the planner with Algorithm 1, `whalex.balance.columns.plan_columns`), stored
padded to a common width (`whalex.columns.UnevenColumns`). The head is `whalex.columns.uneven_head`;
`uneven_blocks` does the same for MLPs and attention (hidden units, heads),
written as `Stage`s whose values between stages the forward keeps, so that the backward recomputes no
forward matmul (on CPU, the looped blocks recompute theirs: see `_Blocks`); the blocks
every device runs are written out, not looped. The planner hands its decisions down as data,
`UnevenCall`s; `uneven_overrides` builds the functions that replace those equations.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from whalex.columns import UnevenColumns, uneven_head
from whalex.jaxpr.flops import equation_flops
from whalex.ops import ACTIVATIONS, attention_mix, attention_out, attention_project, attention_scores


@dataclasses.dataclass(frozen=True)
class Stage:
    """One step of a block: `fn(weight slices, *inputs) -> tuple of n_out outputs`; `reads` index the
    block's values (0: the input x, then every stage's outputs in order), `weights` the block's
    weights it reads. The values between stages are what the backward pass keeps."""

    fn: Callable
    reads: tuple[int, ...]
    weights: tuple[int, ...]
    n_out: int = 1


def _outputs(stages) -> list[tuple[int, ...]]:
    """Per stage, the indices of the values it produces."""
    out, idx = [], 1
    for st in stages:
        out.append(tuple(range(idx, idx + st.n_out)))
        idx += st.n_out
    return out


def _run_stages(stages, x, ws) -> list:
    """Every value of one block: [x, stage 0's outputs, stage 1's outputs, ...]."""
    vals = [x]
    for st in stages:
        vals.extend(st.fn([ws[j] for j in st.weights], *[vals[i] for i in st.reads]))
    return vals


def _add(acc: list, where, values) -> None:
    for i, v in zip(where, values):
        acc[i] = v if acc[i] is None else acc[i] + v


def _stage_vjps(stages, vals, ws, g):
    """(dx, weight-slice gradients) of one block from its kept values: each stage's VJP at its kept
    inputs. No stage output is read, so XLA drops the forward matmuls a VJP would recompute."""
    cot, gws = [None] * len(vals), [None] * len(ws)
    cot[-1] = g
    for st, outs in reversed(list(zip(stages, _outputs(stages)))):
        fn = lambda w, *a, st=st: tuple(st.fn(w, *a))          # noqa: E731
        _, vjp = jax.vjp(fn, [ws[j] for j in st.weights], *[vals[i] for i in st.reads])
        gw, *gins = vjp(tuple(jnp.zeros_like(vals[i]) if cot[i] is None else cot[i] for i in outs))
        _add(gws, st.weights, gw)
        _add(cot, st.reads, gins)
    return cot[0], [jnp.zeros_like(w) if d is None else d for d, w in zip(gws, ws)]


def mlp_stages(activation: str) -> tuple[Stage, ...]:
    """`activation(x @ c1 + cb) @ c2` in two stages: the pre-activation is kept."""
    act = ACTIVATIONS[activation]
    return (Stage(lambda w, x: (x @ w[0] + w[1],), (0,), (0, 1)),
            Stage(lambda w, h: (act(h) @ w[0],), (1,), (2,)))


def attention_stages(causal: bool) -> tuple[Stage, ...]:
    """`wh.ops.attention_heads` in four stages: q, k, v, the scores and the mixed values are kept."""
    return (Stage(lambda w, x: attention_project(x, *w), (0,), (0, 1, 2, 3, 4, 5), 3),
            Stage(lambda w, q, k: (attention_scores(q, k, causal),), (1, 2), ()),
            Stage(lambda w, s, v: (attention_mix(s, v),), (4, 3), ()),
            Stage(lambda w, o: (attention_out(o, w[0]),), (5,), (6,)))


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """One device's side of `uneven_blocks`. The `peeled` chunks every device runs (the smallest
    count's) are written out, each block's values kept as separate outputs; only the chunks beyond
    them loop. A device-dependent trip count keeps XLA from fusing a loop's body with what surrounds
    it, and a loop's accumulators need initial values; peeling leaves the device with the fewest
    units no loop at all. The looped blocks either keep their values in `slots - peeled` buffers
    (`lax.empty`: allocated, not written, on GPU and TPU) or, with `recompute`, run their forward
    again in the backward pass (on CPU, where `lax.empty` is a zero fill of fresh memory, which
    costs a device that never uses the buffers more than the recomputed forward costs another)."""

    stages: tuple
    layout: UnevenColumns
    dims: tuple[int, ...]
    axis: str
    batch_axes: tuple
    recompute: bool = False

    @property
    def chunk(self) -> int:
        return self.layout.chunk

    @property
    def slots(self) -> int:
        return self.layout.width // self.chunk

    @property
    def peeled(self) -> int:
        return self.layout.common // self.chunk

    @property
    def looped(self) -> bool:
        """Whether some device runs blocks beyond the peeled ones."""
        return self.slots > self.peeled

    @property
    def buffered(self) -> bool:
        return self.looped and not self.recompute

    @property
    def n_kept(self) -> int:
        return sum(st.n_out for st in self.stages) - 1

    def slices(self, k, ws):
        return [jax.lax.dynamic_slice_in_dim(w, k * self.chunk, self.chunk, d) for w, d in zip(ws, self.dims)]

    def trips(self):
        return jnp.asarray(self.layout.counts, jnp.int32)[jax.lax.axis_index(self.axis)] // self.chunk

    def fwd(self, keep: bool, x, *ws):
        """(the psum of this device's blocks, then, if `keep`, each peeled block's kept values (with a
        leading axis of 1) and the looped blocks' kept values in `slots - peeled` buffers)."""
        p = self.peeled
        peeled = [_run_stages(self.stages, x, self.slices(k, ws)) for k in range(p)]
        y = functools.reduce(jnp.add, [v[-1] for v in peeled]) if p else None
        kept = [v[None] for vals in peeled for v in vals[1:-1]] if keep else []
        if self.looped:
            shapes = jax.eval_shape(lambda x, ws: _run_stages(self.stages, x, self.slices(0, ws)), x, list(ws))
            keep_bufs = keep and self.buffered
            bufs = [jax.lax.empty((self.slots - p if keep_bufs else 0,) + v.shape, v.dtype) for v in shapes[1:-1]]

            def body(k, acc):
                vals = _run_stages(self.stages, x, self.slices(k, ws))
                bufs = [jax.lax.dynamic_update_index_in_dim(b, v, k - p, 0) for b, v in zip(acc[1], vals[1:-1])] \
                    if keep_bufs else acc[1]
                return acc[0] + vals[-1], bufs

            y0 = y if y is not None else jnp.zeros(shapes[-1].shape, shapes[-1].dtype)
            y, bufs = jax.lax.fori_loop(p, self.trips(), body, (y0, bufs))
            kept += bufs if keep_bufs else []
        return (jax.lax.psum(y, self.axis), *kept)

    def bwd(self, x, *args):
        """(dx, weight gradients) from the kept values: each block's stage VJPs, then one psum of dx."""
        nw, p, nk = len(self.dims), self.peeled, self.n_kept
        ws, g = args[:nw], args[-1]
        peeled, bufs = args[nw:nw + p * nk], args[nw + p * nk:-1]
        dx, dws = None, [jnp.zeros_like(w) for w in ws]
        for k in range(p):
            vals = [x] + [v[0] for v in peeled[k * nk:(k + 1) * nk]] + [g]
            gx, gws = _stage_vjps(self.stages, vals, self.slices(k, ws), g)
            dx = gx if dx is None else dx + gx
            dws = [jax.lax.dynamic_update_slice_in_dim(dw, gw, k * self.chunk, d)
                   for dw, gw, d in zip(dws, gws, self.dims)]
        if self.looped:
            def body(k, acc):
                if self.recompute:
                    vals = _run_stages(self.stages, x, self.slices(k, ws))[:-1] + [g]
                else:
                    vals = [x] + [jax.lax.dynamic_index_in_dim(b, k - p, 0, keepdims=False) for b in bufs] + [g]
                gx, gws = _stage_vjps(self.stages, vals, self.slices(k, ws), g)
                return acc[0] + gx, [jax.lax.dynamic_update_slice_in_dim(dw, gw, k * self.chunk, d)
                                     for dw, gw, d in zip(acc[1], gws, self.dims)]

            dx, dws = jax.lax.fori_loop(p, self.trips(), body, (jnp.zeros_like(x) if dx is None else dx, dws))
        dx = jax.lax.psum(dx, self.axis)                   # after the loop: partial sums over the units
        if self.batch_axes:
            dws = jax.lax.psum(dws, self.batch_axes)
        return (dx, *dws)


def uneven_blocks(mesh, model_axis: str, batch_axes: tuple, layout: UnevenColumns, stages, dims: tuple[int, ...],
                  recompute: bool = False):
    """f(x, *weights_padded) -> sum over the real units of the block `stages` computes, the units
    (hidden units, heads) uneven over `model_axis`: weight i is sliced on dims[i], device j runs
    its own `chunk`-unit blocks (work proportional to its share; padding never read), the blocks
    every device has written out and the rest in a loop, then one psum. Each block's values between
    stages are kept (peeled blocks' as they are, looped blocks' in buffers unless `recompute`); the
    custom VJP runs each block's stage VJPs on them, then one psum of the input gradient."""
    blocks = _Blocks(tuple(stages), layout, tuple(dims), model_axis, tuple(batch_axes), recompute)
    bspec = batch_axes if batch_axes else None
    w_specs = tuple(P(*([None] * d + [model_axis])) for d in dims)
    n_out = blocks.n_kept * (blocks.peeled + blocks.buffered)
    k_specs = (P(model_axis, bspec),) * n_out

    def fwd_map(keep):
        return jax.shard_map(functools.partial(blocks.fwd, keep), mesh=mesh, in_specs=(P(bspec),) + w_specs,
                             out_specs=(P(bspec),) + (k_specs if keep else ()), check_vma=False)

    bwd_map = jax.shard_map(blocks.bwd, mesh=mesh, in_specs=(P(bspec),) + w_specs + k_specs + (P(bspec),),
                            out_specs=(P(bspec),) + w_specs, check_vma=False)

    @jax.custom_vjp
    def run(x, *ws):
        return fwd_map(False)(x, *ws)[0]

    def fwd(x, *ws):
        y, *kept = fwd_map(True)(x, *ws)
        return y, (x, ws, kept)

    def bwd(res, g):
        x, ws, kept = res
        return bwd_map(x, *ws, *kept, g)

    run.defvjp(fwd, bwd)
    return run


@dataclasses.dataclass(frozen=True)
class UnevenCall:
    """The planner's decision for one call it runs uneven over a heterogeneous model axis: the
    softmax cross-entropy head (`kind="head"`), an MLP ("mlp", with its activation) or causal or
    full attention ("attention"); lowering builds the function (`uneven_overrides`)."""

    path: tuple                  # the call's equation path
    kind: str                    # head | mlp | attention
    axis: str                    # the model axis
    batch_axes: tuple            # the data-parallel axes the batch is split over
    columns: UnevenColumns       # classes, hidden units or heads per device
    dims: tuple[int, ...] = ()   # per weight, the dim its units lie on (mlp, attention)
    activation: str = ""         # mlp
    causal: bool = False         # attention
    global_batch: int = 0        # head: the loss is a mean over it
    recompute: bool = False      # mlp, attention: looped blocks run their forward again in the backward


def _stages(call: UnevenCall) -> tuple[Stage, ...]:
    """The stages of an mlp or attention call."""
    return attention_stages(call.causal) if call.kind == "attention" else mlp_stages(call.activation)


def _override(call: UnevenCall, mesh):
    """The function of the call's inputs that replaces its equation (outputs as a list)."""
    if call.kind == "head":
        head = uneven_head(mesh, call.axis, call.batch_axes, call.columns, call.global_batch)
        return lambda *args: [head(*args)]
    fn = uneven_blocks(mesh, call.axis, call.batch_axes, call.columns, _stages(call), call.dims, call.recompute)
    return lambda x, *ws: [fn(x, *ws[:-1]) + ws[-1]]        # the output bias, whole, added once


def recomputed_flops_per_unit(call: UnevenCall, x, weights) -> float:
    """FLOPs one looped unit of an mlp or attention call runs again in the backward pass when it
    recomputes (`UnevenCall.recompute`): every stage but the last, whose output no VJP reads, for an
    input `x` (ShapeDtypeStruct; `weights` as the call reads them, logical shapes)."""
    stages = _stages(call)
    one = [jax.ShapeDtypeStruct(tuple(1 if i == d else n for i, n in enumerate(w.shape)), w.dtype)
           for w, d in zip(weights, call.dims)]
    jaxpr = jax.make_jaxpr(lambda x, ws: _run_stages(stages[:-1], x, ws))(x, one)
    return equation_flops(jaxpr, [False] * len(jaxpr.jaxpr.invars), [False] * len(jaxpr.jaxpr.outvars)).forward


def uneven_overrides(calls, mesh) -> dict:
    """path -> function for every UnevenCall: the evaluator's overrides."""
    return {call.path: _override(call, mesh) for call in calls}
