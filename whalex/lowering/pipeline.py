"""Pipeline parallelism in one SPMD program (Whale sections 3.1.2 and 4).

Stages are TaskGraphs in order. The captured loss (traced at micro-batch size) is cut into stage
functions. The parameters and the optimizer state are stored in the caller's pytree, each leaf
spread over every device of the mesh, and the optax update runs there under GSPMD: exact for any
GradientTransformation (factored, masked, multi_transform, global norms). Each step `pack_params`
gathers each stage's leaves into one row of a flat `[stages, width]` buffer sharded over the
mesh's `stage` axis, so while computing a device holds only its stage's weights; the gradient in
the caller's layout is the transpose of that gather, which sums the rows of every stage that reads
a leaf (tied parameters: one copy, the gradients of all its readers summed, like Megatron's
embedding group). `gather_rows` / `scatter_grads` do both with explicit collectives
(whalex/lowering/stage_rows.py). Each stage device receives only the batch leaves its stage reads
(`whalex.lowering.stage_batch`). Inside `shard_map`, a `lax.scan` over the schedule's ticks runs, on
every device, `lax.switch` to its stage's forward or backward (recomputing the forward from the
stashed stage input), then `ppermute`s activations to the next stage and gradients to the previous
one (with 2 stages one swap carries both: stage 0 only sends forward, stage 1 only backward). Only the stage inputs are stashed, in `schedule.slots` buffers: S for 1F1B, M for GPipe. Values
that skip a stage are forwarded through it. Gradients are summed over micro-batches in the loop and
over data-parallel replicas (`psum` over `data`) after it; no collective runs inside a branch.

The last stage returns the loss contract's part outputs for each micro-batch
(`whalex.core.part_loss`): sums, maxima and minima over the batch are combined over micro-batches
and replicas by their kind, and per-example aux outputs are written at their micro-batch's rows and
gathered over replicas in global batch order, so `metrics["aux"]` is the single-device aux.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from whalex import _compat as C
from whalex.core import part_loss as parts_lib
from whalex.core.capture import Captured
from whalex.core.collectives import fused_all_gather, fused_psum
from whalex.core.shardings import opt_state_specs
from whalex.core.interpret import apply_eqn, make_evaluator
from whalex.errors import PlanError
from whalex.lowering import stage_rows
from whalex.lowering.emit import Emitter
from whalex.lowering import stage_batch
from whalex.lowering.schedules import Schedule
from whalex.memory import precision as precision_lib, zero as zero_lib

STAGE, DATA, MODEL = "stage", "data", "model"


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one value sits in a flat buffer."""

    var: Any
    offset: int
    shape: tuple
    dtype: Any

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class StageCut:
    """The captured loss cut into stages: equations, parameters, and what crosses each boundary."""

    eqns: tuple[tuple[int, ...], ...]          # top-level equation indices per stage
    params: tuple[tuple[int, ...], ...]        # parameter leaves per stage (a tied leaf in each stage reading it)
    boundaries: tuple[tuple[Any, ...], ...]    # vars sent from stage k to k+1, k < S-1

    @property
    def num_stages(self) -> int:
        return len(self.eqns)


def cut_stages(cap: Captured, stage_of_eqn: Sequence[int], num_stages: int) -> StageCut:
    """Group top-level equations into stages and find the values each boundary must carry. A
    parameter read by several stages (tied weights) is listed in each of them."""
    jaxpr = cap.jaxpr.jaxpr
    n = cap.num_params
    eqns = [[] for _ in range(num_stages)]
    for i, s in enumerate(stage_of_eqn):
        eqns[s].append(i)
    produced_at: dict = {}
    for s in range(num_stages):
        for i in eqns[s]:
            for v in jaxpr.eqns[i].outvars:
                produced_at[v] = s
    last_use: dict = {}
    params: list[set] = [set() for _ in range(num_stages)]
    param_vars = {v: k for k, v in enumerate(jaxpr.invars[:n])}
    for s in range(num_stages):
        for i in eqns[s]:
            for v in jaxpr.eqns[i].invars:
                if isinstance(v, C.Literal):
                    continue
                if v in param_vars:
                    params[s].add(param_vars[v])
                if v in produced_at:
                    last_use[v] = max(last_use.get(v, -1), s)
    for v in jaxpr.outvars:
        if not isinstance(v, C.Literal) and v in produced_at:
            last_use[v] = num_stages
    owners = {p for ps in params for p in ps}
    unused = set(range(n)) - owners
    params[0] |= unused                       # unused parameters live on stage 0 with zero gradients
    boundaries = []
    for k in range(num_stages - 1):
        live = [v for v, s in produced_at.items() if s <= k and last_use.get(v, -1) > k]
        boundaries.append(tuple(sorted(live, key=lambda v: (produced_at[v], str(v)))))
    return StageCut(tuple(tuple(e) for e in eqns), tuple(tuple(sorted(p)) for p in params), tuple(boundaries))


def _layout(vars_: Sequence[Any]) -> tuple[list[Slot], int]:
    slots, off = [], 0
    for v in vars_:
        slot = Slot(v, off, tuple(v.aval.shape), v.aval.dtype)
        slots.append(slot)
        off += slot.size
    return slots, off


def _to_f32(x):
    if x.dtype == jnp.float32:
        return x
    if jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(jnp.float32)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.float32)
    return jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.float32)


def _from_f32(x, dtype):
    if dtype == jnp.float32:
        return x
    if jnp.issubdtype(dtype, jnp.floating):
        return x.astype(dtype)
    if dtype == jnp.bool_:
        return x > 0.5
    return jax.lax.bitcast_convert_type(x, jnp.int32).astype(dtype)


