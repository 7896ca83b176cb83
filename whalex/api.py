"""Public entry points: `wh.plan` and `wh.parallelize`.

annotations -> capture (TaskGraphs) -> mesh + VirtualDevices -> sharding patterns -> Plan ->
one jitted step.
"""
from __future__ import annotations

from typing import Callable

import jax
import numpy as np
import optax

from whalex.balance.profile import taskgraph_flops
from whalex import nnx as nnx_lib
from whalex.errors import PlanError
from whalex.lowering.capture import _dtype
from whalex.memory.precision import amp_loss, capture     # capture: amp casts moved to their first use
from whalex.memory.remat import configure as configure_memory
from whalex.lowering.parts import PartLoss, analyse
from whalex.lowering.patterns import plan_shardings
from whalex.lowering.step import Program
from whalex.mesh.cluster import Cluster
from whalex.mesh.virtual import DATA, mesh_layout, virtual_devices
from whalex.plan import Plan, TaskGraphInfo
from whalex.primitives.config import DEFAULTS, Config
from whalex.nnx import NnxModel
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


def _micro_batch(batch, size):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((size,) + tuple(np.shape(x)[1:]), _dtype(x)), batch)


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
            f"cluster has {num_devices}; use a stage count that divides it or fewer devices per stage.")
    return n


# Memory options accepted by Config but not lowered yet: refused at plan time, never ignored.
_NOT_BUILT = ()
_NOT_BUILT_OFFLOAD = ()        # offload targets not lowered yet


def _refuse_unbuilt(config: Config) -> None:
    for name in _NOT_BUILT:
        value = getattr(config, name)
        if value not in (None, 0):
            raise PlanError(f"Config.{name}={value!r} is not lowered by this version of whalex yet; "
                            f"leave {name} at its default.")
    for target in config.offload or ():
        if target in _NOT_BUILT_OFFLOAD:
            raise PlanError(f"Config.offload={config.offload!r}: offloading {target!r} is not lowered by this "
                            "version of whalex yet; offload 'opt_state' and/or 'params'.")


