"""The GSPMD plan: collocated TaskGraphs in one program on one mesh (micro-batches accumulate
gradients), with the decisions that stay inside it: uneven class shards of a split head
(Algorithm 1 over the class dimension), expert parallelism for MoE calls, and ZeRO 2/3 on pure
data parallelism as explicit collectives."""
from __future__ import annotations

import dataclasses

import numpy as np
from jax.sharding import PartitionSpec as P

from whalex import _compat as C
from whalex.balance import cost
from whalex.balance.columns import plan_columns
from whalex.balance.profile import taskgraph_flops
from whalex.errors import PlanError
from whalex.jaxpr.batch_dependence import source
from whalex.loss.analysis import analyse
from whalex.loss.evaluation import PartLoss
from whalex.lowering.groups import ShardGroups, runs_per_shard, same_outputs
from whalex.lowering.padding import EvenPadding
from whalex.lowering.step import Program
from whalex.lowering.uneven import UnevenProgram
from whalex.lowering.uneven_split import UnevenCall, uneven_overrides
from whalex.memory import MemoryOptions, zero, zero_sharded
from whalex.mesh.virtual import DATA, mesh_layout, virtual_devices
from whalex.moe.parallel import expert_overrides
from whalex.ops import HEAD_NAME
from whalex.plan import Plan
from whalex.planner.assemble import Work, assemble, taskgraph_rows
from whalex.planner.common import Request, configure_memory, loss_parts
from whalex.planner.patterns import plan_shardings
from whalex.planner.patterns.stock import fuse_stock_layers
from whalex.planner.split_cost import lowered_split_report
from whalex.records.call_names import parse_attention_name, parse_mlp_name
from whalex.records.lazy import Lazy


