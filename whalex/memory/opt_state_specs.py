"""PartitionSpecs of the optimizer state, from the parameters' (read by balance's memory model,
memory's accounting and lowering's emission)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P


def param_tree_test(params) -> Callable[[Any], bool]:
    """A predicate: whether a subtree is laid out like `params` (one structure, the same leaf shapes),
    as the per-parameter parts of an optax state are (Adam's mu and nu)."""
    treedef = jax.tree.structure(params)
    shapes = [np.shape(p) for p in jax.tree.leaves(params)]

    def test(x) -> bool:
        if x is None or jax.tree.structure(x) != treedef:
            return False
        return [np.shape(leaf) for leaf in jax.tree.leaves(x)] == shapes

    return test


def opt_state_specs(optimizer: optax.GradientTransformation, params, param_specs):
    """PartitionSpecs for the optimizer state: subtrees shaped like the params follow their specs."""
    shapes = jax.eval_shape(optimizer.init, params)
    spec_tree = jax.tree.unflatten(jax.tree.structure(params), list(param_specs))
    is_param_tree = param_tree_test(params)

    def assign(sub):
        if is_param_tree(sub):
            return spec_tree
        return jax.tree.map(lambda _: P(), sub)

    return jax.tree.map(assign, shapes, is_leaf=is_param_tree), shapes
