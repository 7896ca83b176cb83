"""Emission: one jitted training step (loss, gradients, optax update) with the plan's shardings."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from whalex.lowering.capture import Captured
from whalex.lowering.interpret import make_evaluator
from whalex.lowering.patterns import ShardingPlan
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


@dataclasses.dataclass(frozen=True)
class Program:
    """Everything needed to run or lower the planned step on one mesh."""

    captured: Captured
    sharding: ShardingPlan
    mesh: Any
    optimizer: optax.GradientTransformation | None
    platform: str

    # -- shardings -------------------------------------------------------------------------
    def named(self, spec_tree):
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), spec_tree,
                            is_leaf=lambda x: isinstance(x, P))

    @functools.cached_property
    def param_shardings(self):
        specs = jax.tree.unflatten(self.captured.params_tree, list(self.sharding.param_specs))
        return self.named(specs)

    @functools.cached_property
    def batch_shardings(self):
        return self.named(jax.tree.unflatten(self.captured.batch_tree, list(self.sharding.batch_specs)))

    def param_shapes(self):
        invars = self.captured.jaxpr.jaxpr.invars[: self.captured.num_params]
        return jax.tree.unflatten(self.captured.params_tree,
                                  [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars])

    def batch_shapes(self):
        invars = self.captured.jaxpr.jaxpr.invars[self.captured.num_params:]
        return jax.tree.unflatten(self.captured.batch_tree,
                                  [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars])

    def state_shardings(self):
        opt_specs, _ = opt_state_specs(self.optimizer, self.param_shapes(), self.sharding.param_specs)
        return TrainState(params=self.param_shardings, opt_state=self.named(opt_specs),
                          step=NamedSharding(self.mesh, P()))

    # -- the functions -----------------------------------------------------------------------
    def loss(self) -> Callable:
        """loss(params, batch) -> (loss, aux) evaluated with the plan's constraints."""
        cap = self.captured
        evaluate = make_evaluator(cap.jaxpr, self.sharding.constraints, self.mesh)

        def loss(params, batch):
            outs = evaluate(*jax.tree.leaves(params), *jax.tree.leaves(batch))
            aux = jax.tree.unflatten(cap.aux_tree, outs[1:]) if cap.has_aux else None
            return outs[0], aux

        return loss

    def train_step(self) -> Callable:
        loss = self.loss()
        optimizer = self.optimizer
        grad_shardings = self.param_shardings
        has_aux = self.captured.has_aux

        def step(state: TrainState, batch):
            (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(state.params, batch)
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            metrics = {"loss": value}
            if has_aux:
                metrics["aux"] = aux
            return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics

        return step

    def grad_step(self) -> Callable:
        loss = self.loss()
        grad_shardings = self.param_shardings

        def step(params, batch):
            (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(params, batch)
            return value, jax.lax.with_sharding_constraint(grads, grad_shardings)

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
        def sds(shape_tree, sharding_tree):
            return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                shape_tree, sharding_tree)
        batch = sds(self.batch_shapes(), self.batch_shardings)
        if self.optimizer is None:
            return sds(self.param_shapes(), self.param_shardings), batch
        shardings = self.state_shardings()
        _, opt_shapes = opt_state_specs(self.optimizer, self.param_shapes(), self.sharding.param_specs)
        state = TrainState(params=sds(self.param_shapes(), shardings.params),
                           opt_state=sds(opt_shapes, shardings.opt_state),
                           step=jax.ShapeDtypeStruct((), jnp.int32, sharding=shardings.step))
        return state, batch

    def lower(self):
        return self.jitted(donate=False).trace(*self.abstract_args()).lower(lowering_platforms=(self.platform,))

    def init_state(self, params) -> TrainState:
        shardings = self.state_shardings()
        # The step donates its state, and device_put may alias a caller's buffer (even with
        # may_alias=False on jax 0.10.2), so place a copy: the caller's params stay valid.
        params = jax.device_put(jax.tree.map(lambda a: jnp.array(a, copy=True), params), shardings.params)
        opt_state = jax.jit(self.optimizer.init, out_shardings=shardings.opt_state)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
        return TrainState(params=params, opt_state=opt_state, step=step)
