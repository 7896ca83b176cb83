"""Emission: one jitted training step (loss, gradients, optax update) with the plan's shardings."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from whalex.jaxpr.capture import Captured
from whalex.loss import evaluation as parts_lib
from whalex.loss.evaluation import PartLoss
from whalex.lowering.emit import Emitter
from whalex.lowering.groups import ShardGroups, grouped_evaluator, same_outputs
from whalex.lowering.padding import EvenPadding
from whalex.memory import zero, zero_sharded
from whalex.memory.remat import program_evaluator
from whalex.precision.loss_scale import unscale, value_and_grad as scaled_value_and_grad
from whalex.records.comm import Comm
from whalex.records.memory_options import MemoryOptions, Precision, RematPlan
from whalex.records.program import step_program
from whalex.records.sharding_plan import ExpertCall, ShardingPlan


@step_program
@dataclasses.dataclass(frozen=True)
class Program(Emitter):
    """Everything needed to run or lower the planned step on one mesh."""

    captured: Captured
    sharding: ShardingPlan
    mesh: Any
    optimizer: optax.GradientTransformation | None
    platform: str
    num_micro_batch: int = 1     # > 1: gradient accumulation over micro-batches (captured at micro size)
    overrides: Any = None        # path -> function replacing that equation (uneven split head)
    padded: Any = None           # param leaf -> (UnevenColumns | EvenPadding, axis): stored padded per device
    memory: MemoryOptions | None = None     # ZeRO level, offload
    precision: Precision | None = None      # amp, comm_dtype
    remat: RematPlan | None = None          # per-TaskGraph remat, activation offload
    parts: PartLoss | None = None           # the loss contract over micro-batches
    group_axis: str | None = None           # micro-batches: gradients kept per shard of this mesh axis in
                                            # the loop (parts: one shard's rows), summed once after it
    shard_groups: ShardGroups | None = None  # ... and per model shard for these TaskGraphs (collocated hybrid)
    shard_parts: PartLoss | None = None     # the loss contract at one model shard's rows of a part

    @property
    def experts(self) -> tuple[ExpertCall, ...]:
        return self.sharding.experts

    def collectives(self) -> tuple[Comm, ...]:
        """The sharding patterns' collectives as this step runs them: ZeRO's in place of the gradient
        sums it shards, and with micro-batches those of the loop once per micro-batch, except the
        gradient sums over the axes summed once after it (`group_axis`, `shard_groups`)."""
        cap, level = self.captured, self.memory_options.zero_level
        comms = self.sharding.comms
        if level:
            owner = {path: next((t.index for t in cap.taskgraphs if i in t.params), 0)
                     for i, path in enumerate(cap.param_paths)}
            comms = zero.comms(comms, level, zero_sharded(self.state_layout(), cap.param_paths), owner)
        if self.num_micro_batch > 1:
            once = ((self.group_axis,) if self.group_axis else ()) + \
                (tuple(self.shard_groups.axes) if self.shard_groups is not None else ())
            comms = per_step(comms, self.num_micro_batch, once)
        return tuple(comms)

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
        invars = self.captured.batch_vars
        m = self.num_micro_batch
        return jax.tree.unflatten(self.captured.batch_tree, [
            jax.ShapeDtypeStruct((v.aval.shape[0] * m,) + tuple(v.aval.shape[1:]), v.aval.dtype) for v in invars])

    @property
    def has_aux(self) -> bool:
        return self.captured.has_aux

    def param_spec_list(self):
        return list(self.sharding.param_specs)

    def prepare_params(self, params):
        return self.pad_params(params)

    def _map_padded(self, params, how: str):
        """Apply UnevenColumns.pad or .unpad to the uneven-split leaves, leave the rest."""
        if not self.padded:
            return params
        leaves, tree = jax.tree.flatten(params)
        return jax.tree.unflatten(tree, [getattr(self.padded[i][0], how)(x, self.padded[i][1])
                                         if i in self.padded else x for i, x in enumerate(leaves)])

    def pad_params(self, params):
        return self._map_padded(params, "pad")

    def unpack_params(self, params):
        """The caller's parameter pytree (uneven split leaves without their padding)."""
        return self._map_padded(params, "unpad")

    def param_layout(self):
        return "padded uneven shards" if self.padded else None

    def compute_params(self, params):
        """The stored parameters as the model reads them: evenly padded leaves sliced back to their
        own size, keeping their sharding (the uneven head's leaves stay padded: its override reads them)."""
        even = {i: v for i, v in (self.padded or {}).items() if isinstance(v[0], EvenPadding)}
        if not even:
            return params
        leaves, tree = jax.tree.flatten(params)
        for i, (layout, axis) in even.items():
            leaves[i] = jax.lax.with_sharding_constraint(layout.unpad(leaves[i], axis),
                                                         NamedSharding(self.mesh, self.sharding.param_specs[i]))
        return jax.tree.unflatten(tree, leaves)

    # -- the functions -----------------------------------------------------------------------
    @functools.cached_property
    def fetch_shardings(self) -> tuple | None:
        """offload="params" per layer: each parameter's compute sharding, where each layer fetches
        it (`whalex.memory.offload.fetch_leaf`). None where the whole tree is fetched at the start of
        the step instead: micro-batches, a padded or ZeRO-3 storage layout, comm_dtype segments, a
        parameter the loss returns as it is."""
        cap, prec = self.captured, self.precision
        params = cap.jaxpr.jaxpr.invars[: cap.num_params]
        if (not self.memory_options.offloads("params") or self.num_micro_batch != 1 or self.padded
                or self.memory_options.zero_level >= 3 or (prec is not None and prec.comm is not None)
                or self.remat is None or any(v in params for v in cap.jaxpr.jaxpr.outvars)):
            return None
        return tuple(jax.tree.leaves(self.param_shardings))

    def loss(self) -> Callable:
        """loss(params, (batch, extra)) -> (loss, aux) evaluated with the plan's constraints. With
        per-layer parameter fetches, loss(deltas, (batch, extra, host params)): the gradient is the
        deltas' (zeros on the device, added to each fetched parameter)."""
        cap = self.captured
        evaluate = self.evaluator()[0]
        gather = self.param_shardings if self.memory_options.zero_level >= 3 else None
        fetch = self.fetch_shardings is not None

        def loss(params, inputs):
            batch, extra = inputs[:2]
            if fetch:
                args = list(zip(jax.tree.leaves(inputs[2]), jax.tree.leaves(params)))
            else:
                if gather is not None:       # ZeRO 3: stored sharded, gathered where used
                    params = jax.lax.with_sharding_constraint(params, gather)
                args = jax.tree.leaves(self.compute_params(params))
            outs = evaluate(*args, *jax.tree.leaves(batch), *extra)
            value, aux, new_state = cap.split_outputs(outs)
            return value, (aux, new_state)

        return loss

    def evaluator(self):
        """(evaluate, comm report): the captured loss with the plan's constraints, remat and comm dtype."""
        return program_evaluator(self.captured, self.sharding.constraints, self.mesh, self.overrides, self.remat,
                                 self.precision, self.fetch_shardings)

    def comm_report(self) -> dict | None:
        return self.evaluator()[1] if self.precision is not None and self.precision.comm else None

    def value_and_grad(self) -> Callable:
        """(params, batch, extra[, loss scale]) -> ((loss, aux, new model state), grads); with
        micro-batches, a loop over them that keeps the whole-batch meaning of the loss."""
        grad_shardings = self._param_named(self.zero_specs()) if self.memory_options.zero_level >= 2 \
            else self.param_shardings
        m = self.num_micro_batch
        if m == 1:
            vg = scaled_value_and_grad(self.loss())
            fetch = self.fetch_shardings

            def plain(params, batch, extra=(), scale=None):
                if fetch is not None:        # params stay on the host; the gradient is the deltas'
                    deltas = jax.tree.map(lambda x, s: jnp.zeros(x.shape, x.dtype, device=s), params,
                                          self.param_shardings)
                    (value, (aux, new_state)), grads = vg(deltas, (batch, list(extra), params), scale)
                else:
                    (value, (aux, new_state)), grads = vg(params, (batch, list(extra)), scale)
                return (value, aux, new_state), jax.lax.with_sharding_constraint(grads, grad_shardings)
            return plain
        pl = self.parts
        ptree = self.captured.params_tree
        evaluator_for = self._part_evaluator
        gather = self.param_shardings if self.memory_options.zero_level >= 3 else None

        def accumulate(params, batch, extra=(), scale=None):
            if gather is not None:       # ZeRO 3: stored sharded, gathered where used
                params = jax.lax.with_sharding_constraint(params, gather)
            params, stored_grads = jax.vjp(self.compute_params, params)
            loop, across, map_parts = self.parts_driver(jax.tree.leaves(batch))
            outs, grads = parts_lib.value_and_grad(pl, evaluator_for, loop, across, self._part_params(params),
                                                   list(extra), scale, map_parts)
            if self.group_axis is not None:        # the one gradient reduction of the step
                copied = self.shard_groups.copied if self.shard_groups is not None else ()
                grads = [(g.reshape((-1,) + g.shape[2:]) if i in copied else g).sum(0) for i, g in enumerate(grads)]
            grads = stored_grads(jax.tree.unflatten(ptree, grads))[0]
            if scale is not None:
                grads = unscale(grads, scale)
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
            value, aux, new_state = self.captured.split_outputs(outs)
            return (value, aux, new_state), grads

        return accumulate

    # -- the micro-batches (gradient accumulation) ----------------------------------------------------
    def _part_evaluator(self, cap, overrides):
        """The captured loss of one micro-batch with the plan's constraints and remat, `overrides` added."""
        constraints = self.sharding.constraints
        if self.group_axis is not None:            # evaluated under vmap over the shards of group_axis
            constraints = {k: _without(spec, self.group_axis) for k, spec in constraints.items()}
        overrides = {**(self.overrides or {}), **overrides}
        draws = frozenset(d[0] for d in self.parts.draws) if self.group_axis is not None else frozenset()
        overrides = {p: _key_per_shard(f) if p in draws else f for p, f in overrides.items()}
        g = self.shard_groups
        if g is not None:
            inner = {k: functools.reduce(_without, g.axes, spec) for k, spec in constraints.items()}
            return grouped_evaluator(cap, same_outputs(cap, self.shard_parts), g, constraints, inner, self.mesh,
                                     overrides, self.captured.num_params, draws, self.remat)
        return program_evaluator(cap, constraints, self.mesh, overrides, self.remat, None)[0]

    def _part_params(self, params) -> list:
        """The parameter leaves the parts read: with shard groups, a copied leaf as one copy per model
        shard ([size, ...], sharded over the model axes), so its gradient stays per shard."""
        leaves, g = jax.tree.leaves(params), self.shard_groups
        if g is None:
            return leaves
        axes = g.axes if len(g.axes) > 1 else g.axes[0]

        def copy(x, spec):
            y = jnp.broadcast_to(x, (g.size,) + x.shape)
            return jax.lax.with_sharding_constraint(y, NamedSharding(self.mesh, P(axes, *spec)))
        return [copy(x, s) if i in g.copied else x for i, (x, s) in enumerate(zip(leaves, self.sharding.param_specs))]

    def parts_driver(self, leaves):
        """For the global batch `leaves`: (loop, across, map_parts) over the micro-batches, as
        `whalex.loss.evaluation.value_and_grad` takes them. loop(fn, init) scans acc = fn(part, where, acc)
        over them; map_parts(g, kinds) evaluates g on every micro-batch at once (vmap), or is None.

        One row grouping for every leaf (so x_i stays with y_i): micro-batch k takes the k-th chunk of
        each of the `dp` finest row blocks, which is local for every leaf's sharding. With `group_axis`,
        each micro-batch is cut again into one part per shard of that axis (see `_grouped`)."""
        m, specs, mesh = self.num_micro_batch, self.sharding.batch_specs, self.mesh
        dp = max([_shards(s, mesh) for s in specs] + [1])

        def split(x, spec):
            b = x.shape[0]
            y = x.reshape((dp, m, b // (dp * m)) + x.shape[1:]).swapaxes(0, 1).reshape((m, b // m) + x.shape[1:])
            return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, *spec)))

        micro = [split(x, s) for x, s in zip(leaves, specs)]
        b = leaves[0].shape[0]
        c = b // (dp * m)
        if self.group_axis is not None:
            return self._grouped(micro, b, dp, c) + (None,)

        def rows_of(k):            # the global rows micro-batch k holds: c rows of each of dp blocks
            return tuple((j * (b // dp) + k * c, c) for j in range(dp))

        def loop(fn, init):
            def body(acc, xs):
                k, mb = xs
                return fn(mb, rows_of(k), acc), None
            return jax.lax.scan(body, init, (jnp.arange(m), micro))[0]

        def map_parts(g, kinds):   # the pre-pass: every micro-batch at once, one reduction
            return jax.vmap(lambda k, mb: g(mb, rows_of(k)))(jnp.arange(m), micro)

        return loop, _across, map_parts

    def _grouped(self, micro, b, dp, c):
        """(loop, across) keeping every accumulator per shard of `group_axis`: a leading dimension of
        its size, sharded over it. The loop body evaluates the parts of one micro-batch (shard j: the
        rows of its dp/G finest blocks) under vmap with that axis as its SPMD axis, so no gradient
        leaves a shard inside the loop; `across` combines the shards once, after it."""
        axis, mesh, m = self.group_axis, self.mesh, self.num_micro_batch
        g = int(mesh.shape[axis])
        per = dp // g
        inner = [_without(s, axis) for s in self.sharding.batch_specs]

        def parts(x, spec):        # one micro-batch leaf -> [g, rows / g, ...], shard j on shard j
            y = x.reshape((g, x.shape[0] // g) + x.shape[1:])
            return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(axis, *spec)))

        def stacked(a):            # an accumulator, one per shard
            y = jnp.broadcast_to(a, (g,) + a.shape)
            return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(axis, *[P.UNCONSTRAINED] * a.ndim)))

        def loop(fn, init):
            def one(part, starts, acc):
                return fn(part, tuple((starts[i], c) for i in range(per)), acc)

            def body(acc, xs):
                k, mb = xs
                starts = (jnp.arange(g)[None, :] * per + jnp.arange(per)[:, None]) * (b // dp) + k * c
                run = jax.vmap(one, in_axes=(0, 1, 0), axis_name=_SHARDS, spmd_axis_name=axis)
                return run([parts(x, s) for x, s in zip(mb, inner)], starts, acc), None
            return jax.lax.scan(body, jax.tree.map(stacked, init), (jnp.arange(m), micro))[0]

        def across(values, kinds):
            return [_combine_shards(v, k) for v, k in zip(values, kinds)]

        return loop, across

    def prepass(self):
        """The loss contract's pre-pass alone over the micro-batches (its batch-only reductions, e.g. a
        token count), jitted with the step's shardings, and a null program of the same inputs."""
        if self.num_micro_batch == 1 or self.parts is None:
            return super().prepass()

        def fn(params, batch):
            loop, across, map_parts = self.parts_driver(jax.tree.leaves(batch))
            given = parts_lib.prepass(self.parts, self._part_evaluator, loop, across, self._part_params(params), [],
                                      map_parts=map_parts)
            return [v for vals in given.values() for v in vals]

        ins = (self.param_shardings, self.batch_shardings)
        return jax.jit(fn, in_shardings=ins), jax.jit(_null, in_shardings=ins)


def _across(values, kinds):
    """Combining the parts' values over devices: nothing to do, one GSPMD program spans the mesh."""
    return values


_SHARDS = "whalex_data_shards"      # the vmap axis of the data shards (see Program._grouped)


def _key_per_shard(fn):
    """A random draw's override whose key is mapped along the data shards like its row offsets:
    XLA:CPU's threefry loop carries the two key words and fails when one is mapped and one is not."""
    def run(key, *rest):
        zero = (jax.lax.axis_index(_SHARDS) * 0).astype(jnp.uint32)
        data = jax.random.key_data(key) + zero
        return fn(jax.random.wrap_key_data(data, impl=jax.random.key_impl(key)), *rest)
    return run


def _combine_shards(x, kind):
    """A per-shard accumulator (leading dimension) combined over the shards, by its kind."""
    if kind == "min":
        return jnp.min(x, 0)
    if kind == "max" or x.dtype == jnp.bool_:      # a bool sum accumulates as `or`
        return jnp.max(x, 0)
    return jnp.sum(x, 0).astype(x.dtype)


def _without(spec, axis: str):
    """`spec` with the mesh axis `axis` taken out of every dimension."""
    def clean(entry):
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        kept = tuple(a for a in names if a != axis)
        return None if not kept else (kept[0] if len(kept) == 1 else kept)
    return P(*[e if e is P.UNCONSTRAINED else clean(e) for e in spec])


def _shards(spec, mesh) -> int:
    """Devices the leading dimension of `spec` is spread over."""
    axes = spec[0] if len(spec) else None
    axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def _null(params, batch):
    """A program of the step's inputs that reads one parameter element and runs no collective."""
    return [jax.tree.leaves(params)[0].ravel()[0]]


def per_step(comms, m: int, once: tuple) -> list:
    """The collectives per step of a loop over `m` micro-batches: gradient sums over the `once` axes
    alone run once, after the loop; every other collective once per micro-batch."""
    out = []
    for c in comms:
        axes = tuple(c.axes) if isinstance(c.axes, (tuple, list)) else (c.axes,)
        grad = c.reason.startswith("gradient sync") and axes and set(axes) <= set(once)
        out.append(c if grad else dataclasses.replace(c, bytes=c.bytes * m))
    return out
