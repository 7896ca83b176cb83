"""Public entry points: `wh.plan` and `wh.parallelize`.

annotations -> capture (TaskGraphs) -> mesh + VirtualDevices -> sharding patterns -> Plan ->
one jitted step.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
import optax

from whalex.balance.profile import DeviceMemory, sharded_bytes, taskgraph_flops
from whalex.errors import PlanError
from whalex.lowering.capture import capture
from whalex.lowering.patterns import plan_shardings
from whalex.lowering.step import Program, opt_state_specs
from whalex.mesh.cluster import Cluster
from whalex.mesh.virtual import mesh_layout, virtual_devices
from whalex.plan import Plan, TaskGraphInfo
from whalex.primitives.config import DEFAULTS, Config
from whalex.state import TrainState


def _resolve(config, cluster) -> tuple[Config, Cluster]:
    config = config if config is not None else (DEFAULTS.config or Config())
    if not isinstance(config, Config):
        config = Config(config)
    cluster = cluster if cluster is not None else (DEFAULTS.cluster or Cluster.detect())
    if not isinstance(cluster, Cluster):
        raise PlanError(f"cluster must be a wh.Cluster, got {type(cluster).__name__}; use wh.Cluster.detect().")
    return config, cluster


def _check_optimizer(optimizer):
    if optimizer is not None and not isinstance(optimizer, optax.GradientTransformation):
        raise PlanError(f"optimizer must be an optax.GradientTransformation (e.g. optax.adam(1e-3)), "
                        f"got {type(optimizer).__name__}.")


def build_plan(loss_fn: Callable, params, batch, optimizer=None, config=None, cluster=None,
               has_aux: bool = False) -> Plan:
    config, cluster = _resolve(config, cluster)
    _check_optimizer(optimizer)
    cap = capture(loss_fn, params, batch, has_aux=has_aux)
    if config.num_micro_batch > 1:
        raise PlanError(
            f"num_micro_batch={config.num_micro_batch}: pipelining and gradient accumulation are not in this "
            "version of whalex yet (issue 3); use num_micro_batch=1.")
    if config.auto_parallel:
        raise PlanError("auto_parallel=True needs pipelining, which is not in this version of whalex yet "
                        "(issue 3); annotate the model with wh.replicate/wh.split instead.")
    strategies = [t.strategy for t in cap.taskgraphs]
    layout = mesh_layout(strategies, cluster.size)
    vds = virtual_devices(strategies, layout)
    sharding = plan_shardings(cap, vds, layout, config.matmul_pattern)
    mesh = layout.build(cluster.devices)
    program = Program(cap, sharding, mesh, optimizer, cluster.platform)

    flops = taskgraph_flops(cap.jaxpr, cap.assign, len(cap.taskgraphs))
    invars = cap.jaxpr.jaxpr.invars
    infos = []
    for tg, vd, f in zip(cap.taskgraphs, vds, flops):
        sizes = [int(np.prod(invars[i].aval.shape)) for i in tg.params]
        nbytes = sum(s * np.dtype(invars[i].aval.dtype).itemsize for s, i in zip(sizes, tg.params))
        infos.append(TaskGraphInfo(tg.index, tg.strategy.label(), tg.annotated, vd.device_count, vd.devices,
                                   vd.nested_dp, tg.num_eqns, sum(sizes), float(nbytes), f,
                                   sharding.comm_bytes(tg.index)))

    axis_sizes = dict(zip(layout.axis_names, layout.axis_sizes))
    pshapes = program.param_shapes()
    pspecs = jax.tree.unflatten(cap.params_tree, list(sharding.param_specs))
    p_bytes = sharded_bytes(pshapes, pspecs, axis_sizes)
    o_bytes = 0.0
    if optimizer is not None:
        ospecs, oshapes = opt_state_specs(optimizer, pshapes, sharding.param_specs)
        o_bytes = sharded_bytes(oshapes, ospecs, axis_sizes)
    memory = tuple(DeviceMemory(i, s.name, p_bytes, p_bytes, o_bytes, float(s.memory_bytes))
                   for i, s in enumerate(cluster.specs[: layout.size]))
    first = vds[cap.assign[(0,)]] if cap.assign else vds[0]
    per_device = cap.global_batch // layout.axis_size(first.batch_axes)
    return Plan(cluster=cluster, config=config, layout=layout, task_graphs=tuple(infos), virtual_devices=vds,
                batch_sizes=(per_device,) * layout.size, global_batch=cap.global_batch,
                param_specs=dict(zip(cap.param_paths, sharding.param_specs)), patterns=sharding.choices,
                comms=sharding.comms, memory=memory, program=program)


def plan(loss_fn: Callable, params, batch, optimizer=None, config=None, cluster=None,
         has_aux: bool = False) -> Plan:
    """Plan `loss_fn(params, batch)` for a cluster without running it (abstract clusters too)."""
    return build_plan(loss_fn, params, batch, optimizer, config, cluster, has_aux)


class Step:
    """A parallelized training step: `state = step.init(params, batch)`, `state, metrics = step(state, batch)`."""

    def __init__(self, loss_fn, optimizer, has_aux=False, config=None, cluster=None):
        _check_optimizer(optimizer)
        if optimizer is None:
            raise PlanError("wh.parallelize needs an optax optimizer, e.g. optax.adam(1e-3).")
        self.loss_fn, self.optimizer, self.has_aux = loss_fn, optimizer, has_aux
        self._config, self._cluster = config, cluster
        self._plans: dict = {}
        self._jitted: dict = {}
        self._last: Plan | None = None

    @property
    def plan(self) -> Plan:
        if self._last is None:
            raise PlanError("the step has no plan yet: call step.init(params, example_batch) first.")
        return self._last

    def _key(self, params, batch):
        return jax.tree.structure((params, batch)), tuple(
            (np.shape(x), str(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype))
            for x in jax.tree.leaves((params, batch)))

    def _plan_for(self, params, batch) -> Plan:
        key = self._key(params, batch)
        if key not in self._plans:
            p = build_plan(self.loss_fn, params, batch, self.optimizer, self._config, self._cluster, self.has_aux)
            if p.cluster.is_abstract:
                raise PlanError("an abstract cluster can plan and lower but not run; use wh.plan(...) with it, "
                                "or Cluster.detect() / Cluster(kinds=...) to train.")
            self._plans[key] = p
            self._jitted[key] = p.program.jitted()
        self._last = self._plans[key]
        return self._plans[key]

    def init(self, params, example_batch) -> TrainState:
        """Plan for these shapes and place params and optimizer state per the plan."""
        p = self._plan_for(params, example_batch)
        return p.program.init_state(params)

    def __call__(self, state: TrainState, batch):
        if not isinstance(state, TrainState):
            raise PlanError("step(state, batch) takes the wh.TrainState returned by step.init(params, batch).")
        key = self._key(state.params, batch)
        p = self._plans.get(key) or self._plan_for(state.params, batch)
        self._last = p
        batch = jax.device_put(batch, p.program.batch_shardings)
        return self._jitted[key](state, batch)

    def lower(self, state_or_params=None, batch=None):
        return self.plan.lower()


def parallelize(loss_fn: Callable, optimizer: optax.GradientTransformation, has_aux: bool = False,
                config: Config | None = None, cluster: Cluster | None = None) -> Step:
    """Turn `loss_fn(params, batch)` and an optax optimizer into a planned, sharded, jitted step."""
    return Step(loss_fn, optimizer, has_aux, config, cluster)
