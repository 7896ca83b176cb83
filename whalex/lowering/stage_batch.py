"""Each pipeline stage receives only the batch leaves it reads.

A stage reads few of the batch leaves: the tokens the first stage, the targets and weights the
last. Handing every stage device its replica's whole batch made the batch a large part of a 1F1B
device's peak memory (bench/pipeline_memory.py, docs/benchmarks.md). Here the leaves are packed per stage into one
`[stages, global_batch, width]` buffer per dtype, sharded over (`stage`, `data`): the device of
stage s in replica r holds replica r's rows of the leaves stage s reads, side by side (each leaf
flattened after its batch dimension), padded to the widest stage of that dtype. Leaves keep their
dtype (no casts), so packing and unpacking are exact moves.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from whalex import _compat as C


@functools.partial(jax.tree_util.register_dataclass, data_fields=["buffers"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class StageBatch:
    """A batch in the stage layout: {dtype name: [stages, global_batch, width] array}."""

    buffers: dict


@dataclasses.dataclass(frozen=True)
class LeafSlot:
    """Where one batch leaf sits in its stage's row of a buffer."""

    leaf: int          # index among the batch leaves
    group: str         # the buffer: the leaf's dtype name
    offset: int        # first column
    shape: tuple       # the leaf's shape after the batch dimension

    @property
    def width(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class StageBatchLayout:
    """Which batch leaves each stage holds, and where."""

    stages: tuple[tuple[LeafSlot, ...], ...]
    widths: tuple[tuple[str, int], ...]        # (group, width): the widest stage of each dtype
    global_batch: int
    leaves: tuple[tuple[tuple, str], ...]      # (shape, dtype name) of every batch leaf, global rows

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def readers(self, leaf: int) -> tuple[int, ...]:
        return tuple(s for s, slots in enumerate(self.stages) if any(sl.leaf == leaf for sl in slots))

    def shapes(self) -> StageBatch:
        return StageBatch({g: jax.ShapeDtypeStruct((self.num_stages, self.global_batch, w), jnp.dtype(g))
                           for g, w in self.widths})

    def shardings(self, mesh, stage_axis: str, data_axis: str) -> StageBatch:
        return StageBatch({g: NamedSharding(mesh, P(stage_axis, data_axis)) for g, _ in self.widths})

    def specs(self, stage_axis: str, data_axis: str) -> dict:
        return {g: P(stage_axis, data_axis) for g, _ in self.widths}

    # -- inside the program: one device's rows ------------------------------------------------------
    def unpack(self, rows: dict, s: int) -> list:
        """Stage s's leaves from its rows {group: [n, width]} of the buffers: a list over every
        batch leaf, None where stage s does not hold it."""
        out: list = [None] * len(self.leaves)
        for sl in self.stages[s]:
            x = rows[sl.group]
            out[sl.leaf] = x[:, sl.offset:sl.offset + sl.width].reshape((x.shape[0],) + sl.shape)
        return out

    # -- outside: packing the caller's batch ---------------------------------------------------------
    def pack(self, leaves: Sequence[Any]) -> dict:
        """The buffers from the batch leaves (traceable: a jitted pack of placed arrays)."""
        out = {}
        for g, w in self.widths:
            rows = []
            for slots in self.stages:
                cols = [jnp.reshape(leaves[sl.leaf], (self.global_batch, -1)) for sl in slots if sl.group == g]
                used = sum(sl.width for sl in slots if sl.group == g)
                cols.append(jnp.zeros((self.global_batch, w - used), jnp.dtype(g)))
                rows.append(jnp.concatenate(cols, axis=1))
            out[g] = jnp.stack(rows)
        return out

    def host_shard(self, leaves: Sequence[np.ndarray], group: str, index: tuple) -> np.ndarray:
        """One device's shard of buffer `group` (`index`: its slices), read from host leaves."""
        width = dict(self.widths)[group]
        stages = range(self.num_stages)[index[0]]
        rows = range(self.global_batch)[index[1]]
        out = np.zeros((len(stages), len(rows), width), jnp.dtype(group))
        for k, s in enumerate(stages):
            for sl in self.stages[s]:
                if sl.group == group:
                    x = np.asarray(leaves[sl.leaf])[rows.start:rows.stop:rows.step]
                    out[k, :, sl.offset:sl.offset + sl.width] = x.reshape(len(rows), -1)
        return out[:, :, index[2]]

    # -- what it costs ------------------------------------------------------------------------------
    def device_bytes(self, replicas: int) -> int:
        """Batch bytes on every device (the padded stage row of each buffer)."""
        rows = self.global_batch // replicas
        return sum(rows * w * jnp.dtype(g).itemsize for g, w in self.widths)

    def stage_bytes(self, s: int, replicas: int) -> int:
        """Bytes of the leaves stage s reads, per device (without the padding)."""
        rows = self.global_batch // replicas
        return sum(rows * sl.width * jnp.dtype(sl.group).itemsize for sl in self.stages[s])

    def whole_bytes(self, replicas: int) -> int:
        """Bytes of a replica's whole batch: what every stage device held before this layout."""
        rows = self.global_batch // replicas
        return sum(rows * int(np.prod(shape[1:], dtype=np.int64)) * jnp.dtype(d).itemsize for shape, d in self.leaves)


def stage_reads(jaxpr, num_params: int, num_batch: int, stage_eqns: Sequence[Sequence[int]],
                also_last: Sequence[int] = ()) -> tuple[tuple[int, ...], ...]:
    """Indices of the batch leaves each stage's equations read (the last stage: also those the
    outputs name directly, and `also_last`)."""
    batch = {v: k for k, v in enumerate(jaxpr.invars[num_params:num_params + num_batch])}
    reads = []
    for eqns in stage_eqns:
        found = {batch[v] for i in eqns for v in jaxpr.eqns[i].invars if not isinstance(v, C.Literal) and v in batch}
        reads.append(found)
    reads[-1] |= {batch[v] for v in jaxpr.outvars if not isinstance(v, C.Literal) and v in batch} | set(also_last)
    return tuple(tuple(sorted(r)) for r in reads)


def make_layout(reads: Sequence[Sequence[int]], batch_avals: Sequence[Any], global_batch: int) -> StageBatchLayout:
    """Leaves side by side per stage and dtype, in leaf order."""
    leaves = tuple(((global_batch,) + tuple(a.shape[1:]), np.dtype(a.dtype).name) for a in batch_avals)
    stages, widths = [], {}
    for r in reads:
        offsets: dict = {}
        slots = []
        for k in r:
            shape, g = leaves[k]
            sl = LeafSlot(k, g, offsets.get(g, 0), shape[1:])
            offsets[g] = sl.offset + sl.width
            slots.append(sl)
        for g, w in offsets.items():
            widths[g] = max(widths.get(g, 0), w)
        stages.append(tuple(slots))
    return StageBatchLayout(tuple(stages), tuple(sorted((g, max(w, 1)) for g, w in widths.items())), global_batch,
                            leaves)


def place(layout: StageBatchLayout, batch, shardings: StageBatch, batch_tree, packer) -> StageBatch:
    """The caller's batch in the stage layout, placed: host leaves are read per device shard
    (`jax.make_array_from_callback`; each process reads only its devices' rows), placed arrays are
    packed by `packer` (`jax.jit(layout.pack, out_shardings=...)`). A StageBatch is returned as it is."""
    if isinstance(batch, StageBatch):
        return batch
    leaves, tree = jax.tree.flatten(batch)
    if tree != batch_tree:
        raise ValueError(f"the batch's structure {tree} is not the one this step was planned for ({batch_tree}).")
    for k, (x, (shape, _)) in enumerate(zip(leaves, layout.leaves)):
        if tuple(np.shape(x)) != shape:
            raise ValueError(f"batch leaf {k} has shape {tuple(np.shape(x))}, this step was planned for {shape}; "
                             "call step.init with the new batch to re-plan.")
    if any(isinstance(x, jax.Array) for x in leaves):
        return StageBatch(packer(leaves))
    host = [np.asarray(x) for x in leaves]
    return StageBatch({g: jax.make_array_from_callback(
        (layout.num_stages, layout.global_batch, w), shardings.buffers[g],
        functools.partial(layout.host_shard, host, g)) for g, w in layout.widths})

