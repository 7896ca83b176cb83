"""Collectives used inside shard_map programs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def fused_psum(tree, axis):
    """`lax.psum(tree, axis)` as one all-reduce per dtype: the leaves flattened into one buffer, reduced,
    split back. Backends that run the operands of an all-reduce one by one (gloo on CPU: a fixed cost
    per operand) then pay for one operand, not one per parameter leaf; the sums are the same."""
    leaves, tree_def = jax.tree.flatten(tree)
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
