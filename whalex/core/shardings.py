"""PartitionSpecs of the optimizer state, from the parameters' (read by balance's memory model,
memory's accounting and lowering's emission)."""
from __future__ import annotations

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P


def opt_state_specs(optimizer: optax.GradientTransformation, params, param_specs):
    """PartitionSpecs for the optimizer state: subtrees shaped like the params follow their specs."""
    shapes = jax.eval_shape(optimizer.init, params)
    treedef = jax.tree.structure(params)
    spec_tree = jax.tree.unflatten(treedef, list(param_specs))
    param_shapes = [np.shape(p) for p in jax.tree.leaves(params)]

    def is_param_tree(x):
        if x is None or jax.tree.structure(x) != treedef:
            return False
        return [np.shape(l) for l in jax.tree.leaves(x)] == param_shapes

    def assign(sub):
        if is_param_tree(sub):
            return spec_tree
        return jax.tree.map(lambda _: P(), sub)

    return jax.tree.map(assign, shapes, is_leaf=is_param_tree), shapes
