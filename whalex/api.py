"""Public entry points: `wh.plan` and `wh.parallelize` (and the `Step` it returns).

annotations -> capture (TaskGraphs) -> mesh + VirtualDevices -> sharding patterns -> Plan ->
one jitted step. The plan is built by `whalex.planner`; this module is the thin public face.
"""
from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np
import optax

from whalex import nnx as nnx_lib
from whalex.distributed import heartbeat
from whalex.errors import PlanError
from whalex.lowering.stage_batch import StageBatch
from whalex.mesh.cluster import Cluster
from whalex.nnx import NnxModel
from whalex.plan import Plan
from whalex.planner import build_plan
from whalex.planner.common import check_optimizer
from whalex.primitives.config import Config
from whalex.refining import Refiner, refinable
from whalex.state import TrainState
from whalex.validate import check_placeable


def plan(loss_fn: Callable, params, batch, optimizer=None, config=None, cluster=None,
         has_aux: bool = False, model_state=None, rng=None) -> Plan:
    """Plan `loss_fn(params, batch)` for a cluster without running it (abstract clusters too);
    `model_state` / `rng` as in `Step.init`, and `params` may be an NNX module."""
    if nnx_lib.is_module(params):
        nm, params, model_state = nnx_lib.NnxModel.split(params)
        loss_fn = nm.wrap(loss_fn, has_aux)
    return build_plan(loss_fn, params, batch, optimizer, config, cluster, has_aux, model_state, rng)


_DELETED = operator.methodcaller("is_deleted")
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")


def _signature(leaves) -> tuple:
    """The shapes and dtypes of `leaves` (attribute reads for arrays; numpy's view of scalars and lists)."""
    try:
        return tuple(map(_SHAPE, leaves)), tuple(map(_DTYPE, leaves))
    except AttributeError:
        return tuple(map(np.shape, leaves)), tuple(np.asarray(x).dtype for x in leaves)


def _check_not_donated(leaves) -> None:
    """Refuse a state (its leaves) whose buffers an earlier step consumed: the jitted step donates its
    state, and running it again on donated buffers crashes the process instead of raising."""
    try:
        deleted = any(map(_DELETED, leaves))          # every leaf a jax.Array: one C-level pass
    except AttributeError:
        deleted = any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves)
    if deleted:
        raise PlanError("this state was consumed by an earlier step (the step donates its state argument, so its "
                        "arrays are deleted); use the state returned by that step: state, metrics = step(state, "
                        "batch). If you re-ran a notebook cell, re-run step.init(params, batch) first.")


class _LastCall(NamedTuple):
    """The last call of a `Step`: the state it returned (weakly held), the batch's tree and signature,
    and the plan and jitted step it ran. A call with that very state and a batch that looks the same
    runs the same step without re-deriving it from the state's leaves."""

    state: weakref.ref
    batch_tree: object
    batch_signature: tuple
    plan: Plan
    jitted: Callable


