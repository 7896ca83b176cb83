"""One device's pipelined step, the body of the step's `shard_map`: its stage's parameters, the loss
contract's pre-pass, the tick loop, and the reductions after it.

The last stage runs the pre-pass (the loss's data-only reductions, e.g. a token count, over every
micro-batch of its replica: it holds the batch leaves they read) and every stage receives its
results. After the loop, the part outputs are combined over stages and replicas by their kind,
per-example outputs are gathered over replicas in global batch order, and the stage gradients are
summed over the replicas (`psum`, or a reduce-scatter under ZeRO 2 and 3).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from whalex.jaxpr.interpret import make_evaluator
from whalex.loss import evaluation as parts_lib
from whalex.lowering.fused_collectives import fused_psum
from whalex.lowering.pipeline.axes import DATA, MODEL, STAGE
from whalex.lowering.pipeline.branches import Stage, branches
from whalex.lowering.pipeline.packing import join_segments, pack_values, unpack_values
from whalex.lowering.pipeline.rows import ParamRows
from whalex.lowering.pipeline.ticks import Device, LoopState, TickLoop
from whalex.lowering.stage_batch import StageBatchLayout
from whalex.memory import zero as zero_lib
from whalex.precision.comm import reduce_in


def from_stage(x, s, src: int, num_stages: int):
    """`x` as stage `src` computed it, on every stage (`s`: this device's stage): the other stages'
    copies masked out and summed over `stage`, booleans as int32."""
    if num_stages == 1:
        return x
    wide = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
    return jax.lax.psum(jnp.where(s == src, wide, jnp.zeros_like(wide)), STAGE).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class PipelineBody:
    """What one device's step needs: the tick loop, the stages, and the loss contract."""

    loop: TickLoop
    stages: tuple[Stage, ...]
    rows: ParamRows
    parts: Any                      # whalex.loss.evaluation.PartLoss
    num_params: int
    param_avals: tuple
    batch_avals: tuple
    batch: StageBatchLayout
    micro: int                      # rows per micro-batch
    per_replica: int                # rows per replica
    zero_level: int
    row_specs: tuple[P, P]          # the stage rows' spec, and split over `data` (ZeRO 2 and 3)
    precision: Any = None           # whalex.records.memory_options.Precision

    @property
    def home(self) -> int:
        """The stage that runs the pre-pass: the last."""
        return self.loop.num_stages - 1

    def stage_params(self, packed) -> tuple:
        """This device's stage rows (ZeRO 3: all-gathered over the replicas; 3D: the model row too)."""
        row = packed["stages"]
        if self.zero_level >= 3:
            row = zero_lib.gather([row], [self.row_specs[0]], [self.row_specs[1]], DATA)[0]
        params = (row[0],)
        if self.rows.three_d:       # [model, width]: row m on model device m (an auto axis here)
            params += (jax.lax.with_sharding_constraint(packed["model"][0], P(MODEL)),)
        return params

    def prepass(self, device: Device) -> dict:
        """The global values of the data-only reductions, on every stage: {equation index: outputs}."""
        home, S = self.home, self.loop.num_stages

        def loop(fn, init):         # every micro-batch of this replica, on the home stage's batch leaves
            def step(k, acc):
                held = self.batch.unpack(device.micro_rows(k), home)
                part = [x if x is not None else jnp.zeros((self.micro,) + a.shape[1:], a.dtype)
                        for x, a in zip(held, self.batch_avals)]
                return fn(part, device.where(k), acc)
            return jax.lax.fori_loop(0, self.loop.num_micro, step, init)

        def across(values, kinds):
            return [from_stage(v, device.stage, home, S) for v in parts_lib.across_devices(values, kinds, DATA)]

        zeros = [jnp.zeros(a.shape, a.dtype) for a in self.param_avals]     # the pre-pass reads no parameter
        return parts_lib.prepass(self.parts, lambda c, ovr: make_evaluator(c.jaxpr, {}, None, ovr), loop, across,
                                 zeros, device.extra)

    def cotangent(self, given: dict, extra: list, scale):
        """The cotangent vector of the batch-free part outputs that starts the last stage's backward."""
        outputs = self.loop.outputs
        idx, cots = parts_lib.cotangents(self.parts, given, extra, self.num_params, scale)
        slots, width = outputs.slots
        full = [jnp.zeros(sl.shape, jnp.float32) for sl in slots]
        for k, c in zip(idx, cots):
            full[outputs.values.index(k)] = c.astype(jnp.float32)
        return pack_values(full, width)

    def overrides(self, given: dict, device: Device, m) -> dict:
        """The loss contract's overrides of micro-batch m."""
        return parts_lib.part_overrides(self.parts, given, device.where(m))

    def finish(self, state: LoopState, given: dict, device: Device) -> list:
        """The loss's outputs from the accumulated part outputs, combined over stages and replicas."""
        outputs, S = self.loop.outputs, self.loop.num_stages
        values = unpack_values(outputs.across(state.outputs, (STAGE, DATA)), outputs.slots[0])
        rows = [jax.lax.all_gather(from_stage(x, device.stage, S - 1, S), DATA, tiled=True) for x in state.rows]
        return parts_lib.finish(self.parts, given, device.extra, self.num_params, outputs.assemble(values, rows))

    def reduce_grads(self, grads: list) -> dict:
        """The stage gradient rows summed over the replicas (ZeRO 2 and 3: reduce-scattered over them)."""
        prec, specs, zspecs = self.precision, [self.row_specs[0]], [self.row_specs[1]]
        if self.zero_level >= 2:
            flat = reduce_in(prec, lambda g: zero_lib.scatter_sum([g[None]], specs, zspecs, DATA)[0],
                                           grads[0])
        else:
            flat = reduce_in(prec, lambda g: fused_psum(g, DATA), grads[0])[None]
        if not self.rows.three_d:
            return {"stages": flat}
        return {"stages": flat, "model": reduce_in(prec, lambda g: fused_psum(g, DATA), grads[1])[None]}

    def step(self, packed, batch, extra, *scale):
        """(the loss's outputs, the stage gradient rows) of this device: the `shard_map` body."""
        scale = scale[0] if scale else None
        params = self.stage_params(packed)
        device = Device(jax.lax.axis_index(STAGE), jax.lax.axis_index(DATA), params,
                        {g: x[0] for g, x in batch.items()}, list(extra), self.micro, self.per_replica)
        given = self.prepass(device)
        cot = self.cotangent(given, device.extra, scale)
        work = branches(self.stages, functools.partial(self.overrides, given, device), cot)
        state = self.loop.run(device, work, self.rows.zero_rows)
        grads = [join_segments(segs) for segs in state.grads]
        outs = self.finish(state, given, device)
        return outs, self.reduce_grads(grads)
