"""Emission shared by every kind of step program: the optax update, `jax.jit` with the plan's
shardings, abstract arguments for lowering without devices, and placement of the state.

A program (collocated GSPMD, pipeline, uneven data parallel, uneven hybrid) provides its storage
shapes and shardings, `value_and_grad()` and `prepare_params()`; `Emitter` turns that into one
jitted step, and gives every program the rest of the `whalex.records.program.StepProgram` contract
(the state, the records for memory; the caller's layout from `caller_layout.CallerLayout`) with
defaults a program may override.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from whalex.distributed import place_global
from whalex.errors import PlanError
from whalex.jaxpr.capture import Captured
from whalex.loss.evaluation import PartLoss
from whalex.lowering import stage_rows
from whalex.lowering.caller_layout import CallerLayout
from whalex.memory import offload, zero
from whalex.memory.opt_state_specs import opt_state_specs
from whalex.precision import loss_scale
from whalex.records.comm import Comm
from whalex.records.memory_options import MemoryOptions, Precision, RematPlan
from whalex.records.program import StageBuffers, StateLayout, TracedStep
from whalex.records.sharding_plan import ExpertCall
from whalex.state import ParamView, TrainState


def with_shardings(shapes, shardings):
    """ShapeDtypeStructs carrying shardings, for `jit(...).trace` on abstract meshes."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def spread_spec(shape, mesh) -> P:
    """A spec putting 1/n of a leaf on each of the mesh's n devices: its largest dimension n divides
    (replicated when none does); the pipelines' stored leaves use the same rule (`stage_rows.spread`)."""
    return stage_rows.spread(shape, mesh.size, tuple(mesh.axis_names))


def step_inputs(state: TrainState) -> tuple[list, Any]:
    """The loss's inputs after the batch (model-state leaves, a fresh key) and the next rng."""
    extra = list(jax.tree.leaves(state.model_state)) if state.model_state is not None else []
    rng = state.rng
    if rng is not None:
        rng, key = jax.random.split(rng)
        extra.append(key)
    return extra, rng