class Step:
    """A parallelized training step: `state = step.init(params, batch)`, `state, metrics = step(state, batch)`."""

    def __init__(self, loss_fn, optimizer, has_aux=False, config=None, cluster=None):
        check_optimizer(optimizer)
        if optimizer is None:
            raise PlanError("wh.parallelize needs an optax optimizer, e.g. optax.adam(1e-3).")
        self.loss_fn, self.optimizer, self.has_aux = loss_fn, optimizer, has_aux
        self._config, self._cluster = config, cluster
        self._plans: dict = {}
        self._jitted: dict = {}
        self._last: Plan | None = None
        self._nnx: NnxModel | None = None        # step.init(nnx_module, batch): the module's static structure
        self._last_call: _LastCall | None = None  # the fast path of __call__
        self._refiners: dict = {}                 # plan key -> the Refiner of Config(hardware_aware="refine")

    @property
    def plan(self) -> Plan:
        if self._last is None:
            raise PlanError("the step has no plan yet: call step.init(params, example_batch) first.")
        return self._last

    def _key(self, params, batch):
        leaves, tree = jax.tree.flatten((params, batch))
        return tree, _signature(leaves)

    def _plan_for(self, params, batch, model_state=None, rng=None) -> Plan:
        key = self._key(params, batch)
        if key not in self._plans:
            loss_fn = self._nnx.wrap(self.loss_fn, self.has_aux) if self._nnx is not None else self.loss_fn
            p = build_plan(loss_fn, params, batch, self.optimizer, self._config, self._cluster, self.has_aux,
                           model_state, rng)
            if p.cluster.is_abstract or p.cluster.compile_only:
                what = "an abstract cluster can plan and lower" if p.cluster.is_abstract else \
                    "a Cluster.gpu_topology cluster can plan, lower and compile"
                raise PlanError(f"{what} but not run; use wh.plan(...) with it, or Cluster.detect() / "
                                "Cluster(kinds=...) to train.")
            self._plans[key] = p
            self._jitted[key] = p.jitted()
            self._last_call = None
            if p.config.hardware_aware == "refine" and refinable(p):
                self._refiners[key] = Refiner(p, lambda c: build_plan(
                    loss_fn, params, batch, self.optimizer, self._config, c, self.has_aux, model_state, rng))
        self._last = self._plans[key]
        return self._plans[key]

    def init(self, params, example_batch, model_state=None, rng=None) -> TrainState:
        """Plan for these shapes and place params, optimizer state, model state and rng per the plan.

        With `model_state` (non-trainable collections, e.g. {'batch_stats': ...}), loss_fn is called as
        loss_fn(params, batch, model_state=ms) and returns (loss, new_model_state); with `rng`, it gets
        rng=key, a fresh key every step.

        `params` may be a Flax NNX module (`model.train()` first): loss_fn is then loss_fn(model, batch);
        its nnx.Params are trained, every other variable (BatchStat, RngState...) is model state, and
        `step.model(state)` gives the module back."""
        check_placeable(params=params, model_state=model_state, rng=rng)     # before anything is planned or placed
        p, params, model_state = self._prepare(params, example_batch, model_state, rng)
        return self._adopt(p.init_state(params, model_state, rng), params, example_batch)

    def _prepare(self, params, example_batch, model_state=None, rng=None):
        """Plan for these shapes without placing anything: (plan, params, model_state), an NNX module
        split into its params and model state. `params` may be jax.ShapeDtypeStructs."""
        if nnx_lib.is_module(params):
            if model_state is not None:
                raise PlanError("step.init(model, batch) with an NNX module takes its model state from the module; "
                                "do not pass model_state=.")
            self._nnx, params, model_state = nnx_lib.NnxModel.split(params)
        return self._plan_for(params, example_batch, model_state, rng), params, model_state

    def _adopt(self, state: TrainState, params, example_batch) -> TrainState:
        """Register `state`, placed per the plan made for the caller's `params` (its stored params may be
        packed, so the step finds the plan under their shapes too), and return it."""
        caller = self._key(params, example_batch)
        key = self._key(state.stored_params, example_batch)       # padded uneven heads store their own layout
        self._plans[key] = self._plans[caller]
        self._jitted[key] = self._jitted[caller]
        if caller in self._refiners:
            self._refiners[key] = self._refiners[caller]
        self._last_call = None
        return state

    def __call__(self, state: TrainState, batch):
        if not isinstance(state, TrainState):
            raise PlanError("step(state, batch) takes the wh.TrainState returned by step.init(params, batch).")
        heartbeat()                                        # whalex.launch --heartbeat-timeout (<= 1 touch/s)
        if self._refiners:
            refiner = self._refiners.get(self._key(state.stored_params, batch))
            if refiner is not None:
                return self._refine(refiner, state, batch)
        batch_leaves, batch_tree = jax.tree.flatten(batch)
        batch_signature = _signature(batch_leaves)
        last = self._last_call
        if (last is not None and last.state() is state and last.batch_tree == batch_tree
                and last.batch_signature == batch_signature):
            # the state this step just returned, with a batch like the last one: same plan and layout;
            # a state donated since (by another step) has lost all its buffers, its counter too
            _check_not_donated((state.step,))
            p, jitted = last.plan, last.jitted
        else:
            _check_not_donated(jax.tree.leaves(state))
            state, p, jitted = self._resolve(state, batch)
        self._last = p
        batch = p.place_batch(batch)
        if not p.compiled.step:                    # first call: compile ahead (the call reuses it) and keep
            p.compiled.keep_step(jitted.lower(state, batch).compile().memory_analysis())   # XLA's figures
        state, metrics = jitted(state, batch)
        self._last_call = _LastCall(weakref.ref(state), batch_tree, batch_signature, p, jitted)
        return state, metrics

    def _refine(self, refiner: Refiner, state: TrainState, batch):
        """One step of a refinement (Config(hardware_aware="refine")); when it ends, the kept plan is this
        step's plan for these shapes."""
        _check_not_donated(jax.tree.leaves(state))
        self._last = refiner.current()[0]
        state, metrics = refiner.run(state, batch, self._relayout)
        self._refiners[self._key(state.stored_params, batch)] = refiner     # a split head's layout may change
        if refiner.result is not None:
            for key in [k for k, r in self._refiners.items() if r is refiner]:
                self._plans[key], self._jitted[key] = refiner.result, refiner.jitted[refiner.scale]
                del self._refiners[key]
            self._last = refiner.result
        self._last_call = None
        return state, metrics

    def _resolve(self, state: TrainState, batch):
        """(state in the plan's storage layout, plan, jitted step) for a call: the plan made for these
        shapes, or a new one (a new batch shape; refused for pipelines)."""
        key = self._key(state.stored_params, batch)
        p = self._plans.get(key)
        if p is not None:
            return self._relayout(state, p), p, self._jitted[key]     # a no-op unless the state came from another step
        if isinstance(batch, StageBatch):         # placed by a pipeline plan's place_batch: that plan
            shapes = _signature(jax.tree.leaves(batch))
            for k, q in self._plans.items():
                if q.schedule is not None and _signature(jax.tree.leaves(q.storage.batch_shapes())) == shapes:
                    return self._relayout(state, q), q, self._jitted[k]
        if self._last is not None and self._last.schedule is not None:
            raise PlanError("the batch shapes differ from the ones this pipeline was planned for; call "
                            "step.init(params, batch) with the new shapes.")
        caller = state.params if state.view is None else jax.eval_shape(state.view.unpack, state.stored_params)
        p = self._plan_for(caller, batch, state.model_state, state.rng)
        state = self._adopt(self._relayout(state, p), caller, batch)
        return state, p, self._jitted[self._key(state.stored_params, batch)]

    def _relayout(self, state: TrainState, p: Plan) -> TrainState:
        """`state` in the storage layout of plan `p`: as it is, or re-laid out as a checkpoint restore would
        when another plan (a new batch shape can re-plan a padded head) or another step made it."""
        return state if p.storage.holds(state) else p.storage.adopt_state(state)

    def params(self, state: TrainState):
        """The parameters of `state` as the caller's pytree (unpacks padded uneven shards)."""
        return state.params

    def model(self, state: TrainState):
        """The NNX module of `state` (after step.init(model, batch)): trained params and model state."""
        if self._nnx is None:
            raise PlanError("step.model(state) needs a step initialised with an NNX module (step.init(model, batch)); "
                            "use step.params(state) and state.model_state otherwise.")
        return self._nnx.module(self.params(state), state.model_state)

    def lower(self) -> str:
        return self.plan.lower()


def parallelize(loss_fn: Callable, optimizer: optax.GradientTransformation, has_aux: bool = False,
                config: Config | None = None, cluster: Cluster | None = None) -> Step:
    """Turn `loss_fn(params, batch)` and an optax optimizer into a planned, sharded, jitted step."""
    return Step(loss_fn, optimizer, has_aux, config, cluster)
