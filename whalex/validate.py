"""Checks of what the caller hands whalex: each refuses bad input with the argument (down to the
pytree path of the leaf) and the fix, before anything is traced, placed or donated (docs/errors.md).

A bottom-layer module (jax, numpy and `whalex.errors` only): capture, the cluster and the public
API all call it, so one input gets one message whichever door it came through.
"""
from __future__ import annotations

import jax
import numpy as np

from whalex.errors import PlanError

_NUMBER = (bool, int, float, complex)


def where(name: str, path) -> str:
    """`name` and a pytree key path as the caller would index it: batch['x'][0]."""
    return name + jax.tree_util.keystr(tuple(path))


def _is_array(x) -> bool:
    """An array or its abstract stand-in (jax.Array, tracer, np.ndarray, ShapeDtypeStruct, np scalar)."""
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _is_number_list(x) -> bool:
    """A Python list or tuple holding only Python numbers: what a forgotten np.asarray leaves behind."""
    if not isinstance(x, (list, tuple)):
        return False
    leaves = jax.tree.leaves(x)
    return bool(leaves) and all(isinstance(v, _NUMBER) for v in leaves)


# -- the batch -----------------------------------------------------------------------------------
def batch_size(batch) -> int:
    """The global batch size: the leading dimension every batch leaf shares."""
    flat = jax.tree_util.tree_flatten_with_path(batch, is_leaf=_is_number_list)[0]
    if not flat:
        raise PlanError("the batch has no arrays; pass a pytree of arrays whose leading dimension is the batch.")
    sizes: dict[int, str] = {}
    for path, leaf in flat:
        name = where("batch", path)
        if not _is_array(leaf) or getattr(leaf.dtype, "kind", None) in ("O", "U", "S"):
            raise _not_an_array(name, leaf)
        if not leaf.shape:
            raise PlanError(f"{name} is a scalar (shape ()); every batch leaf needs a leading batch dimension. "
                            "Give per-sample values as an array of shape (batch, ...), and pass a value shared by "
                            "all samples through loss_fn's closure or params instead of the batch.")
        sizes.setdefault(leaf.shape[0], name)
    if len(sizes) != 1:
        found = ", ".join(f"{name} has {n}" for n, name in sizes.items())
        raise PlanError(f"batch leaves disagree on the leading (batch) dimension: {found}; give every leaf the "
                        "same global batch size.")
    return next(iter(sizes))


def _not_an_array(name: str, leaf) -> PlanError:
    if isinstance(leaf, (list, tuple)):
        return PlanError(f"{name} is a Python {type(leaf).__name__} of numbers, not an array: JAX reads a list as a "
                         "pytree of scalars. Pass arrays whose leading dimension is the batch, e.g. "
                         f"np.asarray({name}) or jnp.asarray(...).")
    if isinstance(leaf, _NUMBER):
        return PlanError(f"{name} is a Python {type(leaf).__name__}, not an array; every batch leaf is an array "
                         "whose leading dimension is the batch. Pass a value shared by all samples through "
                         "loss_fn's closure or params instead of the batch.")
    kind = f"an array of dtype {leaf.dtype}" if _is_array(leaf) else f"a {type(leaf).__name__}"
    return PlanError(f"{name} is {kind}, not an array of numbers; the batch holds numeric arrays only "
                     "(encode text and other objects as numbers before the step, keep the rest outside the batch).")


# -- the parameters ------------------------------------------------------------------------------
def check_params(params) -> None:
    """Every parameter leaf is a floating-point array (or number): whalex differentiates each one and
    the optimizer updates it, as `jax.grad` and optax do on one device."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = where("params", path)
        if isinstance(leaf, _NUMBER):
            dtype = np.result_type(leaf)
        elif _is_array(leaf):
            dtype = leaf.dtype
        else:
            raise PlanError(f"{name} is a {type(leaf).__name__}, not an array; params holds the arrays the optimizer "
                            "trains. Keep configuration and other Python objects in loss_fn's closure.")
        if not jax.numpy.issubdtype(dtype, jax.numpy.inexact):
            raise PlanError(
                f"{name} has dtype {dtype}: every params leaf is differentiated and updated by the optimizer, and a "
                "leaf that is not floating point (a step counter, a mask, token ids) has no gradient. Keep it in "
                "model_state= (step.init(params, batch, model_state={...}); loss_fn(params, batch, model_state=ms) "
                "returns (loss, new_model_state)) or outside params (loss_fn's closure; state.step counts steps).")


# -- what loss_fn returns ------------------------------------------------------------------------
def check_outputs(name: str, tree) -> None:
    """Every leaf of a loss output (`aux`, the new model state) is an array or a number: they leave
    the jitted step as arrays."""
    where_to = _RETURNED_AS[name]
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not (_is_array(leaf) or isinstance(leaf, _NUMBER)):
            raise PlanError(
                f"loss_fn returned {where(name, path)} = {_short(leaf)} (type {type(leaf).__name__}), not an array: "
                f"{name} leaves the jitted step as arrays ({where_to}). Return only arrays and numbers there, and "
                f"keep strings and other Python objects outside loss_fn (derive them from {where_to} after the step).")


_RETURNED_AS = {"aux": "metrics['aux']", "new_model_state": "state.model_state"}


def _short(x) -> str:
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


# -- step.init -----------------------------------------------------------------------------------
def check_placeable(**trees) -> None:
    """`step.init` places values: refuse jax.ShapeDtypeStructs (shapes without values) by name."""
    for arg, tree in trees.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if isinstance(leaf, jax.ShapeDtypeStruct):
                raise PlanError(
                    f"step.init got a jax.ShapeDtypeStruct at {where(arg, path)}: init places values, so it needs "
                    "arrays (e.g. model.init(key, x)['params']). To start from a checkpoint, use "
                    "wh.CheckpointManager(...).restore(step, params, batch), which takes "
                    "ShapeDtypeStructs; to plan without values, use wh.plan(loss_fn, params, batch, ...).")
