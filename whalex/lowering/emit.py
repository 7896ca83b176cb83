"""Emission shared by every kind of step program: the optax update, `jax.jit` with the plan's
shardings, abstract arguments for lowering without devices, and placement of the state.

A program (collocated GSPMD, pipeline, uneven data parallel) provides its storage shapes and
shardings, `value_and_grad()` and `prepare_params()`; `Emitter` turns that into one jitted step.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from whalex.state import TrainState


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


def with_shardings(shapes, shardings):
    """ShapeDtypeStructs carrying shardings, for `jit(...).trace` on abstract meshes."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def make_train_step(value_and_grad: Callable, optimizer, has_aux: bool) -> Callable:
    """(state, batch) -> (state, metrics): gradients, then the optax update."""

    def step(state: TrainState, batch):
        (value, aux), grads = value_and_grad(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": value}
        if has_aux:
            metrics["aux"] = aux
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics

    return step


class Emitter:
    """Mixin: needs `mesh`, `optimizer`, `platform`, `param_shapes()`, `param_spec_list()`,
    `param_shardings`, `batch_shapes()`, `batch_shardings`, `value_and_grad()`, `has_aux`."""

    mesh: Any
    optimizer: Any
    platform: str

    def prepare_params(self, params):
        """The caller's parameters in this program's storage layout (identity by default)."""
        return params

    def unpack_params(self, params):
        """The caller's parameter pytree from the storage layout (identity by default)."""
        return params

    def state_shardings(self) -> TrainState:
        specs, _ = opt_state_specs(self.optimizer, self.param_shapes(), self.param_spec_list())
        named = jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
        return TrainState(params=self.param_shardings, opt_state=named, step=NamedSharding(self.mesh, P()))

    def train_step(self) -> Callable:
        return make_train_step(self.value_and_grad(), self.optimizer, self.has_aux)

    def grad_step(self) -> Callable:
        value_and_grad = self.value_and_grad()

        def step(params, batch):
            (value, _), grads = value_and_grad(params, batch)
            return value, grads

        return step

    def jitted(self, donate: bool = True):
        """The jitted training step, or a loss-and-gradient step when there is no optimizer."""
        replicated = NamedSharding(self.mesh, P())
        if self.optimizer is None:
            return jax.jit(self.grad_step(), in_shardings=(self.param_shardings, self.batch_shardings),
                           out_shardings=(replicated, self.param_shardings))
        state = self.state_shardings()
        return jax.jit(self.train_step(), in_shardings=(state, self.batch_shardings),
                       out_shardings=(state, replicated), donate_argnums=(0,) if donate else ())

    def abstract_args(self):
        """ShapeDtypeStructs with shardings for every argument of the jitted step."""
        batch = with_shardings(self.batch_shapes(), self.batch_shardings)
        params = with_shardings(self.param_shapes(), self.param_shardings)
        if self.optimizer is None:
            return params, batch
        shardings = self.state_shardings()
        _, opt_shapes = opt_state_specs(self.optimizer, self.param_shapes(), self.param_spec_list())
        state = TrainState(params=params, opt_state=with_shardings(opt_shapes, shardings.opt_state),
                           step=jax.ShapeDtypeStruct((), jnp.int32, sharding=shardings.step))
        return state, batch

    def lower(self):
        return self.jitted(donate=False).trace(*self.abstract_args()).lower(lowering_platforms=(self.platform,))

    def place_batch(self, batch):
        from whalex.distributed import place_global     # multi-process: each reads its own rows
        return place_global(batch, self.batch_shardings)

    def init_state(self, params) -> TrainState:
        """Place params (a copy: the step donates its state) and a fresh optimizer state."""
        shardings = self.state_shardings()
        params = self.prepare_params(jax.tree.map(lambda a: jnp.array(a, copy=True), params))
        params = jax.device_put(params, shardings.params)
        opt_state = jax.jit(self.optimizer.init, out_shardings=shardings.opt_state)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
        return TrainState(params=params, opt_state=opt_state, step=step)
