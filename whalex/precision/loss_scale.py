"""Dynamic loss scaling for fp16 (`Config.amp="fp16"`): the loss is multiplied by
`TrainState.loss_scale.scale` before differentiation and the gradients divided by it; a step whose
gradients are not all finite leaves params and optimizer state unchanged and halves the scale; after
`Config.loss_scale_period` finite steps in a row the scale doubles (up to 2**15: the backward pass
starts from the scale in fp16, whose largest finite value is 65504)."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

MAX_SCALE = 2.0 ** 15
INITIAL_SCALE = 2.0 ** 15


class LossScale(struct.PyTreeNode):
    """Dynamic loss scale (amp="fp16"): the scale and the finite steps since it last changed."""

    scale: jax.Array
    good_steps: jax.Array

    @classmethod
    def initial(cls) -> LossScale:
        return cls(jnp.asarray(INITIAL_SCALE, jnp.float32), jnp.asarray(0, jnp.int32))

    def adjust(self, finite, period: int) -> LossScale:
        """Halve on overflow; double after `period` finite steps in a row (at most MAX_SCALE)."""
        grown = self.good_steps + 1 >= period
        scale = jnp.where(finite, jnp.where(grown, jnp.minimum(self.scale * 2, MAX_SCALE), self.scale),
                          jnp.maximum(self.scale / 2, 1.0))
        good = jnp.where(finite & ~grown, self.good_steps + 1, 0)
        return LossScale(scale.astype(jnp.float32), good.astype(jnp.int32))


def value_and_grad(loss: Callable) -> Callable:
    """`jax.value_and_grad(loss, has_aux=True)` taking an optional loss scale: with one, the
    gradient of scale * loss, divided by the scale (the value returned is the unscaled loss)."""
    plain = jax.value_and_grad(loss, has_aux=True)

    def scaled_loss(params, batch, scale):
        value, aux = loss(params, batch)
        return value * scale.astype(value.dtype), (value, aux)

    scaled = jax.value_and_grad(scaled_loss, has_aux=True)

    def vg(params, batch, scale=None):
        if scale is None:
            return plain(params, batch)
        (_, (value, aux)), grads = scaled(params, batch, scale)
        return (value, aux), unscale(grads, scale)

    return vg


def unscale(grads, scale):
    return jax.tree.map(lambda g: (g / scale.astype(g.dtype)) if jnp.issubdtype(g.dtype, jnp.floating) else g, grads)


def all_finite(tree):
    leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)


def loss_scaled_step(value_and_grad: Callable, build: Callable, period: int) -> Callable:
    """Wrap the step `build(value_and_grad)` with dynamic loss scaling: value_and_grad(params,
    batch, scale) gives unscaled gradients; non-finite ones skip the update."""

    def step(state, batch):
        ls = state.loss_scale
        box = {}

        def vg(params, batch, extra=()):
            (value, aux, new_state), grads = value_and_grad(params, batch, extra, ls.scale)
            box["finite"] = all_finite(grads)
            return (value, aux, new_state), grads

        new, metrics = build(vg)(state.replace(loss_scale=None), batch)
        finite = box["finite"]
        keep = lambda a, b: jax.tree.map(lambda x, y: jnp.where(finite, x, y), a, b)  # noqa: E731
        new = new.replace(stored_params=keep(new.stored_params, state.stored_params),
                          opt_state=keep(new.opt_state, state.opt_state),
                          model_state=keep(new.model_state, state.model_state),
                          loss_scale=ls.adjust(finite, period))
        return new, {**metrics, "loss_scale": ls.scale, "grads_finite": finite}

    return step