def _pack(values, slots, width):
    parts = [_to_f32(jnp.asarray(v)).reshape(-1) for v in values]
    flat = jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.float32)
    return stage_rows.pad_to(flat, width)


def _bounds(widths: Sequence[int], total: int) -> tuple[int, ...]:
    """Segment boundaries of a row of `total` entries cut at every stage's own width `widths`."""
    return tuple(sorted({0, total, *(w for w in widths if 0 < w < total)}))


def _add_segments(segs, x, bounds, axis: int):
    """The row held as segments (`bounds`) plus `x` on its leading `x.shape[axis]` entries, which end
    on a boundary: each segment is added whole or passed through, so XLA updates it in place and a
    narrow stage's backward touches only its own width (a prefix update of one wide row was a copy of
    the whole row per backward tick inside the tick's conditional)."""
    n = x.shape[axis]
    assert n in bounds, (n, bounds)
    return tuple(seg + jax.lax.slice_in_dim(x, a, b, axis=axis) if b <= n else seg
                 for seg, a, b in zip(segs, bounds[:-1], bounds[1:]))


def _tree_switch(index, branches, *operands):
    """`lax.switch(index, branches, *operands)` as a balanced tree of two-way `lax.cond`s. XLA CPU's
    many-way conditional copied a large operand threaded through its branches (the gradient
    accumulator) on every call, ~20 ms per tick for 10 MB; through two-way conds, with the accumulator
    in segments each added whole or passed through (`_add_segments`), it is updated in place."""
    if len(branches) == 1:
        return branches[0](*operands)
    mid = len(branches) // 2
    return jax.lax.cond(index < mid,
                        lambda *ops: _tree_switch(index, branches[:mid], *ops),
                        lambda *ops: _tree_switch(index - mid, branches[mid:], *ops), *operands)


def _pack_values(values, width):
    """Outputs summed over micro-batches: every value as float32 by value (integers count)."""
    parts = [jnp.asarray(v).astype(jnp.float32).reshape(-1) for v in values]
    flat = jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.float32)
    return stage_rows.pad_to(flat, width)


def _unpack_values(flat, slots):
    return [flat[s.offset:s.offset + s.size].reshape(s.shape).astype(s.dtype) for s in slots]


def _unpack(flat, slots):
    return [_from_f32(flat[s.offset:s.offset + s.size].reshape(s.shape), s.dtype) for s in slots]