def spmd_plan(req: Request, cap, report=None) -> Plan:
    """Collocated TaskGraphs in one GSPMD program; micro-batches accumulate gradients."""
    config, cluster, optimizer = req.config, req.cluster, req.optimizer
    m = config.num_micro_batch
    # decide: the mesh, the sharding patterns, uneven heads and experts, ZeRO, the loss contract
    cap, full, layout, vds, sharding = _shardings(req, cap, m)
    mesh = layout.build(cluster.devices)
    sharding, overrides, padded, split_report = _uneven_and_experts(req, cap, m, layout, vds, sharding, mesh)
    axis_sizes = dict(zip(layout.axis_names, layout.axis_sizes))
    readers = [[t.index for t in cap.taskgraphs if i in t.params] for i in range(cap.num_params)]
    mem = MemoryOptions.from_config(config, zero.data_parallel_axes(readers, [v.batch_axes for v in vds], axis_sizes))
    parts = _micro_batch_parts(cap, full, config, m)
    fields, once = reduce_once(req, full, m, layout, vds, sharding, overrides, parts, readers)
    # build: lowering's program (ZeRO 2/3 on data parallelism: explicit collectives), its memory records
    program = Program(cap, sharding, mesh, optimizer, cluster.platform, m, overrides, padded, memory=mem,
                      **{"parts": parts, **fields})
    if mem.zero_level >= 2 and layout.axis_names == (DATA,) and layout.size > 1 and not overrides:
        program = zero_data_parallel(req, full, m, mesh, mem) or program
    program = configure_memory(program, config, cluster, [vd.batch_axes for vd in vds] if isinstance(program, Program)
                               else [(DATA,)] * len(program.captured.taskgraphs), req.capture)
    # report: the collectives the program runs, the loss contract's lines
    comms = program.collectives() if isinstance(program, Program) else _zero_comms(cap, sharding, program, readers)
    parts = program.parts
    couplings = Lazy.of(tuple(parts.sem.lines()) + once) if parts is not None else \
        Lazy(lambda: whole_batch_couplings(req, full))   # found when asked (one more trace)
    # assemble
    first = vds[cap.assign[(0,)]] if cap.assign else vds[0]
    return assemble(req, program, layout, vds, taskgraph_rows(cap), Work(cap, cap.assign, m),
                    batch_sizes=(full.global_batch // layout.axis_size(first.batch_axes),) * layout.size,
                    global_batch=full.global_batch, param_specs=dict(zip(cap.param_paths, sharding.param_specs)),
                    comms=comms, sharding=sharding, balance=report or split_report, batch_couplings=couplings)


def _shardings(req: Request, cap, m: int):
    """(the capture at the micro-batch size, the whole-batch capture, mesh layout, VirtualDevices, the
    ShardingPlan): stock Flax MLPs and attention run as wh.ops calls on hardware-aware plans."""
    config, cluster = req.config, req.cluster
    full = cap
    if m > 1:
        cap = req.capture(full.global_batch // m)
    strategies = [t.strategy for t in cap.taskgraphs]
    layout = mesh_layout(strategies, cluster.size)
    vds = virtual_devices(strategies, layout)
    if config.hardware_aware and m == 1:
        cap = full = fuse_stock_layers(cap, vds, layout, cluster)
    try:
        sharding = plan_shardings(cap, vds, layout, config.matmul_pattern)
    except PlanError as e:
        if m > 1:
            raise PlanError(f"{e} (with num_micro_batch={m}, each micro-batch of {cap.global_batch} samples "
                            "must divide over the data-parallel replicas)") from None
        raise
    return cap, full, layout, vds, sharding


def _uneven_and_experts(req: Request, cap, m: int, layout, vds, sharding, mesh):
    """(sharding, overrides, padded leaves, the uneven split's report): uneven class shards or blocks
    of split TaskGraphs on a heterogeneous model axis (Algorithm 1), expert-parallel MoE calls."""
    config, cluster, optimizer = req.config, req.cluster, req.optimizer
    overrides, split_report = None, None
    padded = {leaf: (EvenPadding(cap.jaxpr.jaxpr.invars[leaf].aval.shape[d], k), d) for leaf, d, k in sharding.padding}
    if config.hardware_aware and m == 1:
        found = uneven_heads(cap, vds, layout, sharding, cluster, optimizer)
        if found is not None:
            calls, head_padded, sharding, split_report = found
            split_report = lowered_split_report(split_report, calls, cap, cluster, optimizer,
                                                dict(zip(layout.axis_names, layout.axis_sizes)))
            overrides = uneven_overrides(calls, mesh)
            padded.update(head_padded)
    if sharding.experts:
        overrides = {**(overrides or {}), **expert_overrides(sharding.experts, mesh)}
    return sharding, overrides, padded or None, split_report


def _micro_batch_parts(cap, full, config, m: int) -> PartLoss | None:
    """The loss contract over the micro-batches (None without them)."""
    if m == 1:
        return None
    if config.comm_dtype is not None:
        raise PlanError(f"comm_dtype={config.comm_dtype!r} with num_micro_batch={m} on collocated TaskGraphs is "
                        "not lowered yet; use comm_dtype=None, or num_micro_batch=1.")
    b = cap.global_batch
    return loss_parts(cap, full, config, "micro-batches (gradient accumulation)",
                      f"num_micro_batch=1, or a global batch of {m * (b + 1)} or another larger multiple of {m} "
                      f"(micro-batches of more than {b} samples)")


def _zero_comms(cap, sharding, program, readers) -> tuple:
    """The collectives of ZeRO on data parallelism run as explicit collectives (an UnevenProgram of
    even counts): the sharding patterns' with ZeRO's in place of the gradient sums it shards."""
    level = program.memory_options.zero_level
    owner = {cap.param_paths[i]: (r[0] if r else 0) for i, r in enumerate(readers)}
    return tuple(zero.comms(sharding.comms, level, zero_sharded(program.state_layout(), cap.param_paths), owner))


def first_eqn(jaxpr, name: str):
    """The first equation of primitive `name` in `jaxpr` or in any jaxpr inside it, else None."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            return eqn
        for sub in C.sub_jaxprs(eqn):
            found = first_eqn(C.open_jaxpr(sub)[0], name)
            if found is not None:
                return found
    return None


def reduce_once(req: Request, full, m: int, layout, vds, sharding, overrides, parts, readers):
    """(Program fields, summary lines) for gradient accumulation:
    gradients kept per shard of the data axis inside the micro-batch loop and summed once after it
    (`Program.group_axis`, the loss contract then over one shard's rows), and per model shard for
    the replicate TaskGraphs of a collocated hybrid (`model_shards`). Where that is not exact or not
    built, the gradients are summed once per micro-batch as before, and the lines say why."""
    if m == 1:
        return {}, ()
    g = layout.axis_size((DATA,))
    unit, why = None, None
    if overrides:
        why = "expert-parallel or uneven calls run their own collectives"
    elif any(DATA in _axes(spec) for spec in sharding.param_specs):
        why = "a parameter is sharded over the data axis"
    elif full.global_batch % (m * g):
        why = f"{full.global_batch} samples do not divide into {m} x {g} parts"
    elif (conv := first_eqn(full.jaxpr.jaxpr, "conv_general_dilated")) is not None:
        why = (f"the convolution at {source(conv)}: its kernel gradient per shard is a feature-grouped convolution, "
               "which XLA's SPMD partitioner computes wrongly when its operands are sharded")
    else:
        unit, why = _shard_loss(req, full, full.global_batch // (m * g), "per data shard")
    shards, inner_why = model_shards(req, full, layout, vds, unit, readers) if unit is not None else (None, None)
    if why is None and g == 1 and shards is None:
        why = "the data axis has one device" + (f" and {inner_why}" if inner_why else "")
    if why is not None:
        return {}, (f"gradients: summed over the devices once per micro-batch ({m} times a step): {why}",)
    line = f"gradients: accumulated per '{DATA}' shard over the {m} micro-batches and summed over '{DATA}' once a step"
    fields = {"group_axis": DATA, "parts": unit}
    if shards is not None:
        groups, inner = shards
        fields.update(shard_groups=groups, shard_parts=inner)
        tgs = ", ".join(f"TG{t}" for t in sorted(groups.taskgraphs))
        line += f", and per {list(groups.axes)} shard for {tgs} (rows spread over them too), " \
            "summed over them once a step"
        line += inner_why or ""
    elif inner_why:
        line += "; replicate TaskGraphs' gradients are still summed over the model axes once per micro-batch: " \
            f"{inner_why}"
    return fields, (line,)


def _shard_loss(req: Request, full, rows: int, where: str):
    """(the loss contract over parts of `rows` samples, None) or (None, why it cannot be used)."""
    try:
        cap = req.capture(rows)
        sem = analyse(cap, full, per_part=req.config.batch_coupling == "per_part",
                      context="micro-batches (gradient accumulation)")
    except PlanError as e:
        return None, f"the loss cannot be evaluated {where} ({e})"
    if sem.accepted:
        return None, f"the loss's batch statistics are per micro-batch ({', '.join(sem.accepted)})"
    return PartLoss(sem, cap, full), None


def model_shards(req: Request, full, layout, vds, unit: PartLoss, readers):
    """((ShardGroups, the loss contract at one model shard's rows), None) for the TaskGraphs whose
    rows are spread over the model axes too (replicate beside split), or (None, why not)."""
    axes = tuple(a for a, n in zip(layout.axis_names, layout.axis_sizes) if a != DATA and n > 1)
    if not axes:
        return None, None
    size = layout.axis_size(axes)
    rows = unit.sem.part_rows
    if rows % size:
        return None, f"a part of {rows} samples does not divide over {size} model shards"
    inner, why = _shard_loss(req, full, rows // size, "per model shard")
    if inner is None:
        return None, why
    tgs = frozenset(vd.taskgraph for vd in vds if set(axes) <= set(vd.batch_axes))
    invars = unit.part.jaxpr.jaxpr.invars
    copied = frozenset(i for i, r in enumerate(readers) if r and set(r) <= tgs and
                       np.issubdtype(invars[i].aval.dtype, np.floating))
    groups = ShardGroups(axes, size, tgs, copied)
    body = unit.body(unit.part_outputs()[0])
    copied = runs_per_shard(body, same_outputs(body, inner), groups, unit.part.num_params)
    if not copied:
        return None, "no parameter is read by them alone, in segments whose values are all batch-major"
    left = [cap_path for i, cap_path in enumerate(unit.part.param_paths) if readers[i] and set(readers[i]) & tgs
            and i not in copied]
    note = (f"; {len(left)} parameter leaves they share or read outside such segments ({', '.join(left[:3])}"
            f"{', ...' if len(left) > 3 else ''}) are still summed over {list(axes)} once per micro-batch") \
        if left else None
    return (dataclasses.replace(groups, copied=copied), inner), note


def _axes(spec) -> set:
    """The mesh axes a PartitionSpec names."""
    out = set()
    for e in spec:
        if e is not None and e is not P.UNCONSTRAINED:
            out.update(e if isinstance(e, tuple) else (e,))
    return out


def whole_batch_couplings(req: Request, full) -> tuple[str, ...]:
    """The batch reductions of a loss that a plan computes whole (found against a half-batch trace)."""
    b = full.global_batch
    if b % 2 or b < 2:
        return ()
    try:
        half = req.capture(b // 2)
        return tuple(analyse(half, full, per_part=True).lines(whole=True))
    except PlanError:
        return ()


def zero_data_parallel(req: Request, full, m, mesh, mem):
    """ZeRO 2/3 on a pure data-parallel plan as explicit collectives: the shard_map program of
    uneven data parallelism with even counts, whose reduce-scatter XLA keeps on every backend
    (XLA's CPU compiler writes a GSPMD gradient reduce-scatter as all-reduce + dynamic-slice)."""
    n, b = mesh.size, full.global_batch
    if b % (n * m):
        return None
    unit = b // (n * m)
    cap = req.capture(unit)
    mem = dataclasses.replace(mem, zero_axes=((DATA,),) * cap.num_params)
    context = f"per-device parts (zero {mem.zero_level} on data parallelism)"
    sem = analyse(cap, full, per_part=True, context=context)
    if sem.accepted:
        return None              # the loss couples samples: the GSPMD program sees the whole batch (exact)
    parts = PartLoss(sem, cap, full)
    return UnevenProgram(cap, mesh, req.optimizer, req.cluster.platform, (m * unit,) * n, unit, b, mem, parts=parts)


def _model_shards(vd, layout, cluster, speeds_of=None):
    """For a split TaskGraph on one model axis: (axis, devices per model position, the slowest
    device's speed per position, its spread, the smallest memory per position); None when the
    positions are equally fast (the even plan applies). `speeds_of`: each device's speed (a split
    head's classes: `Cluster.head_speeds`), else the cluster's."""
    if vd.strategy.kind != "split" or len(vd.model_axes) != 1:
        return None
    axis = vd.model_axes[0]
    grid = np.asarray(range(layout.size)).reshape(layout.axis_sizes)
    model_dim = layout.axis_names.index(axis)
    per_model = np.moveaxis(grid, model_dim, -1).reshape(-1, layout.axis_sizes[model_dim])
    of = cluster.speeds if speeds_of is None else speeds_of
    slowest = [min(per_model[:, j], key=lambda d: of[d]) for j in range(per_model.shape[1])]
    speeds = [of[d] for d in slowest]
    if len(set(speeds)) == 1:
        return None
    spreads = None if cluster.spread is None else [cluster.spread[d] for d in slowest]
    caps = [min(cluster.specs[d].memory_bytes for d in per_model[:, j]) for j in range(per_model.shape[1])]
    return axis, per_model, speeds, spreads, caps


@dataclasses.dataclass(frozen=True)
class _UnevenOp:
    """A call the uneven split can shard: what it splits (`kind`), its weights and the dimension of
    each that holds the split units, and its MLP activation or attention causality."""

    name: str
    kind: str
    weights: tuple
    dims: tuple[int, ...]
    activation: object = None
    causal: object = None


def uneven_heads(cap, vds, layout, sharding, cluster, optimizer):
    """Uneven shards under split on a heterogeneous model axis, for `wh.ops.softmax_cross_entropy_head`
    (classes), `wh.ops.mlp` (hidden units) and `wh.ops.attention` (heads): (the UnevenCalls,
    padded, sharding, report), or None when the even plan applies."""
    jaxpr = cap.jaxpr.jaxpr
    params = {v: i for i, v in enumerate(jaxpr.invars[: cap.num_params])}
    calls, padded, specs, reports = [], {}, list(sharding.param_specs), []
    opt = 2.0 if optimizer is not None else 0.0
    recompute = cluster.platform == "cpu"      # lax.empty is a zero fill there: see uneven_split._Blocks
    for i, eqn in enumerate(jaxpr.eqns):
        op = _uneven_op(eqn)
        if op is None:
            continue
        vd = vds[cap.assign[(i,)]]
        # a head's classes split by their own speeds (the head's program, timed by calibrate)
        shards = _model_shards(vd, layout, cluster, cluster.head_speeds if op.kind == "classes" else None)
        if shards is None:
            continue
        axis, per_model, speeds, _, caps = shards
        cast = {e.outvars[0]: e.invars[0] for e in jaxpr.eqns[:i] if e.primitive.name == "convert_element_type"}
        weights = [cast.get(v, v) for v in op.weights]    # amp: the fp32 parameter behind the cast
        if any(w not in params for w in weights):
            continue
        names = [f"model shard {j} ({cluster.specs[per_model[0, j]].name})" for j in range(len(speeds))]
        units = weights[0].aval.shape[1]
        cols, bal, per_column = _columns(op, weights, units, speeds, caps, names, opt)
        batch_axes = tuple(a for a in vd.batch_axes if layout.axis_size((a,)) > 1)
        leaves = [params[w] for w in weights]
        for leaf, d in zip(leaves, op.dims):
            padded[leaf] = (cols, d)
            specs[leaf] = P(*([None] * d + [axis]))
        calls.append(_uneven_call(op, i, axis, batch_axes, cols, cap.global_batch, recompute))
        reports.append(_uneven_report(cap, i, op, leaves[0], cluster, (axis, per_model, speeds, shards[3], caps),
                                      cols, bal, per_column, units))
    if not calls:
        return None
    return tuple(calls), padded, dataclasses.replace(sharding, param_specs=tuple(specs)), reports[0]


def _uneven_op(eqn) -> _UnevenOp | None:
    """The head, MLP or attention call `eqn` is (by its name), or None."""
    name = str(eqn.params.get("name", "")) if C.is_call(eqn) else ""
    activation, causal = parse_mlp_name(name), parse_attention_name(name)
    if name == HEAD_NAME:
        return _UnevenOp(name, "classes", tuple(eqn.invars[1:3]), (1, 0), activation, causal)
    if activation is not None:
        return _UnevenOp(name, "hidden units", tuple(eqn.invars[1:4]), (1, 0, 0), activation, causal)
    if causal is not None:
        return _UnevenOp(name, "heads", tuple(eqn.invars[1:8]), (1, 0, 1, 0, 1, 0, 0), activation, causal)
    return None


def _columns(op: _UnevenOp, weights, units: int, speeds, caps, names, opt: float):
    """(the uneven layout of `units` over the model shards, Algorithm 1's balance, the bytes one unit
    stores: weights, gradients, optimizer state); PlanError when a device cannot hold the padded width."""
    itemsize = np.dtype(weights[0].aval.dtype).itemsize
    per_column = sum(np.prod(w.aval.shape) / w.aval.shape[d] for w, d in zip(weights, op.dims)) * itemsize * (2 + opt)
    width = int(np.prod(weights[0].aval.shape[2:])) if op.kind == "heads" else 1     # a head's columns
    cols, bal = plan_columns(units, speeds, caps, per_column, names, width, one_matmul=op.kind == "classes")
    for j, c in enumerate(caps):                                   # every device stores the padded width
        if cols.width * per_column > c:
            raise PlanError(f"{names[j]} cannot hold the padded shard of {cols.width} {op.kind} "
                            f"({cols.width * per_column / 2**30:.2f} GiB > {c / 2**30:.2f} GiB); use more devices "
                            "or hardware_aware=False.")
    return cols, bal, per_column


def _uneven_call(op: _UnevenOp, i: int, axis, batch_axes, cols, global_batch: int, recompute: bool) -> UnevenCall:
    """The UnevenCall that replaces equation `i`."""
    if op.name == HEAD_NAME:
        return UnevenCall((i,), "head", axis, batch_axes, cols, global_batch=global_batch)
    if op.causal is not None:
        return UnevenCall((i,), "attention", axis, batch_axes, cols, op.dims, causal=op.causal, recompute=recompute)
    return UnevenCall((i,), "mlp", axis, batch_axes, cols, op.dims, activation=op.activation, recompute=recompute)


def _uneven_report(cap, i: int, op: _UnevenOp, leaf: int, cluster, shards, cols, bal, per_column, units: int):
    """Algorithm 1's report for the uneven split of equation `i` over the model shards."""
    _, per_model, speeds, spreads, _ = shards
    tg_flops = taskgraph_flops(cap.jaxpr, {(j,): 0 if j == i else 1 for j in range(len(cap.jaxpr.jaxpr.eqns))}, 1,
                               cap.num_params)[0]
    even = [units // len(speeds)] * len(speeds)
    report = cost.report([cluster.specs[per_model[0, j]] for j in range(len(speeds))], speeds,
                         cols.counts, even, source=cluster.speed_source, unit=cols.chunk, applied=True,
                         shifted=bal.shifted, flops_per_sample=tg_flops / units,
                         state_bytes=cols.width * per_column, act_base=0.0, act_per_sample=0.0,
                         spreads=spreads)
    on = ("the slowest" if cluster.head_devices is None else
          f"device{'s' if len(cluster.head_devices) > 1 else ''} {', '.join(map(str, cluster.head_devices))}")
    timed = (f"; {on} at x{cluster.head_scale:.2f} their rows' speed, as the head's program ran fastest"
             if op.kind == "classes" and cluster.head_scale != 1.0 else "")
    return dataclasses.replace(report, kind=f"{op.kind} of {cap.param_paths[leaf]} (padded to {cols.width}{timed})")
