"""Uneven data parallelism in one SPMD program (Whale section 3.3.1, intra-TaskGraph balance).

Device i trains on its own number of samples, `rows[i]`, chosen by Algorithm 1 (in
`whalex.planner.uneven`) at a fine grain, so the split follows the device speeds closely at any
batch size. The global batch is laid out padded: device i's block of `max(rows)` rows holds its
real rows first and padding after. Inside `shard_map`, each device runs a `fori_loop` over its own
number of full `chunk`-row chunks, then its remainder as one chunk of its own size (where the devices'
remainders are few distinct sizes; else one chunk of each binary digit of it, `chunk/2, ..., grain`),
each remainder size under a `lax.cond`: the work stays proportional to the rows and padding is never
read. The trip counts and conditions differ between devices, so no collective runs inside them;
sample-weighted loss and gradients are accumulated and one `psum` after them gives exactly the
global-batch values (`whalex.loss.evaluation`).
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

from whalex.distributed import place_global
from whalex.errors import PlanError
from whalex.jaxpr.capture import Captured
from whalex.loss import evaluation as parts_lib
from whalex.loss.evaluation import PartLoss
from whalex.lowering.emit import Emitter
from whalex.lowering.fused_collectives import fused_psum
from whalex.memory import zero as zero_lib
from whalex.memory.remat import program_evaluator
from whalex.precision.comm import reduce_in
from whalex.precision.loss_scale import unscale
from whalex.records.memory_options import MemoryOptions, Precision, RematPlan
from whalex.records.program import step_program

DATA = "data"


@step_program
@dataclasses.dataclass(frozen=True)
class UnevenProgram(Emitter):
    captured: Captured           # traced at `chunk` rows
    mesh: Any                    # 1-D mesh over every device, axis "data"
    optimizer: optax.GradientTransformation | None
    platform: str
    rows: tuple[int, ...]        # samples per device
    chunk: int                   # rows of a full chunk
    global_batch: int
    memory: MemoryOptions | None = None     # ZeRO level, offload
    precision: Precision | None = None      # amp, comm_dtype
    remat: RematPlan | None = None          # per-TaskGraph remat, activation offload
    parts: PartLoss | None = None           # the loss contract over the chunks
    grain: int | None = None     # the smallest remainder chunk (chunk / 2**j); None: full chunks only
    exact_remainders: bool = False   # each device's remainder as one chunk of its size (else its binary digits)

    def __post_init__(self):
        g = self.grain or self.chunk
        if self.chunk % g or (self.chunk // g) & (self.chunk // g - 1) or any(r % g for r in self.rows) \
                or sum(self.rows) != self.global_batch:
            raise ValueError(f"uneven rows {self.rows} (global batch {self.global_batch}) do not split into chunks "
                             f"of {self.chunk} and a binary remainder down to {g} rows")

    @property
    def sizes(self) -> tuple[int, ...]:
        """The remainder chunk sizes, largest first: the devices' own remainders (rows % chunk) with
        `exact_remainders`, else the binary digits chunk/2, chunk/4, ..., grain."""
        if self.exact_remainders:
            return tuple(sorted({r % self.chunk for r in self.rows} - {0}, reverse=True))
        g, out, s = self.grain or self.chunk, [], self.chunk // 2
        while s >= g:
            out.append(s)
            s //= 2
        return tuple(out)

    @property
    def full_chunks(self) -> tuple[int, ...]:
        return tuple(r // self.chunk for r in self.rows)

    @property
    def remainder_bits(self) -> tuple[tuple[bool, ...], ...]:
        """Per device: which remainder sizes it runs (its own remainder, or the binary digits of rows % chunk)."""
        if self.exact_remainders:
            return tuple(tuple(r % self.chunk == s for s in self.sizes) for r in self.rows)
        return tuple(tuple(bool((r % self.chunk) // s % 2) for s in self.sizes) for r in self.rows)

    def part_sizes(self, device: int) -> tuple[int, ...]:
        """The samples of each part device `device` evaluates, in order."""
        bits = self.remainder_bits[device]
        return (self.chunk,) * self.full_chunks[device] + tuple(s for s, b in zip(self.sizes, bits) if b)

    def part_ranges(self) -> tuple[tuple[int, int], ...]:
        """Every part of a step as (first global row, samples), device by device."""
        out = []
        for d, (start, _) in enumerate(self.row_ranges()):
            for n in self.part_sizes(d):
                out.append((start, n))
                start += n
        return tuple(out)

    @property
    def block(self) -> int:
        return max(self.rows)

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
        k = len(self.rows)
        return jax.tree.unflatten(self.captured.batch_tree, [
            jax.ShapeDtypeStruct((k * self.block,) + tuple(v.aval.shape[1:]), v.aval.dtype) for v in invars])

    @property
    def has_aux(self) -> bool:
        return self.captured.has_aux

    def param_spec_list(self):
        return [P()] * self.captured.num_params

    # -- the batch ------------------------------------------------------------------------------
    def _checked(self, x):
        if np.shape(x)[0] != self.global_batch:
            raise PlanError(f"this step was planned for a global batch of {self.global_batch}, got "
                            f"{np.shape(x)[0]}; call step.init with the new batch to re-plan.")
        return x

    def pad_batch(self, batch):
        """Host-side: the global batch laid out in per-device padded blocks (numpy)."""
        k, block = len(self.rows), self.block
        even = len(set(self.rows)) == 1       # the batch already is the per-device layout

        def pad(x):
            x = self._checked(x)
            return x if even else self._padded_rows(np.asarray(x), 0, k * block)

        return jax.tree.map(pad, batch)

    def place_batch(self, batch):
        return self.place_padded(batch, self.batch_shardings)

    def place_padded(self, batch, shardings):
        """The global batch on the devices in per-device padded blocks (`shardings`): each device's block
        built from its own rows alone, on the process that holds it, so no process lays out (or, slowed,
        waits on) the whole padded batch."""
        if len(set(self.rows)) == 1:
            return place_global(jax.tree.map(self._checked, batch), shardings)
        padded = len(self.rows) * self.block

        def put(x, sharding):
            x = np.asarray(self._checked(x))

            def fill(index):                        # `index`: this device's slices of the padded batch
                lo, hi, _ = index[0].indices(padded)
                return self._padded_rows(x, lo, hi)[(slice(None), *index[1:])]
            return jax.make_array_from_callback((padded, *x.shape[1:]), sharding, fill)

        return jax.tree.map(put, batch, shardings)

    def _padded_rows(self, x: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Rows [lo, hi) of host leaf `x` laid out in the per-device padded blocks: each device's rows,
        then zeros (padding is never read). A whole block that is all its device's rows is those rows."""
        ranges, block = self.row_ranges(), self.block
        i = lo // block
        if (lo, hi) == (i * block, (i + 1) * block) and ranges[i][1] - ranges[i][0] == block:
            return x[ranges[i][0]:ranges[i][1]]
        out = np.empty((hi - lo,) + x.shape[1:], x.dtype)
        for i, (a, b) in enumerate(ranges):
            s, e = max(lo, i * block), min(hi, i * block + b - a)             # its rows
            if s < e:
                out[s - lo:e - lo] = x[a + s - i * block:a + e - i * block]
            s, e = max(lo, i * block + b - a), min(hi, (i + 1) * block)       # its padding
            if s < e:
                out[s - lo:e - lo] = 0
        return out

    # -- the step -------------------------------------------------------------------------------
    def parts_driver(self, leaves, axis=DATA):
        """Inside shard_map over `axis` (a mesh axis or a tuple of them: the device order of `rows`),
        for this device's block `leaves`: (loop, map_parts) as
        `whalex.loss.evaluation.value_and_grad` takes them. loop(fn, init) runs acc = fn(part, where, acc)
        over the device's parts (full chunks in a fori_loop, then the remainder chunks under lax.cond);
        map_parts(g, kinds) evaluates g on every part slot at once, identity where a slot is not real."""
        chunk, sizes = self.chunk, self.sizes
        used = [any(b[j] for b in self.remainder_bits) for j in range(len(sizes))]   # sizes some device runs
        full = self.full_chunks
        uniform = len(set(full)) == 1 and not any(used)
        d = jax.lax.axis_index(axis)
        n = jnp.asarray(full, jnp.int32)[d]
        bits = jnp.asarray(self.remainder_bits, jnp.bool_).reshape(len(self.rows), len(sizes))[d]
        start = jnp.asarray([a for a, _ in self.row_ranges()], jnp.int32)[d]

        def part_at(off, size):       # `size` rows of the block from `off`, and the global rows they hold
            return [jax.lax.dynamic_slice_in_dim(x, off, size, 0) for x in leaves], ((start + off, size),)

        def remainders():             # (size index, offset, taken) of each remainder chunk some device runs
            off = n * chunk
            for j, s in enumerate(sizes):
                if used[j]:
                    yield j, off, bits[j]
                off = off + jnp.where(bits[j], s, 0)

        def loop(fn, init):
            def step(k, acc):
                return fn(*part_at(k * chunk, chunk), acc)
            if uniform and full[0] == 1:          # one chunk on every device: no loop, no accumulator
                return step(0, init)
            acc = jax.lax.fori_loop(0, full[0] if uniform else n, step, init)
            for j, off, taken in remainders():
                acc = jax.lax.cond(taken, lambda a, off=off, s=sizes[j]: fn(*part_at(off, s), a), lambda a: a, acc)
            return acc

        def map_parts(g, kinds):
            slots = max(full)
            stacked = jax.vmap(lambda k: g(*part_at(k * chunk, chunk)))(jnp.arange(slots))
            ids = [parts_lib.identity(k, jax.ShapeDtypeStruct(x.shape[1:], x.dtype)) for k, x in zip(kinds, stacked)]
            real = jnp.arange(slots) < n          # padding slots take the identity of the reduction
            out = [[jnp.where(real.reshape((-1,) + (1,) * (x.ndim - 1)), x, e[None])] for x, e in zip(stacked, ids)]
            for j, off, taken in remainders():
                vals = jax.lax.cond(taken, lambda off=off, s=sizes[j]: list(g(*part_at(off, s))), lambda: ids)
                for o, v in zip(out, vals):
                    o.append(v[None])
            return [jnp.concatenate(o, axis=0) for o in out]

        return loop, map_parts

    def _part_evaluator(self, cap, overrides):
        """The captured loss of one chunk with the plan's remat, `overrides` added (no constraints: each
        device runs its chunks alone)."""
        return program_evaluator(cap, {}, self.mesh, overrides, self.remat)[0]

    def prepass(self):
        """The loss contract's pre-pass alone over each device's chunks (its batch-only reductions,
        e.g. a token count) with the psum after them, and a null program of the same inputs (no
        collective)."""
        if self.parts is None:
            return super().prepass()

        def body(params, batch):
            loop, map_parts = self.parts_driver(jax.tree.leaves(batch))   # the program's own loops
            given = parts_lib.prepass(self.parts, self._part_evaluator, loop, _across, jax.tree.leaves(params), [],
                                      map_parts=map_parts)
            return [v for vals in given.values() for v in vals]

        def null_body(params, batch):           # no collective: a replicated parameter's element
            return [jax.tree.leaves(params)[0].ravel()[0]]

        def wrap(f):
            return jax.jit(jax.shard_map(f, mesh=self.mesh, in_specs=(P(), P(DATA)), out_specs=P(), check_vma=False))

        return wrap(body), wrap(null_body)

    def loss_and_grads(self):
        cap = self.captured
        pl = self.parts
        prec = self.precision
        scaled = prec is not None and prec.scaled
        level = self.memory_options.zero_level
        specs, zspecs = self.param_spec_list(), self.zero_specs()
        ptree = self.captured.params_tree
        evaluator_for, across = self._part_evaluator, _across

        def body(params, batch, extra, *scale):
            scale = scale[0] if scale else None
            if level >= 3:            # ZeRO 3: all-gather the shards once per step, before the loop
                params = jax.tree.unflatten(ptree, zero_lib.gather(jax.tree.leaves(params), specs, zspecs, DATA))
            loop, map_parts = self.parts_driver(jax.tree.leaves(batch))
            outs, grads = parts_lib.value_and_grad(pl, evaluator_for, loop, across, jax.tree.leaves(params),
                                                   list(extra), scale, map_parts)
            grads = jax.tree.unflatten(ptree, grads)
            if level >= 2:            # ZeRO 2: reduce-scatter to each device's shard
                grads = reduce_in(prec, lambda g: jax.tree.unflatten(
                    ptree, zero_lib.scatter_sum(jax.tree.leaves(g), specs, zspecs, DATA)), grads)
            else:
                grads = reduce_in(prec, lambda g: fused_psum(g, DATA), grads)
            return outs[0], grads, list(outs[1:])

        tree = lambda ss: jax.tree.unflatten(ptree, list(ss))  # noqa: E731
        smap = jax.shard_map(body, mesh=self.mesh, in_specs=(tree(zspecs) if level >= 3 else P(), P(DATA), P())
                             + ((P(),) if scaled else ()),
                             out_specs=(P(), tree(zspecs) if level >= 2 else P(), P()), check_vma=False)

        def run(params, batch, extra=(), scale=None):
            value, grads, rest = smap(params, batch, list(extra), *((scale,) if scaled else ()))
            if scaled:
                grads = unscale(grads, scale)
            _, aux, new_state = cap.split_outputs([value, *rest])
            return (value, aux, new_state), grads

        return run


    def value_and_grad(self):
        return self.loss_and_grads()


def _across(values, kinds):
    """The parts' values combined over the devices after their loops (one psum)."""
    return parts_lib.across_devices(values, kinds, DATA)