@dataclasses.dataclass(frozen=True)
class PipelineProgram(Emitter):
    """The pipelined training step: packed stage parameters, schedule tables and the mesh."""

    captured: Captured           # traced at micro-batch size
    cut: StageCut
    schedule: Schedule
    mesh: Any
    optimizer: optax.GradientTransformation | None
    platform: str
    global_batch: int
    data_parallel: int
    memory: Any = None           # whalex.memory.MemoryOptions (ZeRO level, offload)
    precision: Any = None        # whalex.memory.precision.Precision (amp, comm_dtype)
    remat: Any = None            # always None: stages recompute their forward from the stashed input
    parts: Any = None            # whalex.core.parts.PartLoss: the loss contract over micro-batches
    model_parallel: int = 1      # split TaskGraphs inside the stages: devices of the `model` mesh axis
    model_dims: tuple = ()       # per parameter leaf: its dimension split over `model` (None: whole)
    constraints: Any = None      # the split layers' sharding constraints ((path, "in"|"out", pos) -> spec)

    # -- packing of parameters ------------------------------------------------------------------
    @functools.cached_property
    def param_dtype(self):
        dtypes = {np.dtype(v.aval.dtype) for v in self.captured.jaxpr.jaxpr.invars[: self.captured.num_params]}
        if len(dtypes) != 1 or not np.issubdtype(next(iter(dtypes)), np.floating):
            raise PlanError(f"pipelined parameters must share one floating dtype, found {sorted(map(str, dtypes))}; "
                            "cast the parameters to one dtype.")
        return dtypes.pop()

    def model_dim(self, leaf: int):
        """The dimension of parameter `leaf` split over `model` inside its stage (None: whole)."""
        return self.model_dims[leaf] if self.model_dims else None

    @functools.cached_property
    def param_slots(self) -> tuple[tuple[Slot, ...], ...]:
        """Per stage: the whole (not model-split) leaves in the stage's flat row."""
        invars = self.captured.jaxpr.jaxpr.invars
        return tuple(tuple(_layout([invars[p] for p in ps if self.model_dim(p) is None])[0]) for ps in self.cut.params)

    @functools.cached_property
    def model_slots(self) -> tuple[tuple[tuple[Slot, int], ...], ...]:
        """Per stage: (slot of the block, split dimension) of each model-split leaf in the stage's
        `[model, width]` row; row m holds block m of every such leaf (its 1/model on the split dim)."""
        invars, M = self.captured.jaxpr.jaxpr.invars, self.model_parallel
        out = []
        for ps in self.cut.params:
            off, entries = 0, []
            for p in ps:
                d = self.model_dim(p)
                if d is None:
                    continue
                shape = tuple(n // M if k == d else n for k, n in enumerate(invars[p].aval.shape))
                slot = Slot(invars[p], off, shape, invars[p].aval.dtype)
                entries.append((slot, d))
                off += slot.size
            out.append(tuple(entries))
        return tuple(out)

    @functools.cached_property
    def model_width(self) -> int:
        return max([sum(sl.size for sl, _ in e) for e in self.model_slots] + [1])

    @property
    def three_d(self) -> bool:
        """Split TaskGraphs inside the stages: a ('data', 'stage', 'model') mesh."""
        return self.model_parallel > 1

    def unpack_stage(self, s: int, rows):
        """Stage s's parameter leaves (in `cut.params[s]` order) from its rows: the flat row `[width]`
        and, in 3D, the `[model, width]` row whose model-split leaves are reassembled on their split
        dimension (row m is block m, so GSPMD keeps each block on its model device)."""
        flat = {sl.var: rows[0][sl.offset:sl.offset + sl.size].reshape(sl.shape) for sl in self.param_slots[s]}
        M = self.model_parallel
        for sl, d in (self.model_slots[s] if self.three_d else ()):
            x = rows[1][:, sl.offset:sl.offset + sl.size].reshape((M,) + sl.shape)
            full = sl.shape[:d] + (M * sl.shape[d],) + sl.shape[d + 1:]
            x = jnp.moveaxis(x, 0, d).reshape(full)
            flat[sl.var] = jax.lax.with_sharding_constraint(x, P(*([None] * d + [MODEL])))
        invars = self.captured.jaxpr.jaxpr.invars
        return [flat[invars[p]] for p in self.cut.params[s]]

    def _stage_grad_rows(self, s: int, grads):
        """Stage s's leaf gradients laid out as its rows, unpadded: the flat row `[w_s]` and, in 3D, the
        `[model, m_s]` row of the model-split leaves (None without)."""
        dtype = self.param_dtype
        invars = self.captured.jaxpr.jaxpr.invars
        by_var = {invars[p]: g for p, g in zip(self.cut.params[s], grads)}
        flat = [by_var[sl.var].reshape(-1).astype(dtype) for sl in self.param_slots[s]]
        row = jnp.concatenate(flat) if flat else jnp.zeros((0,), dtype)
        if not self.three_d:
            return row, None
        M, parts = self.model_parallel, []
        for sl, d in self.model_slots[s]:
            g = by_var[sl.var].astype(dtype).reshape(sl.shape[:d] + (M, sl.shape[d]) + sl.shape[d + 1:])
            parts.append(jnp.moveaxis(g, d, 0).reshape(M, -1))
        return row, (jnp.concatenate(parts, axis=1) if parts else jnp.zeros((M, 0), dtype))

    def pack_stage_grads(self, s: int, grads):
        """The transpose of `unpack_stage`: stage s's leaf gradients into its rows."""
        row, m = self._stage_grad_rows(s, grads)
        out = (stage_rows.pad_to(row, self.param_width),)
        if m is not None:
            out += (jnp.pad(m, ((0, 0), (0, self.model_width - m.shape[1]))),)
        return out

    @functools.cached_property
    def grad_bounds(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Segment boundaries of the gradient accumulator's rows (flat, model): every stage's width."""
        flat = _bounds([sum(sl.size for sl in slots) for slots in self.param_slots], self.param_width)
        model = _bounds([sum(sl.size for sl, _ in e) for e in self.model_slots], self.model_width)
        return flat, model

    def add_stage_grads(self, s: int, acc, grads):
        """`acc` (the segments of `zero_rows`) plus stage s's leaf gradients, added into the segments the
        stage fills: a narrow stage touches only its own width, not the widest stage's."""
        row, m = self._stage_grad_rows(s, grads)
        flat, model = self.grad_bounds
        out = (_add_segments(acc[0], row, flat, 0),)
        if m is not None:
            out += (_add_segments(acc[1], m, model, 1),)
        return out

    def zero_rows(self):
        """The gradient accumulator: each row as segments (`grad_bounds`)."""
        def zeros(bounds, lead=()):
            return tuple(jnp.zeros(lead + (b - a,), self.param_dtype) for a, b in zip(bounds[:-1], bounds[1:]))
        flat, model = self.grad_bounds
        return (zeros(flat),) + ((zeros(model, (self.model_parallel,)),) if self.three_d else ())

    @functools.cached_property
    def param_width(self) -> int:
        width = max([sum(s.size for s in slots) for slots in self.param_slots] + [1])
        if self.memory_options.zero_level and self.data_parallel > 1:   # ZeRO splits the row over replicas
            width = -(-width // self.data_parallel) * self.data_parallel
        return width

    @functools.cached_property
    def message_width(self) -> int:
        return max([_layout(b)[1] for b in self.cut.boundaries] + [1])

    def pack_params(self, params):
        """The caller's parameters in the `[stages, width]` rows the stage functions read (a tied leaf
        copied into every row that reads it), in plain jnp: what `gather_rows` computes with explicit
        collectives inside the step, and its definition (tests compare them)."""
        leaves = jax.tree.leaves(params)
        rows = []
        for ps in self.cut.params:
            flat = [jnp.asarray(leaves[p], self.param_dtype).reshape(-1) for p in ps]
            row = jnp.concatenate(flat) if flat else jnp.zeros((0,), self.param_dtype)
            rows.append(stage_rows.pad_to(row, self.param_width))
        return {"stages": jnp.stack(rows)}

    def pack_rows(self, params):
        """3D: the caller's parameters as {"stages": [stages, width] whole leaves, "model": [stages,
        model, width] model-split leaves}, in plain jnp; under GSPMD its vjp is the gradient's way
        back (a tied leaf's rows summed)."""
        leaves = jax.tree.leaves(params)
        per_stage = [self.pack_stage_grads(s, [jnp.asarray(leaves[p]) for p in ps]) for s, ps in enumerate(self.cut.params)]
        rows = {"stages": jnp.stack([r[0] for r in per_stage]), "model": jnp.stack([r[1] for r in per_stage])}
        return {"stages": jax.lax.with_sharding_constraint(rows["stages"], NamedSharding(self.mesh, P(STAGE))),
                "model": jax.lax.with_sharding_constraint(rows["model"], NamedSharding(self.mesh, P(STAGE, MODEL)))}

    # -- shardings ----------------------------------------------------------------------------
    def param_shapes(self):
        """The stored parameters: the caller's pytree."""
        invars = self.captured.jaxpr.jaxpr.invars[: self.captured.num_params]
        return jax.tree.unflatten(self.captured.params_tree,
                                  [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars])

    def param_spec_list(self):
        """Each stored leaf spread over every device (its largest dimension the mesh size divides); in
        3D a model-split leaf is stored as its model blocks, each spread over (stage, data)."""
        shapes = jax.tree.leaves(self.param_shapes())
        return [self._split_storage(p)[1] if self.model_dim(p) is not None
                else stage_rows.spread(x.shape, self.mesh.size, self.spread_axes) for p, x in enumerate(shapes)]

    @property
    def spread_axes(self) -> tuple[str, ...]:
        return (STAGE, DATA, MODEL) if self.three_d else (STAGE, DATA)

    def _spread_dims(self):
        return [stage_rows.spread_dim(s.shape, self.mesh.size) for s in jax.tree.leaves(self.param_shapes())]

    def _split_group(self) -> tuple[list[int], list[int]]:
        """3D: (whole leaves, model-split leaves) as parameter indices."""
        n = self.captured.num_params
        return [p for p in range(n) if self.model_dim(p) is None], [p for p in range(n) if self.model_dim(p) is not None]

    def _model_local(self, p: int) -> tuple[int, ...]:
        """A model-split leaf's shape on one model device (its split dim / model)."""
        shape, d = self.captured.jaxpr.jaxpr.invars[p].aval.shape, self.model_dim(p)
        return tuple(x // self.model_parallel if k == d else x for k, x in enumerate(shape))

    def _split_storage(self, p: int) -> tuple[int | None, P]:
        """3D storage of a model-split leaf: its model block on its split dim (`model`), that block spread
        over (stage, data) on its largest dimension they divide (on the split dim too: `model` major)."""
        local, k = self._model_local(p), self.model_dim(p)
        d = stage_rows.spread_dim(local, self.mesh.size // self.model_parallel)
        spec = [None] * len(local)
        spec[k] = MODEL
        if d is not None:
            spec[d] = (MODEL, STAGE, DATA) if d == k else (STAGE, DATA)
        return d, P(*spec)

    def _group_gather(self, group, dims, slots, shapes, width, local):
        """`stage_rows.gather_row` over (stage, data) for the leaves `group` (parameter indices) of every
        stage, in `cut.params` order."""
        where = {p: i for i, p in enumerate(group)}
        cut = [[where[p] for p in ps if p in where] for ps in self.cut.params]
        return stage_rows.gather_row(local, dims, cut, slots, shapes, width, self.param_dtype, (STAGE, DATA))

    def _group_scatter(self, group, dims, slots, shapes, row):
        where = {p: i for i, p in enumerate(group)}
        cut = [[where[p] for p in ps if p in where] for ps in self.cut.params]
        return stage_rows.scatter_grads(row, dims, cut, slots, shapes, self.data_parallel, (STAGE, DATA))

    def _groups_3d(self):
        whole, split = self._split_group()
        invars = self.captured.jaxpr.jaxpr.invars
        wshapes = [invars[p].aval for p in whole]
        wdims = [stage_rows.spread_dim(a.shape, self.mesh.size) for a in wshapes]
        sshapes = [jax.ShapeDtypeStruct(self._model_local(p), invars[p].aval.dtype) for p in split]
        sdims = [self._split_storage(p)[0] for p in split]
        mslots = tuple(tuple(sl for sl, _ in e) for e in self.model_slots)
        return (whole, wdims, wshapes), (split, sdims, sshapes, mslots)

    def gather_rows_3d(self):
        """3D: the stored params -> {"stages": [stages, width] whole leaves, "model": [stages, model,
        width] model blocks}. A whole leaf: one fused all-gather over `model` (each device then holds
        its (stage, data) block, the 2D layout), then the pipeline's gather over (stage, data). A
        model-split leaf is stored as its model blocks, each spread over (stage, data): the same
        gather on the blocks, so a device never receives another model device's block."""
        (whole, wdims, wshapes), (split, sdims, sshapes, mslots) = self._groups_3d()
        n = self.captured.num_params

        def body(*leaves):
            wl = fused_all_gather([leaves[p] for p in whole], MODEL, wdims)
            flat = self._group_gather(whole, wdims, self.param_slots, wshapes, self.param_width, wl)
            mrow = self._group_gather(split, sdims, mslots, sshapes, self.model_width, [leaves[p] for p in split])
            return {"stages": flat, "model": mrow[:, None]}

        assert len(whole) + len(split) == n
        fn = jax.shard_map(body, mesh=self.mesh, in_specs=tuple(self.param_spec_list()),
                           out_specs={"stages": P(STAGE), "model": P(STAGE, MODEL)}, check_vma=False)
        return lambda params: fn(*jax.tree.leaves(params))

    def scatter_grads_3d(self):
        """3D: the transpose of `gather_rows_3d` (a tied leaf's gradients summed over its stages)."""
        (whole, wdims, wshapes), (split, sdims, sshapes, mslots) = self._groups_3d()
        M, tree, n = self.model_parallel, self.captured.params_tree, self.captured.num_params

        def body(rows):
            out = [None] * n
            m = jax.lax.axis_index(MODEL)
            wg = self._group_scatter(whole, wdims, self.param_slots, wshapes, rows["stages"])
            for p, g, d in zip(whole, wg, wdims):        # the (stage, data) block -> this device's model part
                out[p] = g if d is None else jax.lax.dynamic_slice_in_dim(g, m * (g.shape[d] // M), g.shape[d] // M, d)
            for p, g in zip(split, self._group_scatter(split, sdims, mslots, sshapes, rows["model"][:, 0])):
                out[p] = g
            return tuple(out)

        fn = jax.shard_map(body, mesh=self.mesh, in_specs=({"stages": P(STAGE), "model": P(STAGE, MODEL)},),
                           out_specs=tuple(self.param_spec_list()), check_vma=False)
        return lambda rows: jax.tree.unflatten(tree, list(fn(rows)))

    def gather_rows(self):
        """spread params (the caller's pytree) -> {"stages": [stages, width]} rows sharded over `stage`:
        `pack_params` with explicit all-gathers."""
        dims, cut, slots = self._spread_dims(), self.cut.params, self.param_slots
        W, dtype, shapes = self.param_width, self.param_dtype, jax.tree.leaves(self.param_shapes())

        def body(*leaves):
            return {"stages": stage_rows.gather_row(leaves, dims, cut, slots, shapes, W, dtype, (STAGE, DATA))}

        fn = jax.shard_map(body, mesh=self.mesh, in_specs=tuple(self.param_spec_list()),
                           out_specs={"stages": P(STAGE)}, check_vma=False)
        return lambda params: fn(*jax.tree.leaves(params))

    def scatter_grads(self):
        """{"stages": row gradients} (summed over the replicas) -> the caller-layout gradient, spread: the
        transpose of `gather_rows` (a tied leaf's rows summed)."""
        dims, cut, slots, dp = self._spread_dims(), self.cut.params, self.param_slots, self.data_parallel
        shapes = jax.tree.leaves(self.param_shapes())
        tree = self.captured.params_tree

        def body(rows):
            return tuple(stage_rows.scatter_grads(rows["stages"], dims, cut, slots, shapes, dp, (STAGE, DATA)))

        fn = jax.shard_map(body, mesh=self.mesh, in_specs=({"stages": P(STAGE)},),
                           out_specs=tuple(self.param_spec_list()), check_vma=False)
        return lambda rows: jax.tree.unflatten(tree, list(fn(rows)))

    @functools.cached_property
    def param_shardings(self):
        return self._param_named(self.param_spec_list())

    def opt_state_spec_tree(self, param_specs):
        """Parts shaped like the parameters follow `param_specs`; every other leaf (adafactor's factored
        statistics, masked or multi_transform inner states) is spread by its own shape too."""
        specs, shapes = opt_state_specs(self.optimizer, self.param_shapes(), param_specs)
        spread = lambda s, x: stage_rows.spread(x.shape, self.mesh.size, self.spread_axes) if s == P() else s  # noqa: E731
        return jax.tree.map(spread, specs, shapes, is_leaf=lambda x: isinstance(x, P))

    @functools.cached_property
    def row_specs(self) -> tuple[P, P]:
        """The packed rows' spec, and with ZeRO (levels 2 and 3) the same split over `data` too:
        the stage gradient is reduce-scattered over the replicas, the stage row gathered in the body."""
        opts = self.memory_options
        if opts.zero_level == 0 or opts.zero_axes is None:
            return P(STAGE), P(STAGE)
        shape = (self.cut.num_stages, self.param_width)
        return P(STAGE), zero_lib.shard_spec(P(STAGE), shape, (DATA,), dict(self.mesh.shape))

    @functools.cached_property
    def prepass_leaves(self) -> tuple[int, ...]:
        """Batch leaves the loss contract's pre-pass reads (its data-only reductions, e.g. a token count)."""
        jp = self.parts.part.jaxpr.jaxpr
        outs = [o for r in self.parts.sem.reductions if not r.params for o in jp.eqns[r.index].outvars]
        eqns = parts_lib.cone(jp, outs)
        n = self.captured.num_params
        batch = {v: k for k, v in enumerate(jp.invars[n:n + len(self.captured.batch_vars)])}
        return tuple(sorted({batch[v] for i in eqns for v in jp.eqns[i].invars
                             if not isinstance(v, C.Literal) and v in batch}))

    @functools.cached_property
    def batch_layout(self) -> stage_batch.StageBatchLayout:
        """The batch leaves each stage holds: those its equations read; the last stage also runs the
        pre-pass, so it holds the leaves the pre-pass reads."""
        cap = self.captured
        reads = stage_batch.stage_reads(cap.jaxpr.jaxpr, cap.num_params, len(cap.batch_vars), self.cut.eqns,
                                        self.prepass_leaves)
        return stage_batch.make_layout(reads, [v.aval for v in cap.batch_vars], self.global_batch)

    @functools.cached_property
    def batch_shardings(self):
        return self.batch_layout.shardings(self.mesh, STAGE, DATA)

    def batch_shapes(self):
        return self.batch_layout.shapes()

    @functools.cached_property
    def _batch_packer(self):
        return jax.jit(self.batch_layout.pack, out_shardings=self.batch_shardings.buffers)

    def place_batch(self, batch):
        """The caller's batch pytree in the stage layout (each stage device: only its leaves)."""
        return stage_batch.place(self.batch_layout, batch, self.batch_shardings, self.captured.batch_tree,
                                 self._batch_packer)

    # -- the stage functions -------------------------------------------------------------------
    def _stage_fn(self, s: int):
        """f_s(params_s leaves, live_in values, (batch leaves, extra leaves), overrides) -> live_out
        values (the last stage: the part outputs of the loss contract)."""
        jaxpr = self.captured.jaxpr.jaxpr
        consts = dict(zip(jaxpr.constvars, self.captured.jaxpr.consts))
        n = self.captured.num_params
        live_in = self.cut.boundaries[s - 1] if s > 0 else ()
        live_out = self.cut.boundaries[s] if s < self.cut.num_stages - 1 else tuple(jaxpr.outvars)
        param_vars = [jaxpr.invars[p] for p in self.cut.params[s]]
        input_vars = jaxpr.invars[n:]
        eqns = [(i, jaxpr.eqns[i]) for i in self.cut.eqns[s]]
        constraints = dict(self.constraints or {})
        cpaths = [c[0] for c in constraints]

        def fn(params_s, live, inputs, overrides):
            env = dict(consts)
            env.update(zip(param_vars, params_s))
            env.update((v, x) for v, x in zip(input_vars, inputs) if x is not None)
            env.update(zip(live_in, live))
            prefixes = {p[:k] for p in list(overrides) + cpaths for k in range(1, len(p) + 1)}
            for i, eqn in eqns:
                env.update(zip(eqn.outvars, apply_eqn(eqn, (i,), [C.read(env, v) for v in eqn.invars], overrides,
                                                      prefixes, constraints)))
            return [C.read(env, v) for v in live_out]

        return fn, live_in, live_out

    @functools.cached_property
    def output_kinds(self) -> tuple[str, ...]:
        """How each part output combines over micro-batches: "sum", "max", "min" or "rows"."""
        return tuple(k or "sum" for k in self.parts.part_outputs()[1])

    @functools.cached_property
    def row_outputs(self) -> tuple[int, ...]:
        """Part outputs (positions) with the batch dimension: per-example aux, gathered by rows."""
        return tuple(k for k, kind in enumerate(self.output_kinds) if kind == "rows")

    @functools.cached_property
    def value_outputs(self) -> tuple[int, ...]:
        """Part outputs (positions) without the batch dimension: combined in the flat accumulator."""
        return tuple(k for k, kind in enumerate(self.output_kinds) if kind != "rows")

    @functools.cached_property
    def output_slots(self) -> tuple[tuple[Slot, ...], int]:
        """Where the batch-free part outputs sit in the per-step accumulator."""
        outvars = self.captured.jaxpr.jaxpr.outvars
        slots, width = _layout([outvars[k] for k in self.value_outputs])
        return tuple(slots), max(width, 1)

    @functools.cached_property
    def output_masks(self) -> tuple[np.ndarray, np.ndarray]:
        """(is max, is min) per accumulator entry; the others are sums."""
        slots, width = self.output_slots
        is_max, is_min = np.zeros(width, bool), np.zeros(width, bool)
        for sl, k in zip(slots, self.value_outputs):
            is_max[sl.offset:sl.offset + sl.size] = self.output_kinds[k] == "max"
            is_min[sl.offset:sl.offset + sl.size] = self.output_kinds[k] == "min"
        return is_max, is_min

    def _output_init(self):
        is_max, is_min = self.output_masks
        big = float(np.finfo(np.float32).max)
        return jnp.asarray(np.where(is_max, -big, np.where(is_min, big, 0.0)).astype(np.float32))

    def _output_combine(self, acc, outs):
        """A micro-batch's outputs `outs` combined into `acc` entry by entry (sum, max or min)."""
        is_max, is_min = self.output_masks
        if not (is_max.any() or is_min.any()):
            return acc + outs
        return jnp.where(is_max, jnp.maximum(acc, outs), jnp.where(is_min, jnp.minimum(acc, outs), acc + outs))

    def _output_across(self, acc, axes):
        """The accumulator combined over the devices of `axes` (sums, maxima, minima)."""
        is_max, is_min = self.output_masks
        out = jax.lax.psum(jnp.where(is_max | is_min, 0.0, acc), axes)
        if is_max.any():
            out = jnp.where(is_max, jax.lax.pmax(acc, axes), out)
        if is_min.any():
            out = jnp.where(is_min, jax.lax.pmin(acc, axes), out)
        return out

    def _branches(self, overrides, cot):
        """Per stage, its forward and its backward. A forward (index 0: idle, 1 + s: stage s) maps
        (params, stage input, inputs) to (message out, part outputs, per-example outputs); a backward
        maps (gradient rows, params, stage input, output cotangent, inputs) to (message back, gradient
        rows plus this micro-batch's). The last stage's backward starts from the cotangent vector
        `cot` of the part outputs (dH/dR, times the loss scale)."""
        S = self.cut.num_stages
        A = self.message_width
        oslots, O = self.output_slots
        outvars = self.captured.jaxpr.jaxpr.outvars
        values, row_pos = self.value_outputs, self.row_outputs
        layout = self.batch_layout

        def no_rows():
            return [jnp.zeros(outvars[k].aval.shape, outvars[k].aval.dtype) for k in row_pos]

        def idle(params, x, inputs):
            return jnp.zeros(A, jnp.float32), jnp.zeros(O, jnp.float32), no_rows()

        fwds, bwds = [idle], []
        for s in range(S):
            fn, live_in, live_out = self._stage_fn(s)
            in_slots, _ = _layout(live_in)
            out_slots, _ = _layout(live_out)
            last = s == S - 1

            def unpack_params(params, s=s):
                return self.unpack_stage(s, params)

            def stage_inputs(inputs, s=s):        # this stage's batch leaves (None: not held) + extra
                return layout.unpack(inputs[0], s) + list(inputs[1])

            def fwd(params, x, inputs, fn=fn, in_slots=in_slots, out_slots=out_slots, last=last,
                    unpack_params=unpack_params, stage_inputs=stage_inputs):
                outs = fn(unpack_params(params), _unpack(x, in_slots), stage_inputs(inputs), overrides(inputs[2]))
                if last:
                    return jnp.zeros(A, jnp.float32), _pack_values([outs[k] for k in values], O), \
                        [outs[k] for k in row_pos]
                return _pack(outs, out_slots, A), jnp.zeros(O, jnp.float32), no_rows()

            def bwd(gacc, params, x, ct, inputs, fn=fn, in_slots=in_slots, out_slots=out_slots, last=last,
                    unpack_params=unpack_params, stage_inputs=stage_inputs, s=s):
                live = _unpack(x, in_slots)
                diff = [k for k, sl in enumerate(in_slots) if jnp.issubdtype(sl.dtype, jnp.floating)]
                ovr = overrides(inputs[2])
                ins = stage_inputs(inputs)

                def f(p, dl):
                    full = list(live)
                    for k, v in zip(diff, dl):
                        full[k] = v
                    outs = fn(p, full, ins, ovr)
                    return [outs[k] for k in values] if last else outs

                outs, vjp = jax.vjp(f, unpack_params(params), [live[k] for k in diff])
                cts = _unpack(cot, oslots) if last else _unpack(ct, out_slots)
                cts = [c.astype(o.dtype) if jnp.issubdtype(o.dtype, jnp.floating)
                       else np.zeros(o.shape, jax.dtypes.float0) for c, o in zip(cts, outs)]
                dp, dl = vjp(cts)
                full = [jnp.zeros(sl.shape, jnp.float32) for sl in in_slots]
                for k, g in zip(diff, dl):
                    full[k] = g
                return _pack(full, in_slots, A), self.add_stage_grads(s, gacc, dp)

            fwds.append(fwd)
            bwds.append(bwd)
        return fwds, bwds

    # -- the step ------------------------------------------------------------------------------
    def loss_and_grads(self):
        S, M = self.cut.num_stages, self.schedule.num_micro_batch
        dp = self.data_parallel
        A = self.message_width
        oslots, O = self.output_slots
        slots, gslots = self.schedule.slots, self.schedule.grad_slots
        tables = {k: jnp.asarray(v) for k, v in self.schedule.tables().items()}
        micro = self.global_batch // (dp * M)
        per_replica = self.global_batch // dp
        fwd_perm = [(i, i + 1) for i in range(S - 1)]
        bwd_perm = [(i + 1, i) for i in range(S - 1)]
        pl = self.parts
        n = self.captured.num_params
        param_avals = [v.aval for v in self.captured.jaxpr.jaxpr.invars[:n]]

        level = self.memory_options.zero_level
        three_d = self.three_d
        spec, zspec = self.row_specs
        specs, zspecs = [spec], [zspec]

        prec = self.precision
        scaled = prec is not None and prec.scaled

        layout = self.batch_layout
        home = S - 1                  # the stage that runs the loss contract's pre-pass
        batch_avals = [v.aval for v in self.captured.batch_vars]
        row_avals = [self.captured.jaxpr.jaxpr.outvars[k].aval for k in self.row_outputs]

        def from_home(values, s):     # the pre-pass values of the home stage, on every stage
            out = []
            for v in values:
                wide = v.astype(jnp.int32) if v.dtype == jnp.bool_ else v
                wide = jax.lax.psum(jnp.where(s == home, wide, jnp.zeros_like(wide)), STAGE) if S > 1 else wide
                out.append(wide.astype(v.dtype))
            return out

        def body(packed, batch, extra, *scale):
            scale = scale[0] if scale else None
            row = packed["stages"]
            if level >= 3:            # ZeRO 3: all-gather the stage row over the replicas
                row = zero_lib.gather([row], specs, zspecs, DATA)[0]
            params = (row[0],)
            if three_d:               # [model, width]: row m on model device m (an auto axis here)
                params += (jax.lax.with_sharding_constraint(packed["model"][0], P(MODEL)),)
            s = jax.lax.axis_index(STAGE)
            r = jax.lax.axis_index(DATA)
            rows = {g: x[0] for g, x in batch.items()}        # this device's stage row: [per_replica, width]
            extra = list(extra)

            def where_of(m):
                return ((r * per_replica + m * micro, micro),)

            def micro_rows(m):
                return {g: jax.lax.dynamic_slice_in_dim(x, m * micro, micro, 0) for g, x in rows.items()}

            def loop(fn, init):       # every micro-batch of this replica (the data-only pre-pass, home stage)
                def step(k, acc):
                    held = layout.unpack(micro_rows(k), home)
                    part = [x if x is not None else jnp.zeros((micro,) + a.shape[1:], a.dtype)
                            for x, a in zip(held, batch_avals)]
                    return fn(part, where_of(k), acc)
                return jax.lax.fori_loop(0, M, step, init)

            def across(values, kinds):
                return from_home(parts_lib.across_devices(values, kinds, DATA), s)

            zeros = [jnp.zeros(a.shape, a.dtype) for a in param_avals]     # the pre-pass reads no parameter
            given = parts_lib.prepass(pl, lambda c, ovr: make_evaluator(c.jaxpr, {}, None, ovr), loop, across,
                                      zeros, extra)
            idx, cots = parts_lib.cotangents(pl, given, extra, n, scale)
            full = [jnp.zeros(sl.shape, jnp.float32) for sl in oslots]
            values = self.value_outputs
            for k, c in zip(idx, cots):
                full[values.index(k)] = c.astype(jnp.float32)
            cot = _pack_values(full, O)

            def overrides(m):
                return parts_lib.part_overrides(pl, given, where_of(m))

            fwds, bwds = self._branches(overrides, cot)
            zero_a, zero_o = jnp.zeros(A, jnp.float32), jnp.zeros(O, jnp.float32)

            def tick(carry, row):
                stash, gstash, gacc, oacc, racc, fin, bin_ = carry
                kind, m = row["kind"][s], row["mb"][s]
                rf, rb = row["recv_f"][s], row["recv_b"][s]
                fslot, bslot = jnp.maximum(rf, 0) % slots, jnp.maximum(rb, 0) % gslots
                stash = stash.at[fslot].set(jnp.where(rf >= 0, fin, stash[fslot]))
                gstash = gstash.at[bslot].set(jnp.where(rb >= 0, bin_, gstash[bslot]))
                m = jnp.clip(m, 0, M - 1)
                inputs = (micro_rows(m), extra, m)

                def backward(gacc, x, ct):
                    dx, gacc = _tree_switch(s, bwds, gacc, params, x, ct, inputs)
                    return zero_a, dx, gacc, zero_o, [jnp.zeros(a.shape, a.dtype) for a in row_avals]

                def forward(gacc, x, ct):         # or idle
                    y, outs, routs = _tree_switch(jnp.where(kind == 1, 1 + s, 0), fwds, params, x, inputs)
                    return y, zero_a, gacc, outs, routs

                # a backward adds into the stage's own segments of `gacc`, which the other ticks pass through
                y, dx, gacc, outs, routs = jax.lax.cond(kind == 2, backward, forward, gacc, stash[m % slots],
                                                        gstash[m % gslots])
                done = (kind == 1) & (s == S - 1)          # the last stage's forward of micro-batch m
                oacc = jnp.where(done, self._output_combine(oacc, outs), oacc)
                racc = [jax.lax.dynamic_update_slice_in_dim(
                    a, jnp.where(done, o, jax.lax.dynamic_slice_in_dim(a, m * micro, micro, 0)), m * micro, 0)
                    for a, o in zip(racc, routs)]
                if S == 2:            # stage 0 only sends forward, stage 1 only backward: one swap
                    fout = bout = jax.lax.ppermute(jnp.where(s == 0, y, dx), STAGE, [(0, 1), (1, 0)])
                else:
                    fout = jax.lax.ppermute(y, STAGE, fwd_perm) if S > 1 else y
                    bout = jax.lax.ppermute(dx, STAGE, bwd_perm) if S > 1 else dx
                return (stash, gstash, gacc, oacc, racc, fout, bout), None

            init = (jnp.zeros((slots, A), jnp.float32), jnp.zeros((gslots, A), jnp.float32), self.zero_rows(),
                    self._output_init(), [jnp.zeros((per_replica,) + a.shape[1:], a.dtype) for a in row_avals],
                    jnp.zeros(A, jnp.float32), jnp.zeros(A, jnp.float32))
            (_, _, gacc, oacc, racc, _, _), _ = jax.lax.scan(tick, init, tables)
            gacc = [jnp.concatenate(segs, axis=-1) if len(segs) > 1 else segs[0] for segs in gacc]
            flat = _unpack_values(self._output_across(oacc, (STAGE, DATA)), oslots)
            gathered = [jax.lax.all_gather(from_last(x, s), DATA, tiled=True) for x in racc]
            outputs = [None] * len(self.output_kinds)
            for k, x in zip(values, flat):
                outputs[k] = x
            for k, x in zip(self.row_outputs, gathered):
                outputs[k] = x
            outs = parts_lib.finish(pl, given, extra, n, outputs)
            if level >= 2:            # ZeRO 2: reduce-scatter the stage gradient over the replicas
                grads = precision_lib.reduce_in(
                    prec, lambda g: zero_lib.scatter_sum([g[None]], specs, zspecs, DATA)[0], gacc[0])
            else:
                grads = precision_lib.reduce_in(prec, lambda g: fused_psum(g, DATA), gacc[0])[None]
            if not three_d:
                return outs, {"stages": grads}
            mgrads = precision_lib.reduce_in(prec, lambda g: fused_psum(g, DATA), gacc[1])[None]
            return outs, {"stages": grads, "model": mgrads}

        def from_last(x, s):          # per-example outputs: only the last stage wrote them
            if S == 1:
                return x
            wide = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
            return jax.lax.psum(jnp.where(s == S - 1, wide, jnp.zeros_like(wide)), STAGE).astype(x.dtype)

        rows_in = {"stages": zspecs[0] if level >= 3 else P(STAGE)}
        rows_out = {"stages": zspecs[0] if level >= 2 else P(STAGE)}
        manual = {}
        if three_d:                   # `model` stays an auto axis: GSPMD shards the split layers inside a stage
            rows_in["model"] = rows_out["model"] = P(STAGE)
            manual = {"axis_names": frozenset({STAGE, DATA})}
        return jax.shard_map(body, mesh=self.mesh,
                             in_specs=(rows_in, layout.specs(STAGE, DATA), P()) + ((P(),) if scaled else ()),
                             out_specs=(P(), rows_out), check_vma=False, **manual)

    # -- what the emitter needs -------------------------------------------------------------------
    @property
    def has_aux(self) -> bool:
        return self.parts.whole.has_aux

    def value_and_grad(self):
        loss_and_grads = self.loss_and_grads()
        cap = self.parts.whole
        if self.three_d:
            gather, scatter = self.gather_rows_3d(), self.scatter_grads_3d()
        else:
            gather, scatter = self.gather_rows(), self.scatter_grads()

        def rows_and_back(params):
            return gather(params), lambda g: (scatter(g),)

        def vg(params, batch, extra=(), scale=None):
            rows, back = rows_and_back(params)
            args = (rows, batch.buffers, list(extra)) + ((scale,) if scale is not None else ())
            outs, grad_rows = loss_and_grads(*args)
            grads = back(grad_rows)[0]
            if scale is not None:
                grads = precision_lib.unscale(grads, scale)
            value, aux, new_state = cap.split_outputs(outs)
            return (value, aux, new_state), grads

        return vg