def build_plan(loss_fn: Callable, params, batch, optimizer=None, config=None, cluster=None,
               has_aux: bool = False, model_state=None, rng=None) -> Plan:
    inputs = {k: v for k, v in (("model_state", model_state), ("rng", rng)) if v is not None}
    config, cluster = _resolve(config, cluster)
    _refuse_unbuilt(config)
    loss_fn = amp_loss(loss_fn, config.amp, has_aux)
    _check_optimizer(optimizer)
    cap = capture(loss_fn, params, batch, has_aux=has_aux, **inputs)
    m = config.num_micro_batch
    if config.auto_parallel:
        from whalex.balance.partition import auto_stages
        from whalex.lowering.schedules import make_schedule
        groups = None
        k = config.num_task_graph
        sched = make_schedule(config.schedule, k, m)
        dp = max(cluster.size // k, 1)
        stage_of_eqn = auto_stages(cap, k, cluster, optimizer, micro_fraction=1.0 / (dp * m),
                                   in_flight=[sched.max_in_flight(s) for s in range(k)],
                                   hardware_aware=config.hardware_aware)
    else:
        groups = _stage_groups(cap)
        stage_of_eqn = None
    if cap.global_batch % m:
        raise PlanError(
            f"num_micro_batch={m} does not divide the global batch of {cap.global_batch}; use a batch size "
            f"that is a multiple of {m} (times the data-parallel degree).")
    per_stage = None
    if m > 1 or config.auto_parallel:
        if config.auto_parallel:
            per_stage = 1 if cluster.size % config.num_task_graph == 0 else None
            if per_stage is None:
                raise PlanError(f"num_task_graph={config.num_task_graph} stages do not divide the cluster's "
                                f"{cluster.size} devices; use a divisor of {cluster.size}.")
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
        report, uneven = _balance_data_parallel(loss_fn, params, batch, inputs, optimizer, config, cluster, has_aux, cap)
        if uneven is not None:
            return uneven
        return _spmd_plan(loss_fn, params, batch, inputs, optimizer, config, cluster, has_aux, cap, report)
    if per_stage is not None:
        if stage_of_eqn is None:
            tg_stage = {tg: s for s, g in enumerate(groups) for tg in g}
            stage_of_eqn = [tg_stage[cap.assign[(i,)]] for i in range(len(cap.jaxpr.jaxpr.eqns))]
        return _pipeline_plan(loss_fn, params, batch, inputs, optimizer, config, cluster, has_aux, cap,
                              stage_of_eqn, per_stage)
    return _spmd_plan(loss_fn, params, batch, inputs, optimizer, config, cluster, has_aux, cap)


def _spmd_plan(loss_fn, params, batch, inputs, optimizer, config, cluster, has_aux, cap, report=None) -> Plan:
    """Collocated TaskGraphs in one GSPMD program; micro-batches accumulate gradients."""
    m = config.num_micro_batch
    full = cap
    if m > 1:
        cap = capture(loss_fn, params, _micro_batch(batch, full.global_batch // m), has_aux=has_aux, **inputs)
    strategies = [t.strategy for t in cap.taskgraphs]
    layout = mesh_layout(strategies, cluster.size)
    vds = virtual_devices(strategies, layout)
    try:
        sharding = plan_shardings(cap, vds, layout, config.matmul_pattern)
    except PlanError as e:
        if m > 1:
            raise PlanError(f"{e} (with num_micro_batch={m}, each micro-batch of {cap.global_batch} samples "
                            "must divide over the data-parallel replicas)") from None
        raise
    mesh = layout.build(cluster.devices)
    overrides, padded, split_report = None, None, None
    if config.hardware_aware and m == 1:
        found = _uneven_heads(cap, vds, layout, sharding, cluster, optimizer, mesh)
        if found is not None:
            overrides, padded, sharding, split_report = found
    if sharding.experts:
        overrides = {**(overrides or {}), **_expert_overrides(sharding.experts, mesh)}
    from whalex.memory import MemoryOptions, plan_memory, residual_bytes, zero, zero_sharded
    axis_sizes = dict(zip(layout.axis_names, layout.axis_sizes))
    readers = [[t.index for t in cap.taskgraphs if i in t.params] for i in range(cap.num_params)]
    mem = MemoryOptions.from_config(config, zero.data_parallel_axes(readers, [v.batch_axes for v in vds], axis_sizes))
    parts = None
    if m > 1:
        if config.comm_dtype is not None:
            raise PlanError(f"comm_dtype={config.comm_dtype!r} with num_micro_batch={m} on collocated TaskGraphs is "
                            "not lowered yet; use comm_dtype=None, or num_micro_batch=1.")
        parts = _parts(cap, full, config, "micro-batches (gradient accumulation)")
    program = Program(cap, sharding, mesh, optimizer, cluster.platform, m, overrides, padded, memory=mem, parts=parts)
    if mem.zero_level >= 2 and layout.axis_names == (DATA,) and layout.size > 1 and not overrides:
        program = _zero_data_parallel(loss_fn, params, batch, inputs, optimizer, config, cluster, has_aux, full, m, mesh, mem) \
            or program
    program = configure_memory(program, config, cluster, [vd.batch_axes for vd in vds] if isinstance(program, Program)
                               else [(DATA,)] * len(program.captured.taskgraphs),
                               lambda rows: capture(loss_fn, params, _micro_batch(batch, rows), has_aux=has_aux, **inputs))
    report = report or split_report

    flops = [f * m for f in taskgraph_flops(cap.jaxpr, cap.assign, len(cap.taskgraphs))]
    comms = sharding.comms
    if mem.zero_level:
        owner = {cap.param_paths[i]: (r[0] if r else 0) for i, r in enumerate(readers)}
        comms = zero.comms(comms, mem.zero_level, zero_sharded(program, cap.param_paths), owner)
    infos = _taskgraph_infos(cap, vds, flops, [sum(c.bytes for c in comms if c.taskgraph == t.index) * m
                                               for t in cap.taskgraphs])
    memory = plan_memory(program, cluster.specs[: layout.size],
                         residual_bytes(cap.jaxpr, cap.num_params) / layout.size)
    first = vds[cap.assign[(0,)]] if cap.assign else vds[0]
    per_device = full.global_batch // layout.axis_size(first.batch_axes)
    parts = getattr(program, "parts", None)
    couplings = tuple(parts.sem.lines()) if parts is not None else \
        (lambda: _whole_batch_couplings(loss_fn, params, batch, inputs, has_aux, full))     # found when asked
    return Plan(cluster=cluster, config=config, layout=layout, task_graphs=tuple(infos), virtual_devices=vds,
                batch_sizes=(per_device,) * layout.size, global_batch=full.global_batch,
                param_specs=dict(zip(cap.param_paths, sharding.param_specs)), patterns=sharding.choices,
                comms=comms, memory=memory, program=program, balance=report, batch_couplings=couplings)


def _whole_batch_couplings(loss_fn, params, batch, inputs, has_aux, full) -> tuple[str, ...]:
    """The batch reductions of a loss that a plan computes whole (found against a half-batch trace)."""
    b = full.global_batch
    if b % 2 or b < 2:
        return ()
    try:
        half = capture(loss_fn, params, _micro_batch(batch, b // 2), has_aux=has_aux, **inputs)
        return tuple(analyse(half, full, per_part=True).lines(whole=True))
    except PlanError:
        return ()


def _zero_data_parallel(loss_fn, params, batch, inputs, optimizer, config, cluster, has_aux, full, m, mesh, mem):
    """ZeRO 2/3 on a pure data-parallel plan as explicit collectives: the shard_map program of
    uneven data parallelism with even counts, whose reduce-scatter XLA keeps on every backend
    (XLA's CPU compiler writes a GSPMD gradient reduce-scatter as all-reduce + dynamic-slice)."""
    import dataclasses as dc

    from whalex.lowering.uneven import UnevenProgram
    n, b = mesh.size, full.global_batch
    if b % (n * m):
        return None
    unit = b // (n * m)
    cap = capture(loss_fn, params, _micro_batch(batch, unit), has_aux=has_aux, **inputs)
    mem = dc.replace(mem, zero_axes=((DATA,),) * cap.num_params)
    context = f"per-device parts (zero {mem.zero_level} on data parallelism)"
    sem = analyse(cap, full, per_part=True, context=context)
    if sem.accepted:
        return None              # the loss couples samples: the GSPMD program sees the whole batch (exact)
    parts = PartLoss(sem, cap, full)
    return UnevenProgram(cap, mesh, optimizer, cluster.platform, (m,) * n, unit, b, mem, parts=parts)


def _parts(part, whole, config, context):
    """The loss contract over parts of `part.global_batch` samples (analysed against the whole batch)."""
    if part.global_batch == whole.global_batch:
        sem = analyse(whole, whole, per_part=config.batch_coupling == "per_part", context=context)
    else:
        sem = analyse(part, whole, per_part=config.batch_coupling == "per_part", context=context)
    return PartLoss(sem, part, whole)


def _expert_overrides(calls, mesh) -> dict:
    """MoE experts calls under split -> their expert-parallel shard_map (all-to-all dispatch)."""
    from whalex.moe.parallel import expert_parallel

    def override(call):
        fn = expert_parallel(mesh, call.token_axes, call.expert_axes, call.activation)
        return lambda *args: [fn(*args)]

    return {call.path: override(call) for call in calls}


def _uneven_heads(cap, vds, layout, sharding, cluster, optimizer, mesh):
    """Uneven class shards for `wh.ops.softmax_cross_entropy_head` under split on a heterogeneous
    model axis: (overrides, padded, sharding, report), or None when the even plan applies."""
    import dataclasses as dc

    from jax.sharding import PartitionSpec as P

    from whalex import _compat as C
    from whalex.balance import cost
    from whalex.lowering.uneven_split import plan_columns, uneven_head
    from whalex.ops import HEAD_NAME

    jaxpr = cap.jaxpr.jaxpr
    params = {v: i for i, v in enumerate(jaxpr.invars[: cap.num_params])}
    overrides, padded, specs, reports = {}, {}, list(sharding.param_specs), []
    for i, eqn in enumerate(jaxpr.eqns):
        if not (C.is_call(eqn) and eqn.params.get("name") == HEAD_NAME):
            continue
        vd = vds[cap.assign[(i,)]]
        if vd.strategy.kind != "split" or len(vd.model_axes) != 1:
            continue
        x, kernel, bias, labels = eqn.invars
        cast = {e.outvars[0]: e.invars[0] for e in jaxpr.eqns[:i] if e.primitive.name == "convert_element_type"}
        kernel, bias = cast.get(kernel, kernel), cast.get(bias, bias)     # amp: the fp32 parameter behind the cast
        if kernel not in params or bias not in params:
            continue
        axis = vd.model_axes[0]
        grid = np.asarray(range(layout.size)).reshape(layout.axis_sizes)
        model_dim = layout.axis_names.index(axis)
        per_model = np.moveaxis(grid, model_dim, -1).reshape(-1, layout.axis_sizes[model_dim])
        speeds = [min(cluster.speeds[d] for d in per_model[:, j]) for j in range(per_model.shape[1])]
        caps = [min(cluster.specs[d].memory_bytes for d in per_model[:, j]) for j in range(per_model.shape[1])]
        if len(set(speeds)) == 1:
            continue
        features, classes = kernel.aval.shape
        itemsize = np.dtype(kernel.aval.dtype).itemsize
        opt = 2.0 if optimizer is not None else 0.0
        names = [f"model shard {j} ({cluster.specs[per_model[0, j]].name})" for j in range(len(speeds))]
        per_column = (features + 1) * itemsize * (2 + opt)          # weight, gradient, optimizer state
        cols, bal = plan_columns(classes, speeds, caps, per_column, names)
        for j, c in enumerate(caps):                                   # every device stores the padded width
            if cols.width * per_column > c:
                raise PlanError(f"{names[j]} cannot hold the padded head shard of {cols.width} classes "
                                f"({cols.width * per_column / 2**30:.2f} GiB > {c / 2**30:.2f} GiB); use more devices "
                                "or hardware_aware=False.")
        pk, pb = params[kernel], params[bias]
        padded[pk], padded[pb] = (cols, 1), (cols, 0)
        specs[pk], specs[pb] = P(None, axis), P(axis)
        batch_axes = tuple(a for a in vd.batch_axes if layout.axis_size((a,)) > 1)
        head = uneven_head(mesh, axis, batch_axes, cols, cap.global_batch)
        overrides[(i,)] = lambda *args, head=head: [head(*args)]
        tg_flops = taskgraph_flops(cap.jaxpr, {(j,): 0 if j == i else 1 for j in range(len(jaxpr.eqns))}, 1)[0]
        even = [classes // len(speeds)] * len(speeds)
        reports.append(cost.report([cluster.specs[per_model[0, j]] for j in range(len(speeds))], speeds,
                                   cols.counts, even, source=cluster.speed_source, unit=cols.chunk, applied=True,
                                   shifted=bal.shifted, flops_per_sample=tg_flops / classes,
                                   state_bytes=cols.width * per_column, act_base=0.0, act_per_sample=0.0))
        reports[-1] = dc.replace(reports[-1], kind=f"classes of {cap.param_paths[pk]} (padded to {cols.width})")
    if not overrides:
        return None
    return overrides, padded, dc.replace(sharding, param_specs=tuple(specs)), reports[0]


def _balance_data_parallel(loss_fn, params, batch, inputs, optimizer, config, cluster, has_aux, full):
    """Algorithm 1 over a data-parallel model: (report, uneven Plan or None for the even plan)."""
    from jax.sharding import PartitionSpec as P

    from whalex.balance import cost
    from whalex.balance.algorithm import balance, even
    from whalex.lowering.interpret import make_evaluator
    from whalex.lowering.uneven import DATA, UnevenProgram
    from whalex.mesh.virtual import MeshLayout, VirtualDevice

    k, b = cluster.size, full.global_batch
    hetero = len(set(cluster.speeds)) > 1 or len({s.memory_bytes for s in cluster.specs}) > 1
    if not hetero:
        return None, None
    unit = cost.balance_unit(b, k)
    captures = {}

    def cap_at(rows):
        if rows not in captures:
            captures[rows] = capture(loss_fn, params, _micro_batch(batch, rows), has_aux=has_aux, **inputs)
        return captures[rows]

    def make(rows):
        c = cap_at(rows)
        ev = make_evaluator(c.jaxpr, {}, None)
        n = c.num_params

        def f(*leaves):
            return jax.value_and_grad(lambda ps: ev(*ps, *leaves[n:])[0])(list(leaves[:n]))
        return (f, *[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in c.jaxpr.jaxpr.invars])

    cap_u = cap_at(unit)
    unit_flops = taskgraph_flops(cap_u.jaxpr, cap_u.assign, len(cap_u.taskgraphs))
    flops_per_sample = sum(unit_flops) / unit
    act_base, act_per = cost.activation_model(make)
    invars = cap_u.jaxpr.jaxpr.invars[: cap_u.num_params]
    shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars]
    p_bytes = sum(float(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in shapes)
    o_bytes = 0.0
    if optimizer is not None:
        o_bytes = sum(float(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                      for x in jax.tree.leaves(jax.eval_shape(optimizer.init, shapes)))
    from whalex.memory import MemoryOptions, account, plan_memory, residual_bytes
    mem = MemoryOptions.from_config(config, ((DATA,),) * cap_u.num_params)
    state = sum(account(p_bytes, o_bytes, p_bytes / k, o_bytes / k, mem)[:3])   # ZeRO: ~1/k of a sharded part
    units = b // unit
    names = [f"device {i} ({s.name})" for i, s in enumerate(cluster.specs)]
    bal = balance(units, cluster.speeds, [float(s.memory_bytes) for s in cluster.specs],
                  [state + act_base] * k, [act_per * unit] * k, names)
    rows = [u * unit for u in bal.loads]
    even_rows = [u * unit for u in even(units, k)] if b % k else [b // k] * k
    applied = config.hardware_aware and len(set(rows)) > 1
    report = cost.report(cluster.specs, cluster.speeds, rows, even_rows,
                         source=cluster.speed_source, unit=unit, applied=applied, shifted=bal.shifted,
                         flops_per_sample=flops_per_sample, state_bytes=state, act_base=act_base,
                         act_per_sample=act_per)
    if not applied:
        return report, None
    layout = MeshLayout((DATA,), (k,))
    mesh = layout.build(cluster.devices)
    parts = _parts(cap_u, full, config, "uneven per-device chunks")
    program = UnevenProgram(cap_u, mesh, optimizer, cluster.platform, tuple(bal.loads), unit, b, mem, parts=parts)
    program = configure_memory(program, config, cluster, [(DATA,)] * len(cap_u.taskgraphs))
    scale = b / unit
    flops = [f * scale for f in unit_flops]
    vds = tuple(VirtualDevice(t.index, t.strategy, k, (tuple(range(k)),), (), (DATA,)) for t in cap_u.taskgraphs)
    infos = _taskgraph_infos(cap_u, vds, flops, [0.0] * len(vds))
    memory = plan_memory(program, cluster.specs, residual_bytes(cap_u.jaxpr, cap_u.num_params))  # one chunk live
    plan = Plan(cluster=cluster, config=config, layout=layout, task_graphs=tuple(infos), virtual_devices=vds,
                batch_sizes=tuple(rows), global_batch=b, param_specs={p: P() for p in cap_u.param_paths},
                patterns=(), comms=(), memory=memory, program=program, balance=report,
                batch_couplings=tuple(parts.sem.lines()))
    return report, plan


def _taskgraph_infos(cap, vds, flops, comm):
    invars = cap.jaxpr.jaxpr.invars
    infos = []
    for tg, vd, f, c in zip(cap.taskgraphs, vds, flops, comm):
        sizes = [int(np.prod(invars[i].aval.shape)) for i in tg.params]
        nbytes = sum(s * np.dtype(invars[i].aval.dtype).itemsize for s, i in zip(sizes, tg.params))
        infos.append(TaskGraphInfo(tg.index, tg.strategy.label(), tg.annotated, vd.device_count, vd.devices,
                                   vd.nested_dp, tg.num_eqns, sum(sizes), float(nbytes), f, c))
    return infos


def _pipeline_plan(loss_fn, params, batch, inputs, optimizer, config, cluster, has_aux, full, stage_of_eqn,
                   per_stage) -> Plan:
    from jax.sharding import PartitionSpec as P

    from whalex.lowering.pipeline import DATA, STAGE, PipelineProgram, cut_stages
    from whalex.lowering.schedules import make_schedule
    from whalex.mesh.virtual import MeshLayout, VirtualDevice
    from whalex.primitives.scopes import Strategy

    m = config.num_micro_batch
    num_stages = max(stage_of_eqn) + 1 if stage_of_eqn else 1
    k = cluster.size
    dp = k // num_stages                   # nested data parallelism (includes replicate(n) inside stages)
    if full.global_batch % (dp * m):
        raise PlanError(
            f"the global batch of {full.global_batch} cannot be split into {m} micro-batches on each of the "
            f"{dp} pipeline replicas; use a batch size that is a multiple of {dp * m}.")
    micro = full.global_batch // (dp * m)
    cap = capture(loss_fn, params, _micro_batch(batch, micro), has_aux=has_aux, **inputs)
    if len(cap.jaxpr.jaxpr.eqns) != len(stage_of_eqn):
        raise PlanError("the loss traced differently at micro-batch size; whalex needs a loss whose "
                        "operations do not depend on the batch size.")
    parts = _parts(cap, full, config, "pipeline micro-batches")
    if parts.sem.row_outputs:
        raise PlanError("aux outputs with the batch dimension (per-example values) are not gathered by pipelines yet; "
                        "return batch-free aux values (reduced over the batch) with pipelining.")
    if not parts.sem.affine:
        raise PlanError("the loss is not affine in its sums over the batch (e.g. the log of a mean); a pipeline "
                        "cannot split its gradient over micro-batches in one pass. Write the loss as a sum or mean "
                        "of per-example terms, or use a plan without micro-batches.")
    cap = parts.body(parts.part_outputs()[0])       # stages end in the loss's sums over each micro-batch
    cut = cut_stages(cap, stage_of_eqn, num_stages)
    schedule = make_schedule(config.schedule, num_stages, m)
    layout = MeshLayout((DATA, STAGE), (dp, num_stages))
    from whalex.balance.partition import stage_devices
    placement = stage_devices(cluster, num_stages, config.hardware_aware)   # [stage][replica] -> device
    grid = [[placement[s][r] for s in range(num_stages)] for r in range(dp)]
    ordered = [cluster.devices[i] for row in grid for i in row] if cluster.devices is not None else None
    mesh = layout.build(ordered)
    from whalex.memory import MemoryOptions, plan_memory
    mem = MemoryOptions.from_config(config, ((DATA,),))
    program = PipelineProgram(cap, cut, schedule, mesh, optimizer, cluster.platform, full.global_batch, dp, mem,
                              parts=parts)
    _ = program.param_dtype
    if config.remat not in (None, "full") or "activations" in (config.offload or ()):
        raise PlanError(f"a pipeline already recomputes each stage's forward from its stashed input (remat='full'); "
                        f"remat={config.remat!r} / offload={config.offload!r} are not supported with pipelines. Use "
                        "remat=None or 'full' and offload 'opt_state'/'params' only.")
    program = configure_memory(program, config.replace(remat=None), cluster, [(DATA,)] * num_stages)

    assign = {(i,): s for i, s in enumerate(stage_of_eqn)}
    flops = [f * m * dp for f in taskgraph_flops(cap.jaxpr, assign, num_stages)]
    invars = cap.jaxpr.jaxpr.invars
    infos, vds = [], []
    labels = _stage_labels(full, stage_of_eqn, num_stages)
    for s in range(num_stages):
        sizes = [int(np.prod(invars[i].aval.shape)) for i in cut.params[s]]
        nbytes = sum(sz * np.dtype(invars[i].aval.dtype).itemsize for sz, i in zip(sizes, cut.params[s]))
        groups = tuple((placement[s][r],) for r in range(dp))
        strategy = Strategy("replicate", per_stage)
        vds.append(VirtualDevice(s, strategy, 1, groups, (), (DATA,)))
        msg = 0.0                      # filled in from the plan's collectives below
        infos.append(TaskGraphInfo(s, f"stage {s}: {labels[s]}", True, 1, groups[0], dp, len(cut.eqns[s]),
                                   sum(sizes), float(nbytes), flops[s], float(msg)))
    stash = (schedule.slots + schedule.grad_slots) * program.message_width * 4      # stashed stage inputs
    memory = plan_memory(program, cluster.specs[: layout.size], float(stash))
    from whalex.lowering.patterns import Comm
    comms = []
    grad_bytes = program.param_width * np.dtype(program.param_dtype).itemsize
    level = mem.zero_level
    for s in range(num_stages):
        if dp > 1 and level >= 2:
            comms.append(Comm(s, "reduce-scatter", (DATA,), (dp - 1) / dp * grad_bytes,
                              f"gradient sync over replicas (zero {level})"))
        elif dp > 1:
            comms.append(Comm(s, "all-reduce", (DATA,), 2.0 * (dp - 1) / dp * grad_bytes, "gradient sync over replicas"))
        if dp > 1 and level >= 1:
            comms.append(Comm(s, "all-gather", (DATA,), (dp - 1) / dp * grad_bytes,
                              f"zero {level}: stage parameters over replicas"))
        sends = (s < num_stages - 1) + (s > 0)
        if sends:
            comms.append(Comm(s, "collective-permute", (STAGE,), float(schedule.num_ticks * sends *
                                                                      program.message_width * 4),
                              "activations to the next stage, gradients to the previous (every tick)"))
    import dataclasses as dc
    infos = [dc.replace(t, comm_bytes=sum(c.bytes for c in comms if c.taskgraph == t.index)) for t in infos]
    return Plan(cluster=cluster, config=config, layout=layout, task_graphs=tuple(infos), virtual_devices=tuple(vds),
                batch_sizes=(full.global_batch // dp,) * layout.size, global_batch=full.global_batch,
                param_specs={p: P(STAGE) for p in cap.param_paths}, patterns=(), comms=tuple(comms), memory=memory,
                program=program, schedule=schedule, batch_couplings=tuple(parts.sem.lines()),
                stage_layers=tuple(_layers(full, stage_of_eqn, s) for s in range(num_stages)))


def _stage_labels(cap, stage_of_eqn, num_stages):
    labels = []
    for s in range(num_stages):
        tgs = sorted({cap.assign[(i,)] for i, st in enumerate(stage_of_eqn) if st == s})
        strategies = sorted({cap.taskgraphs[t].strategy.label() for t in tgs if cap.taskgraphs[t].annotated})
        labels.append(", ".join(strategies) or "auto")
    return labels


def _layers(cap, stage_of_eqn, s) -> tuple[str, ...]:
    """Names of the model's top-level layers (Flax module paths) whose equations are in stage s."""
    from whalex.balance.partition import layer_key
    names = []
    for i, st in enumerate(stage_of_eqn):
        key = layer_key(cap.jaxpr.jaxpr.eqns[i]) if st == s else None
        if key is not None and key.split("/")[-1] not in names:
            names.append(key.split("/")[-1])
    return tuple(names)


def plan(loss_fn: Callable, params, batch, optimizer=None, config=None, cluster=None,
         has_aux: bool = False, model_state=None, rng=None) -> Plan:
    """Plan `loss_fn(params, batch)` for a cluster without running it (abstract clusters too);
    `model_state` / `rng` as in `Step.init`, and `params` may be an NNX module."""
    if nnx_lib.is_module(params):
        nm, params, model_state = nnx_lib.NnxModel.split(params)
        loss_fn = nm.wrap(loss_fn, has_aux)
    return build_plan(loss_fn, params, batch, optimizer, config, cluster, has_aux, model_state, rng)


def _check_not_donated(state) -> None:
    """Refuse a state whose buffers an earlier step consumed: the jitted step donates its state, and
    running it again on donated buffers crashes the process instead of raising."""
    if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
        raise PlanError("this state was consumed by an earlier step (the step donates its state argument, so its "
                        "arrays are deleted); use the state returned by that step: state, metrics = step(state, "
                        "batch). If you re-ran a notebook cell, re-run step.init(params, batch) first.")


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
        self._nnx: NnxModel | None = None        # step.init(nnx_module, batch): the module's static structure

    @property
    def plan(self) -> Plan:
        if self._last is None:
            raise PlanError("the step has no plan yet: call step.init(params, example_batch) first.")
        return self._last

    def _key(self, params, batch):
        return jax.tree.structure((params, batch)), tuple(
            (np.shape(x), str(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype))
            for x in jax.tree.leaves((params, batch)))

    def _plan_for(self, params, batch, model_state=None, rng=None) -> Plan:
        key = self._key(params, batch)
        if key not in self._plans:
            loss_fn = self._nnx.wrap(self.loss_fn, self.has_aux) if self._nnx is not None else self.loss_fn
            p = build_plan(loss_fn, params, batch, self.optimizer, self._config, self._cluster, self.has_aux,
                           model_state, rng)
            if p.cluster.is_abstract:
                raise PlanError("an abstract cluster can plan and lower but not run; use wh.plan(...) with it, "
                                "or Cluster.detect() / Cluster(kinds=...) to train.")
            self._plans[key] = p
            self._jitted[key] = p.program.jitted()
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
        if nnx_lib.is_module(params):
            if model_state is not None:
                raise PlanError("step.init(model, batch) with an NNX module takes its model state from the module; "
                                "do not pass model_state=.")
            self._nnx, params, model_state = nnx_lib.NnxModel.split(params)
        p = self._plan_for(params, example_batch, model_state, rng)
        state = p.program.init_state(params, model_state, rng)
        key = self._key(state.params, example_batch)       # pipelines carry packed parameters
        self._plans[key] = p
        self._jitted[key] = self._jitted[self._key(params, example_batch)]
        return state

    def __call__(self, state: TrainState, batch):
        if not isinstance(state, TrainState):
            raise PlanError("step(state, batch) takes the wh.TrainState returned by step.init(params, batch).")
        _check_not_donated(state)
        key = self._key(state.params, batch)
        p = self._plans.get(key)
        if p is None:
            if self._last is not None and self._last.schedule is not None:
                raise PlanError("the batch shapes differ from the ones this pipeline was planned for; call "
                                "step.init(params, batch) with the new shapes.")
            p = self._plan_for(state.params, batch, state.model_state, state.rng)
        self._last = p
        return self._jitted[key](state, p.place_batch(batch))

    def params(self, state: TrainState):
        """The parameters of `state` as the caller's pytree (unpacks pipeline stage buffers)."""
        return self.plan.program.unpack_params(state.params)

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
