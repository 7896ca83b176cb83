"""Uneven data parallelism in one SPMD program (Whale section 3.3.1, intra-TaskGraph balance).

Device i trains on its own number of samples, `counts[i] * unit`, chosen by Algorithm 1. The
global batch is laid out padded: device i's block of `max(counts) * unit` rows holds its real rows
first and padding after. Inside `shard_map`, each device runs a `fori_loop` over its own number
of `unit`-row chunks (the trip count differs between devices, so no collective runs inside the
loop), accumulating sample-weighted loss and gradients; one `psum` after the loop gives exactly the
global-batch mean. Padding rows are never read.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from whalex.lowering.capture import Captured
from whalex.lowering.interpret import make_evaluator
from whalex.state import TrainState

DATA = "data"


@dataclasses.dataclass(frozen=True)
class UnevenProgram:
    captured: Captured           # traced at `unit` rows
    mesh: Any                    # 1-D mesh over every device, axis "data"
    optimizer: optax.GradientTransformation | None
    platform: str
    counts: tuple[int, ...]      # chunks of `unit` rows per device
    unit: int
    global_batch: int

    @property
    def rows(self) -> tuple[int, ...]:
        return tuple(c * self.unit for c in self.counts)

    @property
    def block(self) -> int:
        return max(self.counts) * self.unit

    def row_ranges(self) -> tuple[tuple[int, int], ...]:
        """The global batch rows [start, stop) each device trains on."""
        starts = np.concatenate([[0], np.cumsum(self.rows)])
        return tuple((int(a), int(b)) for a, b in zip(starts[:-1], starts[1:]))

    # -- shardings ------------------------------------------------------------------------------
    @functools.cached_property
    def param_shardings(self):
        return jax.tree.map(lambda _: NamedSharding(self.mesh, P()), self.param_shapes())

    @functools.cached_property
    def batch_shardings(self):
        return jax.tree.map(lambda _: NamedSharding(self.mesh, P(DATA)), self.batch_shapes())

    def param_shapes(self):
        invars = self.captured.jaxpr.jaxpr.invars[: self.captured.num_params]
        return jax.tree.unflatten(self.captured.params_tree,
                                  [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars])

    def batch_shapes(self):
        """Shapes of the padded batch the step takes."""
        invars = self.captured.jaxpr.jaxpr.invars[self.captured.num_params:]
        k = len(self.counts)
        return jax.tree.unflatten(self.captured.batch_tree, [
            jax.ShapeDtypeStruct((k * self.block,) + tuple(v.aval.shape[1:]), v.aval.dtype) for v in invars])

    def state_shardings(self):
        from whalex.lowering.step import opt_state_specs
        specs, _ = opt_state_specs(self.optimizer, self.param_shapes(),
                                   [P()] * self.captured.num_params)
        named = jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
        return TrainState(params=self.param_shardings, opt_state=named, step=NamedSharding(self.mesh, P()))

    def unpack_params(self, params):
        return params

    # -- the batch ------------------------------------------------------------------------------
    def pad_batch(self, batch):
        """Host-side: the global batch laid out in per-device padded blocks (numpy)."""
        k, block = len(self.counts), self.block

        def pad(x):
            x = np.asarray(x)
            if x.shape[0] != self.global_batch:
                from whalex.errors import PlanError
                raise PlanError(f"this step was planned for a global batch of {self.global_batch}, got "
                                f"{x.shape[0]}; call step.init with the new batch to re-plan.")
            out = np.zeros((k * block,) + x.shape[1:], x.dtype)
            for i, (a, b) in enumerate(self.row_ranges()):
                out[i * block:i * block + (b - a)] = x[a:b]
            return out

        return jax.tree.map(pad, batch)

    def place_batch(self, batch):
        padded = self.pad_batch(batch)
        return jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx]),
                            padded, self.batch_shardings)

    # -- the step -------------------------------------------------------------------------------
    def loss_and_grads(self):
        cap = self.captured
        evaluate = make_evaluator(cap.jaxpr, {}, self.mesh)
        counts = jnp.asarray(self.counts, jnp.int32)
        unit, total = self.unit, float(self.global_batch)
        has_aux = cap.has_aux

        def loss(params, batch):
            outs = evaluate(*jax.tree.leaves(params), *batch)
            return outs[0], outs[1:]

        vg = jax.value_and_grad(loss, has_aux=True)

        def body(params, batch):
            leaves = jax.tree.leaves(batch)
            n = counts[jax.lax.axis_index(DATA)]

            def chunk(k, acc):
                mb = [jax.lax.dynamic_slice_in_dim(x, k * unit, unit, 0) for x in leaves]
                (value, aux), grads = vg(params, mb)
                aux = [a * unit if jnp.issubdtype(a.dtype, jnp.floating) else jnp.zeros_like(a) for a in aux]
                return (acc[0] + value * unit, jax.tree.map(lambda a, g: a + g * unit, acc[1], grads),
                        [a + b for a, b in zip(acc[2], aux)])

            aux0 = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in cap.jaxpr.jaxpr.outvars[1:]]
            zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params), aux0)
            value, grads, aux = jax.lax.fori_loop(0, n, chunk, zero)
            value, grads, aux = jax.lax.psum((value, grads, aux), DATA)       # after the loop, never inside
            grads = jax.tree.map(lambda g: g / total, grads)
            aux = [a / total for a in aux]
            return value / total, grads, aux

        smap = jax.shard_map(body, mesh=self.mesh, in_specs=(P(), P(DATA)), out_specs=(P(), P(), P()),
                             check_vma=False)

        def run(params, batch):
            value, grads, aux = smap(params, batch)
            aux = jax.tree.unflatten(cap.aux_tree, aux) if has_aux else None
            return (value, aux), grads

        return run

    def train_step(self):
        loss_and_grads = self.loss_and_grads()
        optimizer = self.optimizer
        has_aux = self.captured.has_aux

        def step(state: TrainState, batch):
            (value, aux), grads = loss_and_grads(state.params, batch)
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            metrics = {"loss": value}
            if has_aux:
                metrics["aux"] = aux
            return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics

        return step

    def jitted(self, donate: bool = True):
        replicated = NamedSharding(self.mesh, P())
        if self.optimizer is None:
            lg = self.loss_and_grads()
            return jax.jit(lambda p, b: (lambda r: (r[0][0], r[1]))(lg(p, b)),
                           in_shardings=(self.param_shardings, self.batch_shardings),
                           out_shardings=(replicated, self.param_shardings))
        state = self.state_shardings()
        return jax.jit(self.train_step(), in_shardings=(state, self.batch_shardings),
                       out_shardings=(state, replicated), donate_argnums=(0,) if donate else ())

    def abstract_args(self):
        from whalex.lowering.step import opt_state_specs

        def sds(shapes, shardings):
            return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
        batch = sds(self.batch_shapes(), self.batch_shardings)
        params = sds(self.param_shapes(), self.param_shardings)
        if self.optimizer is None:
            return params, batch
        shardings = self.state_shardings()
        _, opt_shapes = opt_state_specs(self.optimizer, self.param_shapes(), [P()] * self.captured.num_params)
        state = TrainState(params=params, opt_state=sds(opt_shapes, shardings.opt_state),
                           step=jax.ShapeDtypeStruct((), jnp.int32, sharding=shardings.step))
        return state, batch

    def lower(self):
        return self.jitted(donate=False).trace(*self.abstract_args()).lower(lowering_platforms=(self.platform,))

    def init_state(self, params) -> TrainState:
        shardings = self.state_shardings()
        params = jax.device_put(jax.tree.map(lambda a: jnp.array(a, copy=True), params), shardings.params)
        opt_state = jax.jit(self.optimizer.init, out_shardings=shardings.opt_state)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
        return TrainState(params=params, opt_state=opt_state, step=step)
