"""Where the parameters live between steps, and the way to the stage rows and back.

Each of the caller's parameter leaves is stored spread over every device of the mesh (its largest
dimension the mesh size divides), so the optax update runs on 1/N of the state per device under GSPMD,
exact for any GradientTransformation. Each step `gather` builds every device's stage row with explicit
collectives (`whalex.lowering.stage_rows`) and `scatter` is its transpose, which sums the rows of every
stage that reads a tied leaf. In 3D a model-split leaf is stored as its model blocks, each spread over
(stage, data), so a device never receives another model device's block.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from whalex.lowering import stage_rows
from whalex.lowering.fused_collectives import fused_all_gather
from whalex.lowering.pipeline.axes import DATA, MODEL, STAGE
from whalex.lowering.pipeline.rows import ParamRows


@dataclasses.dataclass(frozen=True)
class SpreadStorage:
    """The caller's parameter leaves spread over every device, and the collectives to and from the rows."""

    rows: ParamRows
    mesh: Any
    shapes: tuple          # the caller's leaves, as jax.ShapeDtypeStructs
    tree: Any              # their pytree structure
    data_parallel: int

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes a stored leaf is spread over."""
        return (STAGE, DATA, MODEL) if self.rows.three_d else (STAGE, DATA)

    def spread_dims(self) -> list:
        return [stage_rows.spread_dim(s.shape, self.mesh.size) for s in self.shapes]

    def model_local(self, p: int) -> tuple[int, ...]:
        """A model-split leaf's shape on one model device (its split dim / model)."""
        shape, d = self.rows.invars[p].aval.shape, self.rows.model_dim(p)
        return tuple(x // self.rows.model_parallel if k == d else x for k, x in enumerate(shape))

    def split_storage(self, p: int) -> tuple[int | None, P]:
        """3D storage of a model-split leaf: its model block on its split dim (`model`), that block spread
        over (stage, data) on its largest dimension they divide (on the split dim too: `model` major)."""
        local, k = self.model_local(p), self.rows.model_dim(p)
        d = stage_rows.spread_dim(local, self.mesh.size // self.rows.model_parallel)
        spec = [None] * len(local)
        spec[k] = MODEL
        if d is not None:
            spec[d] = (MODEL, STAGE, DATA) if d == k else (STAGE, DATA)
        return d, P(*spec)

    def spec_list(self) -> list[P]:
        """Each stored leaf spread over every device; in 3D a model-split leaf stored as its model blocks,
        each spread over (stage, data)."""
        return [self.split_storage(p)[1] if self.rows.model_dim(p) is not None
                else stage_rows.spread(x.shape, self.mesh.size, self.axes) for p, x in enumerate(self.shapes)]

    def _shard_map(self, body, in_specs, out_specs):
        return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    # -- 2D: (stage, data) ---------------------------------------------------------------------
    def gather(self):
        """Stored params (the caller's pytree) -> {"stages": [stages, width]} rows sharded over `stage`:
        `ParamRows.pack` with explicit all-gathers."""
        dims, cut, slots = self.spread_dims(), self.rows.stage_params, self.rows.slots
        W, dtype, shapes = self.rows.width, self.rows.dtype, list(self.shapes)

        def body(*leaves):
            return {"stages": stage_rows.gather_row(leaves, dims, cut, slots, shapes, W, dtype, (STAGE, DATA))}

        fn = self._shard_map(body, tuple(self.spec_list()), {"stages": P(STAGE)})
        return lambda params: fn(*jax.tree.leaves(params))

    def scatter(self):
        """{"stages": row gradients} (summed over the replicas) -> the caller-layout gradient, stored: the
        transpose of `gather` (a tied leaf's rows summed)."""
        dims, cut, slots, dp = self.spread_dims(), self.rows.stage_params, self.rows.slots, self.data_parallel
        shapes = list(self.shapes)

        def body(rows):
            return tuple(stage_rows.scatter_grads(rows["stages"], dims, cut, slots, shapes, dp, (STAGE, DATA)))

        fn = self._shard_map(body, ({"stages": P(STAGE)},), tuple(self.spec_list()))
        return lambda rows: jax.tree.unflatten(self.tree, list(fn(rows)))

    # -- 3D: whole leaves and model blocks -------------------------------------------------------
    def _cut(self, group):
        where = {p: i for i, p in enumerate(group)}
        return [[where[p] for p in ps if p in where] for ps in self.rows.stage_params]

    def _groups_3d(self):
        """(whole leaves, spread dims, avals), (model-split leaves, spread dims, block shapes, slots)."""
        n = len(self.rows.invars)
        whole = [p for p in range(n) if self.rows.model_dim(p) is None]
        split = [p for p in range(n) if self.rows.model_dim(p) is not None]
        wshapes = [self.rows.invars[p].aval for p in whole]
        wdims = [stage_rows.spread_dim(a.shape, self.mesh.size) for a in wshapes]
        sshapes = [jax.ShapeDtypeStruct(self.model_local(p), self.rows.invars[p].aval.dtype) for p in split]
        sdims = [self.split_storage(p)[0] for p in split]
        mslots = tuple(tuple(sl for sl, _ in e) for e in self.rows.model_slots)
        return (whole, wdims, wshapes), (split, sdims, sshapes, mslots)

    def gather_3d(self):
        """Stored params -> {"stages": [stages, width] whole leaves, "model": [stages, model, width] model
        blocks}. A whole leaf: one fused all-gather over `model` (each device then holds its (stage, data)
        block, the 2D layout), then the pipeline's gather over (stage, data). A model-split leaf: the same
        gather on its blocks."""
        (whole, wdims, wshapes), (split, sdims, sshapes, mslots) = self._groups_3d()
        rows, axes = self.rows, (STAGE, DATA)

        def body(*leaves):
            wl = fused_all_gather([leaves[p] for p in whole], MODEL, wdims)
            flat = stage_rows.gather_row(wl, wdims, self._cut(whole), rows.slots, wshapes, rows.width, rows.dtype,
                                         axes)
            mrow = stage_rows.gather_row([leaves[p] for p in split], sdims, self._cut(split), mslots, sshapes,
                                         rows.model_width, rows.dtype, axes)
            return {"stages": flat, "model": mrow[:, None]}

        assert len(whole) + len(split) == len(rows.invars)
        fn = self._shard_map(body, tuple(self.spec_list()), {"stages": P(STAGE), "model": P(STAGE, MODEL)})
        return lambda params: fn(*jax.tree.leaves(params))

    def scatter_3d(self):
        """The transpose of `gather_3d` (a tied leaf's gradients summed over its stages)."""
        (whole, wdims, wshapes), (split, sdims, sshapes, mslots) = self._groups_3d()
        M, n, dp, axes = self.rows.model_parallel, len(self.rows.invars), self.data_parallel, (STAGE, DATA)

        def body(rows):
            out = [None] * n
            m = jax.lax.axis_index(MODEL)
            wg = stage_rows.scatter_grads(rows["stages"], wdims, self._cut(whole), self.rows.slots, wshapes, dp, axes)
            for p, g, d in zip(whole, wg, wdims):        # the (stage, data) block -> this device's model part
                out[p] = g if d is None else jax.lax.dynamic_slice_in_dim(g, m * (g.shape[d] // M), g.shape[d] // M, d)
            for p, g in zip(split, stage_rows.scatter_grads(rows["model"][:, 0], sdims, self._cut(split), mslots,
                                                            sshapes, dp, axes)):
                out[p] = g
            return tuple(out)

        fn = self._shard_map(body, ({"stages": P(STAGE), "model": P(STAGE, MODEL)},), tuple(self.spec_list()))
        return lambda rows: jax.tree.unflatten(self.tree, list(fn(rows)))
