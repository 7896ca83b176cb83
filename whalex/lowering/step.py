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
    num_micro_batch: int = 1     # > 1: gradient accumulation over micro-batches (captured at micro size)
    overrides: Any = None        # path -> function replacing that equation (uneven split head)
    padded: Any = None           # param leaf -> (UnevenColumns, axis): stored padded per device

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
        shapes = []
        for i, v in enumerate(invars):
            shape = list(v.aval.shape)
            if self.padded and i in self.padded:
                cols, axis = self.padded[i]
                shape[axis] = len(cols.counts) * cols.width
            shapes.append(jax.ShapeDtypeStruct(tuple(shape), v.aval.dtype))
        return jax.tree.unflatten(self.captured.params_tree, shapes)

    def batch_shapes(self):
        invars = self.captured.jaxpr.jaxpr.invars[self.captured.num_params:]
        m = self.num_micro_batch
        return jax.tree.unflatten(self.captured.batch_tree, [
            jax.ShapeDtypeStruct((v.aval.shape[0] * m,) + tuple(v.aval.shape[1:]), v.aval.dtype) for v in invars])

    def pad_params(self, params):
        if not self.padded:
            return params
        leaves, tree = jax.tree.flatten(params)
        return jax.tree.unflatten(tree, [self.padded[i][0].pad(x, self.padded[i][1]) if i in self.padded else x
                                         for i, x in enumerate(leaves)])

    def unpack_params(self, params):
        """The caller's parameter pytree (uneven split leaves without their padding)."""
        if not self.padded:
            return params
        leaves, tree = jax.tree.flatten(params)
        return jax.tree.unflatten(tree, [self.padded[i][0].unpad(x, self.padded[i][1]) if i in self.padded else x
                                         for i, x in enumerate(leaves)])

    def state_shardings(self):
        opt_specs, _ = opt_state_specs(self.optimizer, self.param_shapes(), self.sharding.param_specs)
        return TrainState(params=self.param_shardings, opt_state=self.named(opt_specs),
                          step=NamedSharding(self.mesh, P()))

    # -- the functions -----------------------------------------------------------------------
    def loss(self) -> Callable:
        """loss(params, batch) -> (loss, aux) evaluated with the plan's constraints."""
        cap = self.captured
        evaluate = make_evaluator(cap.jaxpr, self.sharding.constraints, self.mesh, self.overrides)

        def loss(params, batch):
            outs = evaluate(*jax.tree.leaves(params), *jax.tree.leaves(batch))
            aux = jax.tree.unflatten(cap.aux_tree, outs[1:]) if cap.has_aux else None
            return outs[0], aux

        return loss

    def value_and_grad(self) -> Callable:
        """(params, batch) -> ((loss, aux), grads); with micro-batches, a scan that accumulates."""
        loss = self.loss()
        grad_shardings = self.param_shardings
        m = self.num_micro_batch
        vg = jax.value_and_grad(loss, has_aux=True)
        if m == 1:
            def plain(params, batch):
                (value, aux), grads = vg(params, batch)
                return (value, aux), jax.lax.with_sharding_constraint(grads, grad_shardings)
            return plain
        specs = self.sharding.batch_specs
        mesh = self.mesh

        def shards(spec):
            axes = spec[0] if len(spec) else None
            axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
            return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1

        # One row grouping for every leaf (so x_i stays with y_i): micro-batch k takes the k-th
        # chunk of each of the `dp` finest row blocks, which is local for every leaf's sharding.
        dp = max([shards(s) for s in specs] + [1])

        def split(x, spec):
            b = x.shape[0]
            y = x.reshape((dp, m, b // (dp * m)) + x.shape[1:]).swapaxes(0, 1).reshape((m, b // m) + x.shape[1:])
            return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, *spec)))

        def accumulate(params, batch):
            leaves, tree = jax.tree.flatten(batch)
            micro = jax.tree.unflatten(tree, [split(x, s) for x, s in zip(leaves, specs)])

            def body(carry, mb):
                (value, aux), grads = vg(params, mb)
                grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
                return (carry[0] + value, jax.tree.map(jnp.add, carry[1], grads)), aux

            zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            (total, grads), auxs = jax.lax.scan(body, zero, micro)
            aux = jax.tree.map(lambda a: a.mean(0) if jnp.issubdtype(a.dtype, jnp.floating) else a[-1], auxs)
            return (total / m, aux), jax.tree.map(lambda g: g / m, grads)

        return accumulate

    def train_step(self) -> Callable:
        value_and_grad = self.value_and_grad()
        optimizer = self.optimizer
        has_aux = self.captured.has_aux

        def step(state: TrainState, batch):
            (value, aux), grads = value_and_grad(state.params, batch)
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            metrics = {"loss": value}
            if has_aux:
                metrics["aux"] = aux
            return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics

        return step

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

    def place_batch(self, batch):
        from whalex.distributed import place_global     # multi-process: each reads its own rows
        return place_global(batch, self.batch_shardings)

    def init_state(self, params) -> TrainState:
        shardings = self.state_shardings()
        # The step donates its state, and device_put may alias a caller's buffer (even with
        # may_alias=False on jax 0.10.2), so place a copy: the caller's params stay valid.
        params = self.pad_params(jax.tree.map(lambda a: jnp.array(a, copy=True), params))
        params = jax.device_put(params, shardings.params)
        opt_state = jax.jit(self.optimizer.init, out_shardings=shardings.opt_state)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
        return TrainState(params=params, opt_state=opt_state, step=step)
