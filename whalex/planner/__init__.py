"""The planner: builds a `Plan` from a loss, example inputs, an optimizer, a Config and a Cluster.

`build_plan` captures the loss, asks balance what it needs (pipeline stages under auto_parallel,
uneven data-parallel loads on heterogeneous clusters) and chooses one kind of program, each built
by its own module and handed to lowering with every decision already made:

- `planner.spmd`: collocated TaskGraphs in one GSPMD program (micro-batches accumulate gradients);
- `planner.uneven`: uneven data parallelism (Algorithm 1 over the batch);
- `planner.hybrid`: a hybrid's replicate backbone on uneven rows, its split head as planned by spmd;
- `planner.pipeline`: stages on disjoint devices under a schedule.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from whalex.balance.partition import auto_stages
from whalex.errors import PlanError
from whalex.plan import Plan
from whalex.planner.common import Request, check_optimizer, resolve
from whalex.planner.hybrid import hybrid_plan
from whalex.planner.pipeline import model_degree, pipeline_plan
from whalex.planner.spmd import spmd_plan
from whalex.planner.stages import choose, pipeline_rule
from whalex.planner.uneven import balance_data_parallel
from whalex.precision.amp import amp_loss
from whalex.primitives.scopes import Strategy
from whalex.records.schedules import make_schedule

__all__ = ["build_plan"]


def build_plan(loss_fn: Callable, params, batch, optimizer=None, config=None, cluster=None,
               has_aux: bool = False, model_state=None, rng=None) -> Plan:
    """Plan `loss_fn(params, batch)`: the GSPMD, uneven data-parallel, hybrid or pipeline plan."""
    inputs = {k: v for k, v in (("model_state", model_state), ("rng", rng)) if v is not None}
    config, cluster = resolve(config, cluster)
    loss_fn = amp_loss(loss_fn, config.amp, has_aux)
    check_optimizer(optimizer)
    req = Request(loss_fn, params, batch, inputs, has_aux, optimizer, config, cluster)
    cap = req.capture()
    if config.auto_parallel:
        return _auto_pipeline(req, cap)
    _check_micro_batches(cap, config.num_micro_batch)
    placement = choose(cap, config, cluster.size)
    if placement.pipelined:
        tg_stage = {tg: s for s, g in enumerate(placement.groups) for tg in g}
        stage_of_eqn = [tg_stage[cap.assign[(i,)]] for i in range(len(cap.jaxpr.jaxpr.eqns))]
        strategies = [next(cap.taskgraphs[i].strategy for i in g if cap.taskgraphs[i].annotated)
                      for g in placement.groups]
        return pipeline_plan(req, cap, stage_of_eqn, strategies, rule=placement.rule)
    if all(t.strategy.kind == "replicate" for t in cap.taskgraphs):
        report, uneven = balance_data_parallel(req, cap)
        plan = uneven if uneven is not None else spmd_plan(req, cap, report)
    else:
        plan = hybrid_plan(req, cap, spmd_plan(req, cap))
    return dataclasses.replace(plan, placement=placement.rule)


def _check_micro_batches(cap, m: int) -> None:
    if cap.global_batch % m:
        raise PlanError(
            f"num_micro_batch={m} does not divide the global batch of {cap.global_batch}; use a batch size "
            f"that is a multiple of {m} (times the data-parallel degree).")


def _auto_pipeline(req: Request, cap) -> Plan:
    """auto_parallel: balance cuts the model into num_task_graph stages (split scopes inside them make
    it 3D), placed on disjoint devices with nested data parallelism over the rest of the cluster."""
    config, cluster = req.config, req.cluster
    k, m, mp, V = config.num_task_graph, config.num_micro_batch, model_degree(cap), config.virtual_stages
    sched = make_schedule(config.schedule, k, m, V)
    dp = max(cluster.size // (k * mp), 1)
    try:
        auto = auto_stages(cap, k * V, cluster, req.optimizer, micro_fraction=1.0 / (dp * m),
                           in_flight=[sched.chunk_in_flight(c) for c in range(k * V)],
                           hardware_aware=config.hardware_aware, ticks=sched.tick_table, virtual_stages=V)
    except PlanError as e:
        if V == 1:
            raise
        raise PlanError(f"{e} (schedule='interleaved' cuts num_task_graph={k} x virtual_stages={V} = {k * V} chunks; "
                        "use fewer virtual_stages or stages)") from None
    _check_micro_batches(cap, m)
    if cluster.size % (k * mp):
        raise PlanError(f"num_task_graph={k} stages" + (f" x split({mp}) inside them" if mp > 1 else "")
                        + f" do not divide the cluster's {cluster.size} devices; use a divisor of {cluster.size}.")
    why = f"auto_parallel=True cut the model into num_task_graph={k} stages" + (
        f" of virtual_stages={V} chunks each" if V > 1 else "") + (f" with split({mp}) inside them" if mp > 1 else "")
    return pipeline_plan(req, cap, list(auto.stage_of_eqn), [Strategy("replicate", 1)] * k, auto.layers,
                         rule=pipeline_rule(k, mp, dp, why), virtual_stages=V)