def make_train_step(value_and_grad: Callable, optimizer, has_aux: bool, shard_update: Callable | None = None,
                    view: ParamView | None = None, fetch_opt_state: Callable | None = None,
                    fetch_params: Callable | None = None) -> Callable:
    """(state, batch) -> (state, metrics): gradients, then the optax update.

    `shard_update(params, grads) -> (params, grads)` lays both out for the update (ZeRO: each
    device updates only its shard); `fetch_opt_state(opt_state, grads)` brings an offloaded
    optimizer state to the device once the gradients are there, and `fetch_params(params, grads)`
    so the parameters offloaded per layer (the layers fetched them for the gradients themselves)."""

    def step(state: TrainState, batch):
        extra, rng = step_inputs(state)
        (value, aux, new_state), grads = value_and_grad(state.stored_params, batch, extra)
        params = state.stored_params if fetch_params is None else fetch_params(state.stored_params, grads)
        if shard_update is not None:
            params, grads = shard_update(params, grads)
        opt_state = state.opt_state if fetch_opt_state is None else fetch_opt_state(state.opt_state, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": value}
        if has_aux:
            metrics["aux"] = aux
        model_state = jax.tree.unflatten(jax.tree.structure(state.model_state), new_state) \
            if state.model_state is not None else None
        return TrainState(stored_params=params, opt_state=opt_state, step=state.step + 1, model_state=model_state,
                          rng=rng, view=view), metrics

    return step


class Emitter(CallerLayout):
    """The base of every step program (`whalex.records.program.StepProgram`). A program class (a frozen
    dataclass) declares the records below as its fields, and provides `param_shapes()`,
    `param_spec_list()`, `param_shardings`, `batch_shapes()`, `batch_shardings`, `value_and_grad()`
    and `has_aux`; the rest of the contract is here, with defaults it may override."""

    captured: Captured
    mesh: Any
    optimizer: optax.GradientTransformation | None
    platform: str
    memory: MemoryOptions | None           # None: no ZeRO, no offload
    precision: Precision | None
    remat: RematPlan | None
    parts: PartLoss | None

    if TYPE_CHECKING:                      # what each program class provides, for type checkers only
        def param_shapes(self) -> Any: ...
        def param_spec_list(self) -> list: ...
        def batch_shapes(self) -> Any: ...
        def value_and_grad(self) -> Callable: ...
        @property
        def param_shardings(self) -> Any: ...
        @property
        def batch_shardings(self) -> Any: ...
        @property
        def has_aux(self) -> bool: ...

    @property
    def experts(self) -> tuple[ExpertCall, ...]:
        """MoE calls run expert-parallel (none by default)."""
        return ()

    def row_ranges(self) -> tuple[tuple[int, int], ...] | None:
        """The global batch rows [start, stop) each device trains on; None: even rows in device order."""
        return None

    def stage_buffers(self) -> StageBuffers | None:
        """A pipeline's per-device buffers; None for other programs."""
        return None

    def comm_report(self) -> dict | None:
        """comm_dtype: per TaskGraph, the mesh axes its gradients are summed over in the comm dtype
        and why not; None where the program runs no comm_dtype segments."""
        return None

    def collectives(self) -> tuple[Comm, ...]:
        """The collectives one step runs as this program lowers it, per device; none reported by default
        (the GSPMD and the pipeline programs report theirs)."""
        return ()

    def prepass(self) -> tuple[Callable, Callable]:
        """The loss contract's pre-pass alone as a jitted program, and a null program of the same inputs
        (for measuring its cost): programs that run the loss in parts override it."""
        raise PlanError(f"a {type(self).__name__} evaluates the loss whole: it has no pre-pass to run alone.")

    def prepare_params(self, params):
        """The caller's parameters in this program's storage layout (identity by default)."""
        return params

    def unpack_params(self, params):
        """The caller's parameter pytree from the storage layout (identity by default)."""
        return params

    def param_layout(self) -> str | None:
        """What the storage layout is when it is not the caller's pytree (None: it is)."""
        return None

    @functools.cached_property
    def param_view(self) -> ParamView | None:
        """How `TrainState.params` reads and writes the caller's pytree under this plan's layout."""
        layout = self.param_layout()
        if layout is None:
            return None
        compute = self._compute_param_shardings()
        offloaded = self.memory_options.offloads("params")
        read = lambda p: self.unpack_params(offload.fetch(p, compute) if offloaded else p)  # noqa: E731
        # each caller leaf spread over every device (its largest divisible dimension): one copy of the
        # parameters in all, and faster to produce than replicated leaves (bench/params_view.py)
        spread = lambda s: NamedSharding(self.mesh, spread_spec(s.shape, self.mesh))  # noqa: E731
        unpack = jax.jit(read, out_shardings=jax.tree.map(spread, jax.eval_shape(self.unpack_params,
                                                                                 self.param_shapes())))
        pack = jax.jit(self.prepare_params, out_shardings=compute)

        def pack_placed(params):
            stored = pack(params)
            return jax.device_put(stored, offload.on_host(compute)) if offloaded else stored

        return ParamView(unpack=unpack, pack=pack_placed, layout=layout)

    # -- memory options (ZeRO, offload): whalex/memory ----------------------------------------
    @property
    def memory_options(self) -> MemoryOptions:
        return self.memory or MemoryOptions()

    def zero_specs(self) -> list:
        """Per stored parameter leaf: its planned spec, sharded over its data-parallel axes by ZeRO."""
        opts = self.memory_options
        specs = self.param_spec_list()
        if opts.zero_level == 0 or opts.zero_axes is None:
            return specs
        return zero.shard_specs(specs, jax.tree.leaves(self.param_shapes()), opts.zero_axes, dict(self.mesh.shape))

    def _param_named(self, specs):
        return jax.tree.unflatten(jax.tree.structure(self.param_shapes()),
                                  [NamedSharding(self.mesh, s) for s in specs])

    def opt_state_spec_tree(self, param_specs):
        """PartitionSpecs of the optimizer state: parts shaped like the parameters follow `param_specs`."""
        return opt_state_specs(self.optimizer, self.param_shapes(), param_specs)[0]

    def _compute_param_shardings(self):
        """Where the stored parameters live while the step computes (ZeRO 3: sharded)."""
        return self._param_named(self.zero_specs()) if self.memory_options.zero_level >= 3 else self.param_shardings

    def compute_shardings(self) -> TrainState:
        """Where the state lives while the step computes (device memory): ZeRO layouts."""
        level = self.memory_options.zero_level
        zspecs = self.zero_specs()
        params = self._compute_param_shardings()
        opt = None
        if self.optimizer is not None:
            specs = self.opt_state_spec_tree(zspecs if level >= 1 else self.param_spec_list())
            opt = jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
        rep = NamedSharding(self.mesh, P())
        cap = self.captured
        ms = rng = None
        if cap.state_tree is not None:
            ms = jax.tree.unflatten(cap.state_tree, [rep] * cap.num_state)
        if cap.rng is not None:
            rng = rep
        return TrainState(stored_params=params, opt_state=opt, step=rep, model_state=ms, rng=rng, view=self.param_view)

    def state_shardings(self) -> TrainState:
        """Where the state is stored between steps: the compute layout, offloaded parts on the host."""
        s = self.compute_shardings()
        opts = self.memory_options
        return s.replace(stored_params=offload.on_host(s.stored_params) if opts.offloads("params") else s.stored_params,
                         opt_state=offload.on_host(s.opt_state) if opts.offloads("opt_state") else s.opt_state,
                         loss_scale=self._loss_scale(lambda _: s.step))

    @property
    def fetch_shardings(self) -> tuple | None:
        """offload="params" per layer: each parameter's compute sharding, where each layer fetches
        it; None (the default) where the whole tree is fetched at the start of the step."""
        return None

    def _fetch(self, state: TrainState) -> TrainState:
        """Inside the step: offloaded parts of the state moved to device memory (parameters offloaded
        per layer stay: the layers and the update fetch them)."""
        opts = self.memory_options
        if not opts.offload:
            return state
        compute = self.compute_shardings()
        if opts.offloads("params") and self.fetch_shardings is None:
            state = state.replace(stored_params=offload.fetch(state.stored_params, compute.stored_params))
        return state                 # the optimizer state is fetched at the update (`_fetch_opt_state`)

    def _fetch_opt_state(self) -> Callable | None:
        """offload="opt_state": (opt_state, grads) -> the state in device memory, each leaf moved
        once its gradient is computed (whalex.memory.offload.fetch_when_ready)."""
        if not self.memory_options.offloads("opt_state"):
            return None
        compute, per_leaf = self.compute_shardings().opt_state, offload.fetch_per_leaf(self.mesh.size)
        return lambda opt_state, grads: offload.fetch_when_ready(opt_state, compute, grads, per_leaf)

    def _fetch_params(self) -> Callable | None:
        """Parameters offloaded per layer: (params, grads) -> the parameters in device memory for the
        update, each leaf once its gradient is computed."""
        if self.fetch_shardings is None:
            return None
        compute, per_leaf = self.compute_shardings().stored_params, offload.fetch_per_leaf(self.mesh.size)
        return lambda params, grads: offload.fetch_when_ready(params, compute, grads, per_leaf)

    def _shard_update(self):
        """ZeRO 1/2: (params, grads) -> the same on each device's shard (3: already sharded)."""
        level = self.memory_options.zero_level
        if level == 0:
            return None
        shards = self._param_named(self.zero_specs())

        def shard_update(params, grads):
            if level >= 2:
                grads = jax.lax.with_sharding_constraint(grads, shards)
            if level < 3:
                params = jax.lax.with_sharding_constraint(params, shards)
            return params, grads

        return shard_update

    def _loss_scale(self, leaf: Callable):
        """amp="fp16": the dynamic loss scale with `leaf(initial array)` at each leaf; else None."""
        prec = self.precision
        if prec is None or not prec.scaled:
            return None
        return jax.tree.map(leaf, loss_scale.LossScale.initial())

    def train_step(self) -> Callable:
        def build(value_and_grad):
            return make_train_step(value_and_grad, self.optimizer, self.has_aux, self._shard_update(), self.param_view,
                                   self._fetch_opt_state(), self._fetch_params())

        prec = self.precision
        if prec is not None and prec.scaled:     # fp16: dynamic loss scaling, non-finite steps skipped
            inner = loss_scale.loss_scaled_step(self.value_and_grad(), build, prec.period)
        else:
            inner = build(self.value_and_grad())
        if not self.memory_options.offload:
            return inner
        return lambda state, batch: inner(self._fetch(state), batch)

    def grad_step(self) -> Callable:
        value_and_grad = self.value_and_grad()
        opts = self.memory_options
        grads_out = self._param_named(self.zero_specs()) if opts.zero_level >= 2 else None

        def step(params, batch):
            if opts.offloads("params") and self.fetch_shardings is None:
                params = offload.fetch(params, self.compute_shardings().stored_params)
            (value, _, _), grads = value_and_grad(params, batch, [])
            if grads_out is not None:
                grads = jax.lax.with_sharding_constraint(grads, grads_out)
            return value, grads

        return step

    def stored_param_shardings(self):
        s = self.compute_shardings().stored_params
        return offload.on_host(s) if self.memory_options.offloads("params") else s

    def jitted(self, donate: bool = True):
        """The jitted training step, or a loss-and-gradient step when there is no optimizer."""
        replicated = NamedSharding(self.mesh, P())
        if self.optimizer is None:
            grads = self._param_named(self.zero_specs()) if self.memory_options.zero_level >= 2 \
                else self.param_shardings
            return jax.jit(self.grad_step(), in_shardings=(self.stored_param_shardings(), self.batch_shardings),
                           out_shardings=(replicated, grads))
        state = self.state_shardings()
        return jax.jit(self.train_step(), in_shardings=(state, self.batch_shardings),
                       out_shardings=(state, replicated), donate_argnums=(0,) if donate else ())

    def abstract_args(self):
        """ShapeDtypeStructs with shardings for every argument of the jitted step."""
        batch = with_shardings(self.batch_shapes(), self.batch_shardings)
        params = with_shardings(self.param_shapes(), self.stored_param_shardings())
        if self.optimizer is None:
            return params, batch
        shardings = self.state_shardings()
        _, opt_shapes = opt_state_specs(self.optimizer, self.param_shapes(), self.param_spec_list())
        cap = self.captured
        ms = rng = None
        if cap.state_tree is not None:
            invars = cap.jaxpr.jaxpr.invars
            start = cap.num_params + len(cap.batch_vars)
            ms = jax.tree.unflatten(cap.state_tree, [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                                                                          sharding=shardings.step)
                                                     for v in invars[start:start + cap.num_state]])
        if cap.rng is not None:
            rng = jax.ShapeDtypeStruct(cap.rng.shape, cap.rng.dtype, sharding=shardings.step)
        state = TrainState(stored_params=params, opt_state=with_shardings(opt_shapes, shardings.opt_state),
                           step=jax.ShapeDtypeStruct((), jnp.int32, sharding=shardings.step),
                           loss_scale=self._loss_scale(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                                      sharding=shardings.step)),
                           model_state=ms, rng=rng, view=self.param_view)
        return state, batch

    def lower(self):
        return self.jitted(donate=False).trace(*self.abstract_args()).lower(lowering_platforms=(self.platform,))

    # -- plain records for memory and balance (never the program itself) ----------------------------
    def state_layout(self) -> StateLayout:
        """The stored state's shapes, specs, optimizer and memory options."""
        return StateLayout(self.param_shapes(), tuple(self.param_spec_list()), tuple(self.zero_specs()),
                           self.optimizer, self.memory_options, dict(self.mesh.shape), self.platform)

    def traced_step(self) -> TracedStep:
        """The step as `wh.parallelize` runs it (the state donated; without an optimizer, the
        loss-and-gradient step) traced at its abstract arguments."""
        args = self.abstract_args()
        if self.optimizer is None:
            fn, donated = self.grad_step(), 0
        else:
            fn, donated = self.train_step(), len(jax.tree.leaves(args[0]))
        return TracedStep(jax.make_jaxpr(fn)(*args), tuple(args), donated, dict(self.mesh.shape), self.platform)

    def place_batch(self, batch):
        return place_global(batch, self.batch_shardings)     # multi-process: each reads its own rows

    def init_state(self, params, model_state=None, rng=None) -> TrainState:
        """Place params (a copy: the step donates its state), a fresh optimizer state, the model
        state and the rng key."""
        shardings, compute = self.state_shardings(), self.compute_shardings()
        params = self.prepare_params(jax.tree.map(lambda a: jnp.array(a, copy=True), params))
        params = jax.device_put(params, compute.stored_params)
        opt_state = jax.jit(self.optimizer.init, out_shardings=shardings.opt_state)(params)
        if self.memory_options.offloads("params"):
            params = jax.device_put(params, shardings.stored_params)
        step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
        copy = lambda t: jax.tree.map(lambda a: jnp.array(a, copy=True), t)  # noqa: E731
        model_state = jax.device_put(copy(model_state), shardings.model_state) if model_state is not None else None
        rng = jax.device_put(copy(rng), shardings.rng) if rng is not None else None
        return TrainState(stored_params=params, opt_state=opt_state, step=step,
                          loss_scale=self._loss_scale(lambda x: jax.device_put(x, shardings.step)),
                          model_state=model_state, rng=rng, view=self.param_view)
