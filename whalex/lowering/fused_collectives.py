"""Collectives fused over a pytree (one psum or all-gather for many leaves), for the inside of lowering's
shard_map programs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _size(axis) -> int:
    """Devices along mesh axis `axis` (a name or a tuple of names), inside `shard_map`."""
    names = axis if isinstance(axis, (tuple, list)) else (axis,)
    return int(np.prod([jax.lax.axis_size(a) for a in names]))


def fused_psum(tree, axis):
    """`lax.psum(tree, axis)` as one all-reduce per dtype: the leaves flattened into one buffer, reduced,
    split back. Backends that run the operands of an all-reduce one by one (gloo on CPU: a fixed cost
    per operand) then pay for one operand, not one per parameter leaf; the sums are the same."""
    leaves, tree_def = jax.tree.flatten(tree)
    if _size(axis) == 1:
        return tree
    out = list(leaves)
    for dtype in dict.fromkeys(x.dtype for x in leaves):
        idx = [i for i, x in enumerate(leaves) if x.dtype == dtype]
        if len(idx) == 1:
            out[idx[0]] = jax.lax.psum(leaves[idx[0]], axis)
            continue
        flat = jax.lax.psum(jnp.concatenate([leaves[i].reshape(-1) for i in idx]), axis)
        offsets = np.cumsum([0] + [leaves[i].size for i in idx])
        for i, a, b in zip(idx, offsets[:-1], offsets[1:]):
            out[i] = flat[a:b].reshape(leaves[i].shape)
    return jax.tree.unflatten(tree_def, out)


def fused_all_gather(xs, axis, dims):
    """`[lax.all_gather(x, axis, axis=d, tiled=True) for x, d in zip(xs, dims)]` as one all-gather per
    dtype: each leaf's local block flattened into one buffer, gathered (one row per device of `axis`),
    and each leaf rebuilt by concatenating its blocks on its dimension `d`. A leaf whose `d` is None is
    passed through. Same values, one collective instead of one per leaf (see `fused_psum`)."""
    out = list(xs)
    if _size(axis) == 1:                 # one device: each leaf is already whole (no copy, no collective)
        return out
    todo = [i for i, d in enumerate(dims) if d is not None]
    for dtype in dict.fromkeys(xs[i].dtype for i in todo):
        idx = [i for i in todo if xs[i].dtype == dtype]
        if len(idx) == 1:
            out[idx[0]] = jax.lax.all_gather(xs[idx[0]], axis, axis=dims[idx[0]], tiled=True)
            continue
        rows = jax.lax.all_gather(jnp.concatenate([xs[i].reshape(-1) for i in idx]), axis)    # [n, total]
        offsets = np.cumsum([0] + [xs[i].size for i in idx])
        for i, a, b in zip(idx, offsets[:-1], offsets[1:]):
            blocks = rows[:, a:b].reshape((rows.shape[0],) + xs[i].shape)                       # [n, *block]
            out[i] = jnp.concatenate(list(blocks), axis=dims[i])
    return out
