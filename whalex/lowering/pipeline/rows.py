"""Each stage's parameters as rows: the flat `[width]` row of its whole leaves and, with split
TaskGraphs inside the stages (3D), the `[model, model_width]` row of its model-split leaves, whose
row m holds block m of every such leaf (1/model of it on its split dimension). The gradient
accumulator has the same rows, held as segments cut at every stage's width (`packing.add_segments`).
With interleaved chunks a row is its stage's: the leaves of its chunks one chunk after another (a
leaf two of them read, twice), so a chunk reads and adds into its own block of the row.

`pack` and `pack_3d` are the plain-jnp definitions of the rows; inside the step they are built with
explicit collectives (`storage.SpreadStorage`) and tests compare the two.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from whalex.errors import PlanError
from whalex.lowering.pipeline.axes import MODEL, STAGE
from whalex.lowering.pipeline.packing import Slot, add_segments, bounds, layout
from whalex.lowering.stage_rows import pad_to


@dataclasses.dataclass(frozen=True)
class ParamRows:
    """Where each stage's parameter leaves sit in its rows."""

    stage_params: tuple[tuple[int, ...], ...]  # parameter leaves per stage (`StageCut.params`)
    invars: tuple                              # the captured loss's parameter variables
    model_dims: tuple = ()                     # per leaf: its dimension split over `model` (None: whole)
    model_parallel: int = 1                    # devices of the `model` axis
    multiple: int = 1                          # the flat row's width is a multiple of it (ZeRO splits it)
    chunk_counts: tuple = ()                   # per row: its chunks' leaf counts, in order (): one chunk each

    @functools.cached_property
    def dtype(self):
        dtypes = {np.dtype(v.aval.dtype) for v in self.invars}
        if len(dtypes) != 1 or not np.issubdtype(next(iter(dtypes)), np.floating):
            raise PlanError(f"pipelined parameters must share one floating dtype, found {sorted(map(str, dtypes))}; "
                            "cast the parameters to one dtype.")
        return dtypes.pop()

    @property
    def three_d(self) -> bool:
        """Split TaskGraphs inside the stages: a ('data', 'stage', 'model') mesh."""
        return self.model_parallel > 1

    def model_dim(self, leaf: int):
        """The dimension of parameter `leaf` split over `model` inside its stage (None: whole)."""
        return self.model_dims[leaf] if self.model_dims else None

    @functools.cached_property
    def slots(self) -> tuple[tuple[Slot, ...], ...]:
        """Per stage: the whole (not model-split) leaves in the stage's flat row."""
        return tuple(tuple(layout([self.invars[p] for p in ps if self.model_dim(p) is None])[0])
                     for ps in self.stage_params)

    @functools.cached_property
    def model_slots(self) -> tuple[tuple[tuple[Slot, int], ...], ...]:
        """Per stage: (slot of the block, split dimension) of each model-split leaf in its model row."""
        M, out = self.model_parallel, []
        for ps in self.stage_params:
            off, entries = 0, []
            for p in ps:
                d, v = self.model_dim(p), self.invars[p]
                if d is None:
                    continue
                shape = tuple(n // M if k == d else n for k, n in enumerate(v.aval.shape))
                slot = Slot(v, off, shape, v.aval.dtype)
                entries.append((slot, d))
                off += slot.size
            out.append(tuple(entries))
        return tuple(out)

    @functools.cached_property
    def width(self) -> int:
        width = max([sum(s.size for s in slots) for slots in self.slots] + [1])
        return -(-width // self.multiple) * self.multiple

    @functools.cached_property
    def model_width(self) -> int:
        return max([sum(sl.size for sl, _ in e) for e in self.model_slots] + [1])

    @functools.cached_property
    def grad_bounds(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Segment boundaries of the gradient accumulator's rows (flat, model): every stage's width
        (with chunks, where each chunk's block ends)."""
        if self.chunk_counts:
            blocks = [self.chunk_block(s, v) for s, counts in enumerate(self.chunk_counts) for v in range(len(counts))]
            return (bounds([e for _, (_, a, b), _ in blocks for e in (a, b)], self.width),
                    bounds([e for _, _, (_, a, b) in blocks for e in (a, b)], self.model_width))
        flat = bounds([sum(sl.size for sl in slots) for slots in self.slots], self.width)
        model = bounds([sum(sl.size for sl, _ in e) for e in self.model_slots], self.model_width)
        return flat, model

    # -- interleaved chunks: a block of their stage's row each ----------------------------------
    @functools.cached_property
    def _entries(self) -> tuple:
        """Per row, per leaf of `stage_params[row]`: (is it in the model row, its slot's index)."""
        out = []
        for ps in self.stage_params:
            flat = model = 0
            row = []
            for p in ps:
                split = self.model_dim(p) is not None
                row.append((split, model if split else flat))
                model, flat = model + split, flat + (not split)
            out.append(tuple(row))
        return tuple(out)

    def chunk_block(self, s: int, v: int):
        """Chunk v of row s: (its leaves' entries, (first slot, start, end) of its flat block, the same
        of its model block)."""
        a = sum(self.chunk_counts[s][:v])
        ents = self._entries[s][a:a + self.chunk_counts[s][v]]

        def block(split: bool, slots):
            idx = [j for m, j in ents if m == split]
            if not idx:
                return 0, 0, 0
            return idx[0], slots[idx[0]].offset, slots[idx[-1]].offset + slots[idx[-1]].size

        return ents, block(False, self.slots[s]), block(True, [sl for sl, _ in self.model_slots[s]])

    def _model_leaf(self, row, sl: Slot, d: int):
        """A model-split leaf reassembled on its split dimension from the `[model, width]` row (row m is
        block m, so GSPMD keeps each block on its model device)."""
        M = self.model_parallel
        x = row[:, sl.offset:sl.offset + sl.size].reshape((M,) + sl.shape)
        full = sl.shape[:d] + (M * sl.shape[d],) + sl.shape[d + 1:]
        x = jnp.moveaxis(x, 0, d).reshape(full)
        return jax.lax.with_sharding_constraint(x, P(*([None] * d + [MODEL])))

    def unpack_chunk(self, s: int, v: int, rows) -> list:
        """Chunk v of row s's parameter leaves (in its `StageCut.params` order); without chunks the row's."""
        if not self.chunk_counts:
            return self.unpack_stage(s, rows)
        ents = self.chunk_block(s, v)[0]
        out = []
        for split, j in ents:
            if split:
                out.append(self._model_leaf(rows[1], *self.model_slots[s][j]))
            else:
                sl = self.slots[s][j]
                out.append(rows[0][sl.offset:sl.offset + sl.size].reshape(sl.shape))
        return out

    def add_chunk_grads(self, s: int, v: int, acc, grads) -> tuple:
        """`acc` plus chunk v of row s's leaf gradients, added into its own block's segments only."""
        if not self.chunk_counts:
            return self.add_stage_grads(s, acc, grads)
        ents, (_, fa, _), (_, ma, _) = self.chunk_block(s, v)
        dtype, M = self.dtype, self.model_parallel
        flat = [g.reshape(-1).astype(dtype) for (split, _), g in zip(ents, grads) if not split]
        fb, mb = self.grad_bounds
        out = (add_segments(acc[0], jnp.concatenate(flat), fb, 0, fa) if flat else acc[0],)
        if self.three_d:
            parts = []
            for (split, j), g in zip(ents, grads):
                if split:
                    sl, d = self.model_slots[s][j]
                    g = g.astype(dtype).reshape(sl.shape[:d] + (M, sl.shape[d]) + sl.shape[d + 1:])
                    parts.append(jnp.moveaxis(g, d, 0).reshape(M, -1))
            out += (add_segments(acc[1], jnp.concatenate(parts, axis=1), mb, 1, ma) if parts else acc[1],)
        return out

    # -- inside the step: one stage's rows -------------------------------------------------------
    def unpack_stage(self, s: int, rows) -> list:
        """Stage s's parameter leaves (in `stage_params[s]` order) from its rows: the flat row `[width]`
        and, in 3D, the `[model, width]` row whose model-split leaves are reassembled on their split
        dimension (row m is block m, so GSPMD keeps each block on its model device)."""
        flat = {sl.var: rows[0][sl.offset:sl.offset + sl.size].reshape(sl.shape) for sl in self.slots[s]}
        for sl, d in (self.model_slots[s] if self.three_d else ()):
            flat[sl.var] = self._model_leaf(rows[1], sl, d)
        return [flat[self.invars[p]] for p in self.stage_params[s]]

    def stage_grad_rows(self, s: int, grads):
        """Stage s's leaf gradients laid out as its rows, unpadded: the flat row `[w_s]` and, in 3D, the
        `[model, m_s]` row of the model-split leaves (None without)."""
        dtype = self.dtype
        by_var = {self.invars[p]: g for p, g in zip(self.stage_params[s], grads)}
        flat = [by_var[sl.var].reshape(-1).astype(dtype) for sl in self.slots[s]]
        row = jnp.concatenate(flat) if flat else jnp.zeros((0,), dtype)
        if not self.three_d:
            return row, None
        M, parts = self.model_parallel, []
        for sl, d in self.model_slots[s]:
            g = by_var[sl.var].astype(dtype).reshape(sl.shape[:d] + (M, sl.shape[d]) + sl.shape[d + 1:])
            parts.append(jnp.moveaxis(g, d, 0).reshape(M, -1))
        return row, (jnp.concatenate(parts, axis=1) if parts else jnp.zeros((M, 0), dtype))

    def pack_stage_grads(self, s: int, grads) -> tuple:
        """The transpose of `unpack_stage`: stage s's leaf gradients into its rows."""
        row, m = self.stage_grad_rows(s, grads)
        out = (pad_to(row, self.width),)
        if m is not None:
            out += (jnp.pad(m, ((0, 0), (0, self.model_width - m.shape[1]))),)
        return out

    def add_stage_grads(self, s: int, acc, grads) -> tuple:
        """`acc` (the segments of `zero_rows`) plus stage s's leaf gradients, added into the segments the
        stage fills: a narrow stage touches only its own width, not the widest stage's."""
        row, m = self.stage_grad_rows(s, grads)
        flat, model = self.grad_bounds
        out = (add_segments(acc[0], row, flat, 0),)
        if m is not None:
            out += (add_segments(acc[1], m, model, 1),)
        return out

    def zero_rows(self) -> tuple:
        """The gradient accumulator: each row as segments (`grad_bounds`)."""
        def zeros(bounds, lead=()):
            return tuple(jnp.zeros(lead + (b - a,), self.dtype) for a, b in zip(bounds[:-1], bounds[1:]))
        flat, model = self.grad_bounds
        return (zeros(flat),) + ((zeros(model, (self.model_parallel,)),) if self.three_d else ())

    # -- outside: the definitions -----------------------------------------------------------------
    def pack(self, leaves) -> dict:
        """The caller's parameter leaves in the `[stages, width]` rows (a tied leaf copied into every row
        that reads it), in plain jnp."""
        rows = []
        for ps in self.stage_params:
            flat = [jnp.asarray(leaves[p], self.dtype).reshape(-1) for p in ps]
            row = jnp.concatenate(flat) if flat else jnp.zeros((0,), self.dtype)
            rows.append(pad_to(row, self.width))
        return {"stages": jnp.stack(rows)}

    def pack_3d(self, leaves, mesh) -> dict:
        """3D: the caller's parameter leaves as {"stages": [stages, width] whole leaves, "model": [stages,
        model, width] model-split leaves}, in plain jnp; under GSPMD its vjp is the gradient's way back
        (a tied leaf's rows summed)."""
        per_stage = [self.pack_stage_grads(s, [jnp.asarray(leaves[p]) for p in ps])
                     for s, ps in enumerate(self.stage_params)]
        rows = {"stages": jnp.stack([r[0] for r in per_stage]), "model": jnp.stack([r[1] for r in per_stage])}
        return {"stages": jax.lax.with_sharding_constraint(rows["stages"], NamedSharding(mesh, P(STAGE))),
                "model": jax.lax.with_sharding_constraint(rows["model"], NamedSharding(mesh, P(STAGE, MODEL)))}
