"""Pipeline stage rows from the caller's pytree spread over every device, and back, with explicit
collectives (functions for the inside of `shard_map` over a ('data', 'stage') mesh).

A pipeline stores each parameter leaf split on one dimension (`spread_dim`) over the mesh axes
('stage', 'data') in that order, so device (replica r, stage s) holds block s*dp + r (`spread`).
`gather_row` all-gathers the leaves and lets each device concatenate those of its stage into its
row. `scatter_grads` is its transpose: the device's row gradient (summed over the replicas) cut into
its stage's leaves (zeros for the others), reduce-scattered over `stage` (which sums a tied leaf's
gradients from every stage that reads it) and sliced to the device's block. Written by hand because
XLA's partitioner cannot reshard the packed rows from the spread layout without replicating them.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def spread_dim(shape: Sequence[int], n: int) -> int | None:
    """The largest dimension that `n` divides (None: the leaf stays replicated)."""
    dims = [d for d in range(len(shape)) if shape[d] % n == 0 and shape[d] > 0]
    return max(dims, key=lambda d: shape[d]) if dims else None


def spread(shape: Sequence[int], n: int, axes: tuple[str, ...]) -> P:
    """The spec of a stored leaf: `spread_dim` split over `axes` (all the mesh's, n devices)."""
    d = spread_dim(shape, n)
    return P() if d is None else P(*([None] * d + [axes]))


def gather_row(local: Sequence, dims: Sequence, stage_params: Sequence[Sequence[int]], slots, width: int,
               dtype, axes: tuple[str, str]):
    """This device's `[1, width]` stage row from its blocks of the spread leaves. `axes`: (stage, data)."""
    full = [x if d is None else jax.lax.all_gather(x, axes, axis=d, tiled=True) for x, d in zip(local, dims)]

    def build(ps):
        def row(leaves):
            flat = [leaves[p].astype(dtype).reshape(-1) for p in ps]
            r = jnp.concatenate(flat) if flat else jnp.zeros((0,), dtype)
            return jnp.pad(r, (0, width - r.shape[0]))[None]
        return row

    return jax.lax.switch(jax.lax.axis_index(axes[0]), [build(ps) for ps in stage_params], full)


def scatter_grads(row, dims: Sequence, stage_params: Sequence[Sequence[int]], slots, shapes: Sequence,
                  dp: int, axes: tuple[str, str]) -> list:
    """This device's blocks of the caller-layout gradient from its `[1, width]` stage row gradient (the
    same on every replica of the stage): the transpose of `gather_row`."""
    stage, data = axes

    def cut(ps, sls):
        def parts(r):
            out = [jnp.zeros(s.shape, r.dtype) for s in shapes]
            for p, sl in zip(ps, sls):
                out[p] = r[0, sl.offset:sl.offset + sl.size].reshape(sl.shape)
            return out
        return parts

    parts = jax.lax.switch(jax.lax.axis_index(stage), [cut(ps, sl) for ps, sl in zip(stage_params, slots)], row)
    out = []
    for g, d in zip(parts, dims):
        if d is None:
            out.append(jax.lax.psum(g, stage))
            continue
        g = jax.lax.psum_scatter(g, stage, scatter_dimension=d, tiled=True)
        size = g.shape[d] // dp
        out.append(jax.lax.dynamic_slice_in_dim(g, jax.lax.axis_index(data) * size, size, d))
    return out
