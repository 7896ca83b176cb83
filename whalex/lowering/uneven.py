"""Uneven data parallelism in one SPMD program (Whale section 3.3.1, intra-TaskGraph balance).

Device i trains on its own number of samples, `counts[i] * unit`, chosen by Algorithm 1 (in
`whalex.planner.uneven`). The global batch is laid out padded: device i's block of
`max(counts) * unit` rows holds its real rows first and padding after. Inside `shard_map`, each
device runs a `fori_loop` over its own number of `unit`-row chunks (the trip count differs
between devices, so no collective runs inside the loop), accumulating sample-weighted loss and
gradients; one `psum` after the loop gives exactly the global-batch mean. Padding rows are never
read.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from whalex.core import part_loss as parts_lib
from whalex.core.capture import Captured
from whalex.distributed import place_global
from whalex.errors import PlanError
from whalex.lowering.emit import Emitter
from whalex.memory import precision as precision_lib, zero as zero_lib
from whalex.memory.remat import program_evaluator

DATA = "data"


@dataclasses.dataclass(frozen=True)
class UnevenProgram(Emitter):
    captured: Captured           # traced at `unit` rows
    mesh: Any                    # 1-D mesh over every device, axis "data"
    optimizer: optax.GradientTransformation | None
    platform: str
    counts: tuple[int, ...]      # chunks of `unit` rows per device
    unit: int
    global_batch: int
    memory: Any = None           # whalex.memory.MemoryOptions (ZeRO level, offload)
    precision: Any = None        # whalex.memory.precision.Precision (amp, comm_dtype)
    remat: Any = None            # whalex.memory.remat.RematPlan (per-TaskGraph remat, activation offload)
    parts: Any = None            # whalex.core.parts.PartLoss: the loss contract over chunks

    @property
    def rows(self) -> tuple[int, ...]:
        return tuple(c * self.unit for c in self.counts)

    @property
    def block(self) -> int:
        return max(self.counts) * self.unit

    def row_ranges(self) -> tuple[tuple[int, int], ...]:
        """The global batch rows [start, stop) each device trains on."""
        starts = np.concatenate([[0], np.cumsum(self.rows)])
        return tuple((int(a), int(b)) for a, b in zip(starts[:-1], starts[1:]))

    # -- shardings ------------------------------------------------------------------------------
    @functools.cached_property
    def param_shardings(self):
        return jax.tree.map(lambda _: NamedSharding(self.mesh, P()), self.param_shapes())

    @functools.cached_property
    def batch_shardings(self):
        return jax.tree.map(lambda _: NamedSharding(self.mesh, P(DATA)), self.batch_shapes())

    def param_shapes(self):
        invars = self.captured.jaxpr.jaxpr.invars[: self.captured.num_params]
        return jax.tree.unflatten(self.captured.params_tree,
                                  [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars])

    def batch_shapes(self):
        """Shapes of the padded batch the step takes."""
        invars = self.captured.batch_vars
        k = len(self.counts)
        return jax.tree.unflatten(self.captured.batch_tree, [
            jax.ShapeDtypeStruct((k * self.block,) + tuple(v.aval.shape[1:]), v.aval.dtype) for v in invars])

    @property
    def has_aux(self) -> bool:
        return self.captured.has_aux

    def param_spec_list(self):
        return [P()] * self.captured.num_params

    # -- the batch ------------------------------------------------------------------------------
    def pad_batch(self, batch):
        """Host-side: the global batch laid out in per-device padded blocks (numpy)."""
        k, block = len(self.counts), self.block
        even = len(set(self.counts)) == 1     # the batch already is the per-device layout

        def pad(x):
            if np.shape(x)[0] != self.global_batch:
                raise PlanError(f"this step was planned for a global batch of {self.global_batch}, got "
                                f"{np.shape(x)[0]}; call step.init with the new batch to re-plan.")
            if even:
                return x
            x = np.asarray(x)
            out = np.zeros((k * block,) + x.shape[1:], x.dtype)
            for i, (a, b) in enumerate(self.row_ranges()):
                out[i * block:i * block + (b - a)] = x[a:b]
            return out

        return jax.tree.map(pad, batch)

    def place_batch(self, batch):
        return place_global(self.pad_batch(batch), self.batch_shardings)   # multi-process: each reads its own rows

    # -- the step -------------------------------------------------------------------------------
    def loss_and_grads(self):
        cap = self.captured
        pl = self.parts
        unit = self.unit
        has_aux = cap.has_aux
        prec = self.precision
        scaled = prec is not None and prec.scaled
        level = self.memory_options.zero_level
        even_counts = self.counts[0] if len(set(self.counts)) == 1 else None
        specs, zspecs = self.param_spec_list(), self.zero_specs()
        ptree = self.captured.params_tree
        counts = jnp.asarray(self.counts, jnp.int32)
        starts = jnp.asarray([a for a, _ in self.row_ranges()], jnp.int32)
        mesh, remat = self.mesh, self.remat

        def evaluator_for(c, overrides):
            return program_evaluator(c, {}, mesh, overrides, remat)[0]

        def across(values, kinds):
            return parts_lib.across_devices(values, kinds, DATA)

        def body(params, batch, extra, *scale):
            scale = scale[0] if scale else None
            if level >= 3:            # ZeRO 3: all-gather the shards once per step, before the loop
                params = jax.tree.unflatten(ptree, zero_lib.gather(jax.tree.leaves(params), specs, zspecs, DATA))
            leaves = jax.tree.leaves(batch)
            d = jax.lax.axis_index(DATA)
            n = counts[d]

            def chunk_of(k):          # chunk k of this device's block, and the global rows it holds
                return ([jax.lax.dynamic_slice_in_dim(x, k * unit, unit, 0) for x in leaves],
                        ((starts[d] + k * unit, unit),))

            def loop(fn, init):       # the device's own chunks; no collective inside (trip counts differ)
                def chunk(k, acc):
                    return fn(*chunk_of(k), acc)
                if even_counts == 1:  # one chunk on every device: no loop, no accumulator
                    return chunk(0, init)
                return jax.lax.fori_loop(0, even_counts or n, chunk, init)

            def map_parts(g, kinds):  # the pre-pass: every chunk slot of the block at once (no loop)
                slots = max(self.counts)

                stacked = jax.vmap(lambda k: g(*chunk_of(k)))(jnp.arange(slots))
                real = jnp.arange(slots) < n          # padding slots take the identity of the reduction
                return [jnp.where(real.reshape((-1,) + (1,) * (x.ndim - 1)), x,
                                  parts_lib.identity(k, jax.ShapeDtypeStruct(x.shape[1:], x.dtype))[None])
                        for x, k in zip(stacked, kinds)]

            outs, grads = parts_lib.value_and_grad(pl, evaluator_for, loop, across, jax.tree.leaves(params),
                                                   list(extra), scale, map_parts)
            grads = jax.tree.unflatten(ptree, grads)
            if level >= 2:            # ZeRO 2: reduce-scatter to each device's shard
                grads = precision_lib.reduce_in(prec, lambda g: jax.tree.unflatten(
                    ptree, zero_lib.scatter_sum(jax.tree.leaves(g), specs, zspecs, DATA)), grads)
            else:
                grads = precision_lib.reduce_in(prec, lambda g: jax.lax.psum(g, DATA), grads)
            return outs[0], grads, list(outs[1:])

        tree = lambda ss: jax.tree.unflatten(ptree, list(ss))  # noqa: E731
        smap = jax.shard_map(body, mesh=self.mesh, in_specs=(tree(zspecs) if level >= 3 else P(), P(DATA), P())
                             + ((P(),) if scaled else ()),
                             out_specs=(P(), tree(zspecs) if level >= 2 else P(), P()), check_vma=False)

        def run(params, batch, extra=(), scale=None):
            value, grads, rest = smap(params, batch, list(extra), *((scale,) if scaled else ()))
            if scaled:
                grads = precision_lib.unscale(grads, scale)
            _, aux, new_state = cap.split_outputs([value, *rest])
            return (value, aux, new_state), grads

        return run


    def value_and_grad(self):
        return self.loss_and_grads()
