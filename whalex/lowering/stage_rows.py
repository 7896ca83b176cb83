"""Pipeline stage rows from the caller's pytree spread over every device, and back, with explicit
collectives (functions for the inside of `shard_map` over a ('data', 'stage') mesh).

A pipeline stores each parameter leaf split on one dimension (`spread_dim`) over the mesh axes
('stage', 'data') in that order, so device (replica r, stage s) holds block s*dp + r (`spread`).
`gather_row` builds each device's row of its stage's leaves, receiving only those (plus 1/S of
every leaf from one fused all-gather over `data`); `scatter_grads` is its transpose, which sums a tied
leaf's gradients from every stage that reads it. Written by hand because XLA's partitioner
replicates the packed rows to reshard them from the spread layout (every device would receive
every parameter); on 8 CPU devices both cost the same time, the all-to-all less memory.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from whalex.lowering.fused_collectives import fused_all_gather, fused_psum


def pad_to(x, n: int):
    """The 1-D `x` followed by zeros to length `n`, as a concatenated zero block: XLA CPU runs the
    equivalent `jnp.pad` in the pipeline step as a slow loop fusion (docs/benchmarks.md)."""
    if x.shape[0] == n:
        return x
    return jnp.concatenate([x, jnp.zeros((n - x.shape[0],), x.dtype)])


def spread_dim(shape: Sequence[int], n: int) -> int | None:
    """The largest dimension that `n` divides (None: the leaf stays replicated)."""
    dims = [d for d in range(len(shape)) if shape[d] % n == 0 and shape[d] > 0]
    return max(dims, key=lambda d: shape[d]) if dims else None


def spread(shape: Sequence[int], n: int, axes: tuple[str, ...]) -> P:
    """The spec of a stored leaf: `spread_dim` split over `axes` (all the mesh's, n devices)."""
    d = spread_dim(shape, n)
    return P() if d is None else P(*([None] * d + [axes]))


def _block_layout(stage_params, dims, shapes, S):
    """Per stage: [(leaf, offset, block shape)] of its spread leaves in a stage buffer (each leaf's 1/S
    block on its spread dimension, flattened one after another), and the buffer width C."""
    layout, widths = [], []
    for ps in stage_params:
        off, entries = 0, []
        for p in dict.fromkeys(ps):          # a leaf twice in one row (two chunks read it) travels once
            d = dims[p]
            if d is None:
                continue
            block = tuple(n // S if k == d else n for k, n in enumerate(shapes[p].shape))
            entries.append((p, off, block))
            off += int(np.prod(block, dtype=np.int64))
        layout.append(entries)
        widths.append(off)
    return layout, max(widths + [1])


def gather_row(local: Sequence, dims: Sequence, stage_params: Sequence[Sequence[int]], slots, shapes: Sequence,
                   width: int, dtype, axes: tuple[str, str]):
    """This device's `[1, width]` stage row from its blocks of the spread leaves: an all-gather over
    `data` (each device then holds 1/S of every leaf), then an all-to-all over `stage` sending each
    stage the blocks of its own leaves only. `axes`: (stage, data)."""
    stage, data = axes
    S = len(stage_params)
    layout, C = _block_layout(stage_params, dims, shapes, S)
    part = fused_all_gather(list(local), data, dims)

    def buffer(entries):
        flat = [part[p].astype(dtype).reshape(-1) for p, _, _ in entries]
        b = jnp.concatenate(flat) if flat else jnp.zeros((0,), dtype)
        return pad_to(b, C)

    send = jnp.stack([buffer(entries) for entries in layout])                      # [S, C]: one per destination
    recv = jax.lax.all_to_all(send, stage, 0, 0, tiled=True)                       # [S, C]: one per source

    def build(t):
        def row(recv, part):
            full = {p: part[p] for p in stage_params[t] if dims[p] is None}
            for p, off, block in layout[t]:
                size = int(np.prod(block, dtype=np.int64))
                full[p] = jnp.concatenate([recv[k, off:off + size].reshape(block) for k in range(S)], axis=dims[p])
            flat = [full[p].astype(dtype).reshape(-1) for p in stage_params[t]]
            r = jnp.concatenate(flat) if flat else jnp.zeros((0,), dtype)
            return pad_to(r, width)[None]
        return row

    return jax.lax.switch(jax.lax.axis_index(stage), [build(t) for t in range(S)], recv, part)


def scatter_grads(row, dims: Sequence, stage_params: Sequence[Sequence[int]], slots, shapes: Sequence,
                      dp: int, axes: tuple[str, str]) -> list:
    """This device's blocks of the caller-layout gradient from its `[1, width]` stage row gradient (the same
    on every replica of the stage), the transpose of `gather_row`: the stage's leaf gradients cut into S
    blocks, an all-to-all over `stage` (a tied leaf's blocks summed over the stages that read it), then
    each replica's slice of its block."""
    stage, data = axes
    S = len(stage_params)
    layout, C = _block_layout(stage_params, dims, shapes, S)
    replicated = [p for p, d in enumerate(dims) if d is None]

    def cut(t):
        def parts(r):
            leaves: dict = {}
            for p, sl in zip(stage_params[t], slots[t]):           # a leaf twice in the row: summed
                g = r[0, sl.offset:sl.offset + sl.size].reshape(sl.shape)
                leaves[p] = leaves[p] + g if p in leaves else g
            send = []
            for k in range(S):                     # destination stage k gets block k of each leaf
                flat = [jax.lax.slice_in_dim(leaves[p], k * block[dims[p]], (k + 1) * block[dims[p]],
                                             axis=dims[p]).reshape(-1) for p, _, block in layout[t]]
                b = jnp.concatenate(flat) if flat else jnp.zeros((0,), r.dtype)
                send.append(pad_to(b, C))
            rep = [leaves[p] if p in leaves else jnp.zeros(shapes[p].shape, r.dtype) for p in replicated]
            return jnp.stack(send), rep
        return parts

    send, rep = jax.lax.switch(jax.lax.axis_index(stage), [cut(t) for t in range(S)], row)
    recv = jax.lax.all_to_all(send, stage, 0, 0, tiled=True)                       # [S, C]: from each source
    blocks: dict = {}
    for t in range(S):
        for p, off, block in layout[t]:
            size = int(np.prod(block, dtype=np.int64))
            g = recv[t, off:off + size].reshape(block)
            blocks[p] = g if p not in blocks else blocks[p] + g
    summed = fused_psum(rep, stage)
    out = []
    for p, d in enumerate(dims):
        if d is None:
            out.append(summed[replicated.index(p)])
            continue
        g = blocks[p]
        size = g.shape[d] // dp
        out.append(jax.lax.dynamic_slice_in_dim(g, jax.lax.axis_index(data) * size, size, d))
    return out
