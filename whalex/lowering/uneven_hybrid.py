"""Uneven rows in a hybrid (Whale Example 2, section 3.3.1): a `replicate` backbone on
speed-proportional rows, a `split` head keeping its layout, and a bridge between the two.

The loss's top-level equations `[0, cut)` are the backbone, per-sample (checked by the planner);
the rest is the head. In one jitted step:

1. backbone: a `shard_map` over every mesh axis; device i runs its own `rows[i]` of the padded
   batch in chunks (`UnevenProgram.parts_driver`: full chunks in a loop, the remainder
   chunk under `cond`), writing the boundary activations into its padded block; no collective inside;
2. bridge forward: the real rows gathered into global order (a static index into the padded
   blocks), straight into the head's input layout: a replicated head gets one all-gather of the
   padded blocks and a local take (the partitioner would otherwise scatter into zeros and
   all-reduce the whole batch), and the even plan's layouts of the replaced backbone values are
   dropped, so the features are not re-sharded to even rows and gathered again (forward and back);
3. head: the captured loss evaluated by the head's GSPMD `Program` (its constraints, even or
   uneven column shards) on the whole batch, the backbone equations replaced by the bridge
   values: the loss keeps its whole-batch meaning with no parts machinery;
4. bridge backward and backbone backward: each device gathers the cotangent of its own rows (for a
   replicated head, a local gather from the replicated cotangent); a `custom_vjp` carries the
   backbone (a loop whose trip count differs between devices cannot stack residuals for
   `jax.grad`): its forward loop stores each
   chunk's vjp residuals in buffers with a slot per chunk (`whalex.lowering.stored_vjp`), its
   backward loop applies each chunk's pullback to them, then one fused `psum` of the backbone
   gradients. The head's gradients stay sharded, as in the even plan.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from whalex.jaxpr.capture import Captured
from whalex.jaxpr.interpret import make_evaluator, subgraph_function
from whalex.lowering.fused_collectives import fused_psum
from whalex.lowering.step import Program
from whalex.lowering.stored_vjp import part_vjp
from whalex.lowering.uneven import UnevenProgram
from whalex.records.program import step_program


@dataclasses.dataclass(frozen=True)
class Backbone:
    """The equations `[0, cut)` of a capture at `rows` samples as a function of the parameter and
    batch leaves they read: f(params, batch) -> the boundary values (those the head reads)."""

    captured: Captured
    cut: int

    @functools.cached_property
    def _sub(self):
        return subgraph_function(self.captured.jaxpr.jaxpr, range(self.cut))

    @property
    def _inputs(self) -> dict:
        jaxpr = self.captured.jaxpr.jaxpr
        return {v: i for i, v in enumerate(jaxpr.invars)}

    @property
    def param_leaves(self) -> tuple[int, ...]:
        """The parameter leaves the backbone reads (flat indices)."""
        n = self.captured.num_params
        return tuple(sorted({self._inputs[v] for v in self._sub[0] if self._inputs.get(v, n) < n}))

    @property
    def batch_leaves(self) -> tuple[int, ...]:
        """The batch leaves the backbone reads (indices into the batch leaves)."""
        n = self.captured.num_params
        return tuple(sorted({self._inputs[v] - n for v in self._sub[0] if self._inputs.get(v, -1) >= n}))

    @property
    def outputs(self) -> list:
        return self._sub[1]

    def input_shapes(self) -> tuple[list, list]:
        """ShapeDtypeStructs of the parameter and batch leaves `__call__` takes."""
        invars, n = self.captured.jaxpr.jaxpr.invars, self.captured.num_params
        shape = lambda v: jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)  # noqa: E731
        return [shape(invars[i]) for i in self.param_leaves], [shape(invars[n + i]) for i in self.batch_leaves]

    def __call__(self, params, batch) -> list:
        inputs, _, fn = self._sub
        pos, n = self._inputs, self.captured.num_params
        closed = self.captured.jaxpr
        consts = dict(zip(closed.jaxpr.constvars, closed.consts))
        p_at = {i: k for k, i in enumerate(self.param_leaves)}
        b_at = {i: k for k, i in enumerate(self.batch_leaves)}
        args = [consts[v] if v not in pos else params[p_at[pos[v]]] if pos[v] < n else batch[b_at[pos[v] - n]]
                for v in inputs]
        return fn(*args)


@step_program
@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridProgram(Program):
    """The head's GSPMD `Program` (its fields: the whole loss at the global batch, its shardings and
    storage layout) with the backbone run on uneven rows: the batch is laid out as `rows` lays it out,
    and `value_and_grad` runs the backbone's chunk loop, the bridge and the head."""

    rows: UnevenProgram          # the backbone's rows: padded per-device layout and the chunk loop
    backbones: tuple             # (part rows, Backbone) for every part size the chunk loop runs
    cut: int                     # top-level equations [0, cut) are the backbone
    head_batch: Any = P()        # the split head's batch layout (its VirtualDevice's batch axes)

    @classmethod
    def over(cls, head: Program, rows: UnevenProgram, backbones: tuple, cut: int, head_batch=P()) -> HybridProgram:
        """The hybrid program of the even GSPMD program `head`, its backbone on `rows`."""
        fields = {f.name: getattr(head, f.name) for f in dataclasses.fields(Program)}
        return cls(**fields, rows=rows, backbones=backbones, cut=cut, head_batch=head_batch)

    # -- the uneven batch: the rows' layout ------------------------------------------------------------
    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis, in order: the device order of `rows` (the mesh's flat device order)."""
        return tuple(self.mesh.axis_names)

    @functools.cached_property
    def batch_shardings(self):
        return jax.tree.map(lambda _: NamedSharding(self.mesh, P(self.axes)), self.batch_shapes())

    def batch_shapes(self):
        """Shapes of the padded batch the step takes (the rows' per-device blocks)."""
        return self.rows.batch_shapes()

    def row_ranges(self):
        return self.rows.row_ranges()

    def pad_batch(self, batch):
        """Host-side: the global batch in the rows' padded per-device blocks."""
        return self.rows.pad_batch(batch)

    def place_batch(self, batch):
        return self.rows.place_padded(batch, self.batch_shardings)

    def gather_index(self) -> np.ndarray:
        """For each global row, its row in the padded per-device layout (the bridge's static gather)."""
        block = self.rows.block
        return np.concatenate([d * block + np.arange(b - a) for d, (a, b) in enumerate(self.row_ranges())])

    # -- the step -------------------------------------------------------------------------------
    @functools.cached_property
    def part_vjps(self) -> dict:
        """Part rows -> the backbone's vjp at that size, its residuals sorted for storage."""
        return {s: part_vjp(bb, *bb.input_shapes()) for s, bb in self.backbones}

    def slots(self, size: int) -> int:
        """Residual slots of one part size per device: one per full chunk of the busiest device;
        a remainder size runs at most once."""
        return max(self.rows.full_chunks) if size == self.rows.chunk else 1

    def backbone(self):
        """f(backbone params, batch blocks) -> boundary values in the padded per-device layout, with a
        custom_vjp: the forward chunk loop stores each part's residuals in per-size buffers (a slot
        per part), the backward loop applies each part's pullback to them, then one psum of the
        parameter gradients."""
        axes, chunk = self.axes, self.rows.chunk
        starts = jnp.asarray([a for a, _ in self.rows.row_ranges()], jnp.int32)

        def local_part(where):
            """(offset in this device's block, rows, residual slot) of a part."""
            (first, size), = where
            off = first - starts[jax.lax.axis_index(axes)]
            return off, size, off // chunk if size == chunk else 0

        spec = P(axes)
        fwd_map = jax.shard_map(self._forward_local(local_part), mesh=self.mesh, in_specs=(P(), spec),
                                out_specs=(spec, spec), check_vma=False)
        bwd_map = jax.shard_map(self._backward_local(local_part), mesh=self.mesh, in_specs=(P(), spec, spec, spec),
                                out_specs=P(), check_vma=False)

        @jax.custom_vjp
        def backbone(params, blocks):
            return fwd_map(params, blocks)[0]

        def fwd(params, blocks):
            acts, bufs = fwd_map(params, blocks)
            return acts, (params, blocks, bufs)

        def bwd(res, cts):
            params, blocks, bufs = res
            return bwd_map(params, blocks, bufs, cts), jax.tree.map(_zero_cotangent, blocks)

        backbone.defvjp(fwd, bwd)
        return backbone

    def _forward_local(self, local_part):
        """One device's forward chunk loop: each part's boundary values written at its offset in the
        block, its residuals into its slot of the buffers of its size."""
        vjps, outs = self.part_vjps, self.backbones[0][1].outputs
        rows, axes, block = self.rows, self.axes, self.rows.block

        def fwd_local(params, blocks):
            loop, _ = rows.parts_driver(blocks, axis=axes)
            acts = [jnp.zeros((block,) + tuple(v.aval.shape[1:]), v.aval.dtype) for v in outs]
            bufs = {s: [jnp.zeros((self.slots(s),) + r.shape, r.dtype) for r in v.stored] for s, v in vjps.items()}

            def fn(part, where, acc):
                acts, bufs = acc
                off, size, slot = local_part(where)
                vals, res = vjps[size].forward(params, part)
                acts = [jax.lax.dynamic_update_slice_in_dim(a, v, off, 0) for a, v in zip(acts, vals)]
                bufs = {**bufs, size: [jax.lax.dynamic_update_index_in_dim(b, r, slot, 0)
                                       for b, r in zip(bufs[size], res)]}
                return acts, bufs
            return loop(fn, (acts, bufs))

        return fwd_local

    def _backward_local(self, local_part):
        """One device's backward chunk loop: each part's pullback applied to its stored residuals, the
        parameter gradients summed over the loop, then over the mesh."""
        vjps, rows, axes = self.part_vjps, self.rows, self.axes

        def bwd_local(params, blocks, bufs, cts):
            loop, _ = rows.parts_driver(blocks, axis=axes)
            consts = {s: v.constants() for s, v in vjps.items()}

            def fn(part, where, acc):
                off, size, slot = local_part(where)
                ct = [jax.lax.dynamic_slice_in_dim(c, off, size, 0) for c in cts]
                res = [jax.lax.dynamic_index_in_dim(b, slot, 0, keepdims=False) for b in bufs[size]]
                return jax.tree.map(jnp.add, acc, vjps[size].backward(params, part, res, consts[size], ct))
            grads = loop(fn, jax.tree.map(jnp.zeros_like, params))
            return fused_psum(grads, axes)                # after the loop: one all-reduce per dtype

        return bwd_local

    def _bridge(self):
        """f(padded per-device blocks) -> the global batch in the head's layout. A replicated head gets
        one all-gather of the blocks and a local take; backward, each device takes its own rows of
        the (replicated) cotangent, a local gather with no zero-filled buffer of the gathered blocks."""
        mesh = self.mesh
        head_rows = NamedSharding(mesh, self.head_batch)
        index = np.asarray(self.gather_index(), np.int32)

        def sharded(x):
            return jax.lax.with_sharding_constraint(jnp.take(x, index, axis=0), head_rows)

        if self.head_batch != P():
            return sharded
        whole, blocks = NamedSharding(mesh, P()), NamedSharding(mesh, P(self.axes))
        inverse = np.full((len(self.rows.rows) * self.rows.block,), len(index), np.int32)   # padding: out of range
        inverse[index] = np.arange(len(index), dtype=np.int32)

        def gathered(x):
            x = jax.lax.with_sharding_constraint(x, whole)
            return jax.lax.with_sharding_constraint(jnp.take(x, index, axis=0), whole)

        replicated = jax.custom_vjp(gathered)

        def fwd(x):
            return gathered(x), None

        def bwd(_, ct):                                # padding rows read out of range: a zero cotangent
            return (jax.lax.with_sharding_constraint(jnp.take(ct, inverse, axis=0, mode="fill", fill_value=0),
                                                     blocks),)

        replicated.defvjp(fwd, bwd)
        return lambda x: replicated(x) if jnp.issubdtype(x.dtype, jnp.inexact) else gathered(x)

    def value_and_grad(self):
        cap, cut = self.captured, self.cut
        any_bb = self.backbones[0][1]
        p_idx, b_idx = any_bb.param_leaves, any_bb.batch_leaves
        # boundary values of the global-batch capture, in the order the backbone returns them
        boundary = Backbone(cap, cut).outputs
        backbone = self.backbone()
        jaxpr = cap.jaxpr.jaxpr
        mesh = self.mesh
        grad_shardings = self.param_shardings
        # the backbone's equations are replaced by the bridge: the even plan's layouts of their values
        # (batch-sharded rows) would only re-shard what the bridge hands the head in its own layout
        head_constraints = {k: s for k, s in self.sharding.constraints.items() if k[0][0] >= cut}

        bridge = self._bridge()

        def loss(params, blocks):
            leaves = jax.tree.leaves(params)
            acts = backbone([leaves[i] for i in p_idx], [blocks[i] for i in b_idx])
            value_of = dict(zip(boundary, [bridge(a) for a in acts]))
            overrides = dict(self.overrides or {})
            for i in range(cut):             # the backbone's equations: replaced by the bridge values
                outvars = jaxpr.eqns[i].outvars
                overrides[(i,)] = lambda *_, o=outvars: [value_of[v] if v in value_of else
                                                         jnp.zeros(v.aval.shape, v.aval.dtype) for v in o]
            evaluate = make_evaluator(cap.jaxpr, head_constraints, mesh, overrides)
            outs = evaluate(*leaves, *[bridge(x) for x in blocks])
            value, aux, _ = cap.split_outputs(outs)
            return value, aux

        vg = jax.value_and_grad(loss, has_aux=True)

        def run(params, batch, extra=(), scale=None):
            (value, aux), grads = vg(params, jax.tree.leaves(batch))
            return (value, aux, []), jax.lax.with_sharding_constraint(grads, grad_shardings)

        return run


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)
