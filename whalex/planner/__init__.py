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

from typing import Callable

from whalex.balance.partition import auto_stages
from whalex.errors import PlanError
from whalex.core.schedules import make_schedule
from whalex.memory.precision import amp_loss
from whalex.plan import Plan
from whalex.planner.common import Request, check_optimizer, refuse_unbuilt, resolve
from whalex.planner.hybrid import hybrid_plan
from whalex.planner.pipeline import model_degree, pipeline_plan
from whalex.planner.spmd import spmd_plan
from whalex.planner.uneven import balance_data_parallel

__all__ = ["build_plan"]


def _stage_groups(cap) -> list[list[int]]:
    """Pipeline stages as lists of TaskGraph indices: each annotated TaskGraph starts a stage and
    un-annotated runs join the stage before them (or the first stage)."""
    groups: list[list[int]] = []
    pending: list[int] = []
    for tg in cap.taskgraphs:
        if tg.annotated:
            groups.append(pending + [tg.index])
            pending = []
        elif groups:
            groups[-1].append(tg.index)
        else:
            pending.append(tg.index)
    if not groups:
        groups = [pending]
    elif pending:
        groups[-1].extend(pending)
    return groups


def _pipelinable(cap, groups, num_devices: int) -> int | None:
    """Devices per stage if the stages can run as a pipeline on disjoint devices, else None."""
    if len(groups) < 2:
        return None
    counts = set()
    for g in groups:
        strategies = {cap.taskgraphs[i].strategy for i in g if cap.taskgraphs[i].annotated}
        for st in strategies:
            if st.kind != "replicate" or st.device_count is None:
                return None
            counts.add(st.device_count)
    if len(counts) != 1:
        raise PlanError(
            f"pipeline stages ask for different device counts {sorted(counts)}; give every stage the same "
            "wh.replicate(n) so that each pipeline replica is a grid of stages x n devices.")
    n = counts.pop()
    if num_devices % (n * len(groups)):
        raise PlanError(
            f"{len(groups)} pipeline stages of {n} device(s) need a multiple of {n * len(groups)} devices, but the "
            f"cluster has {num_devices}; use a stage count that divides it or fewer devices per stage"
            + (f"; on CPU, simulate them: set XLA_FLAGS=--xla_force_host_platform_device_count={n * len(groups)} "
               "before jax is imported." if num_devices < n * len(groups) else "."))
    return n


def build_plan(loss_fn: Callable, params, batch, optimizer=None, config=None, cluster=None,
               has_aux: bool = False, model_state=None, rng=None) -> Plan:
    """Plan `loss_fn(params, batch)`: the GSPMD, uneven data-parallel or pipeline plan."""
    inputs = {k: v for k, v in (("model_state", model_state), ("rng", rng)) if v is not None}
    config, cluster = resolve(config, cluster)
    refuse_unbuilt(config)
    loss_fn = amp_loss(loss_fn, config.amp, has_aux)
    check_optimizer(optimizer)
    req = Request(loss_fn, params, batch, inputs, has_aux, optimizer, config, cluster)
    cap = req.capture()
    m = config.num_micro_batch
    if config.auto_parallel:
        groups = None
        k = config.num_task_graph
        sched = make_schedule(config.schedule, k, m)
        dp = max(cluster.size // (k * model_degree(cap)), 1)
        auto = auto_stages(cap, k, cluster, optimizer, micro_fraction=1.0 / (dp * m),
                           in_flight=[sched.max_in_flight(s) for s in range(k)], hardware_aware=config.hardware_aware,
                           tick_kinds=sched.tables()["kind"])
        stage_of_eqn, stage_layers = list(auto.stage_of_eqn), auto.layers
    else:
        groups = _stage_groups(cap)
        stage_of_eqn, stage_layers = None, None
    if cap.global_batch % m:
        raise PlanError(
            f"num_micro_batch={m} does not divide the global batch of {cap.global_batch}; use a batch size "
            f"that is a multiple of {m} (times the data-parallel degree).")
    per_stage = None
    if m > 1 or config.auto_parallel:
        if config.auto_parallel:
            mp = model_degree(cap)
            per_stage = 1 if cluster.size % (config.num_task_graph * mp) == 0 else None
            if per_stage is None:
                raise PlanError(f"num_task_graph={config.num_task_graph} stages"
                                + (f" x split({mp}) inside them" if mp > 1 else "")
                                + f" do not divide the cluster's {cluster.size} devices; use a divisor of {cluster.size}.")
        else:
            per_stage = _pipelinable(cap, groups, cluster.size)
            counts = {cap.taskgraphs[i].strategy.device_count or cluster.size
                      for g in groups for i in g if cap.taskgraphs[i].annotated}
            if per_stage is None and len(groups) > 1 and len(counts) > 1:
                raise PlanError(
                    f"num_micro_batch={m} with TaskGraphs on different device counts {sorted(counts)} asks for a "
                    "pipeline whose stages are not all wh.replicate(n) with one n; split stages inside a "
                    "pipeline are not supported yet. Use wh.replicate(n) stages, or give every TaskGraph the "
                    "same device_count to share devices (then micro-batches accumulate gradients).")
    if per_stage is None and all(t.strategy.kind == "replicate" for t in cap.taskgraphs):
        report, uneven = balance_data_parallel(req, cap)
        if uneven is not None:
            return uneven
        return spmd_plan(req, cap, report)
    if per_stage is not None:
        if stage_of_eqn is None:
            tg_stage = {tg: s for s, g in enumerate(groups) for tg in g}
            stage_of_eqn = [tg_stage[cap.assign[(i,)]] for i in range(len(cap.jaxpr.jaxpr.eqns))]
        return pipeline_plan(req, cap, stage_of_eqn, per_stage, stage_layers)
    return hybrid_plan(req, cap, spmd_plan(req, cap))
