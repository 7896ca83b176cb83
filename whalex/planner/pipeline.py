"""The pipeline plan (Whale sections 3.1.2 and 4): stages on disjoint devices (placed by
`balance.partition.stage_devices`), micro-batches under a schedule, nested data parallelism over
pipeline replicas."""
from __future__ import annotations

import dataclasses

import numpy as np
from jax.sharding import PartitionSpec as P

from whalex import _compat as C
from whalex.balance.partition import stage_devices
from whalex.errors import PlanError
from whalex.jaxpr.batch_dependence import traces_alike
from whalex.jaxpr.module_paths import layer_key
from whalex.loss.align import refusal
from whalex.lowering.pipeline import DATA, MODEL, STAGE, PipelineProgram
from whalex.memory import MemoryOptions
from whalex.memory.layers import find_layers
from whalex.mesh.virtual import MeshLayout, VirtualDevice
from whalex.plan import Plan
from whalex.planner.assemble import Row, Work, assemble
from whalex.planner.common import Request, configure_memory, loss_parts
from whalex.planner.patterns import plan_shardings
from whalex.planner.stage_cut import cut_stages
from whalex.planner.stage_head import head_collectives, head_equations, head_rows
from whalex.primitives.scopes import Strategy
from whalex.records.lazy import Lazy
from whalex.records.schedules import make_schedule


def model_degree(cap) -> int:
    """Devices of the `model` axis for split TaskGraphs inside pipeline stages (1: none). Every split
    TaskGraph of a pipeline needs the same explicit device count."""
    counts = {tg.strategy.device_count for tg in cap.taskgraphs if tg.strategy.kind == "split"}
    if not counts:
        return 1
    if None in counts or len(counts) > 1:
        raise PlanError(f"split TaskGraphs inside pipeline stages ask for {sorted(map(str, counts))} devices; "
                        "give every wh.split(n) inside a pipeline the same explicit n (the size of the stages' "
                        "`model` axis).")
    return counts.pop()


@dataclasses.dataclass(frozen=True)
class _Stages:
    """The pipeline's shape: S stages of V interleaved chunks (chunk c on stage c % S), the chunk and
    the stage of every equation, and the modules per stage (None: named from the equations)."""

    num_chunks: int
    num_stages: int
    chunk_of_eqn: list
    stage_of_eqn: list
    stage_layers: list | None


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The pipeline's mesh: its axes, the device grid [replica][stage x model], and with split
    TaskGraphs inside the stages their sharding over `model`."""

    layout: MeshLayout
    grid: list
    sharding: object = None
    model_dims: tuple = ()
    constraints: object = None


def pipeline_plan(req: Request, full, stage_of_eqn, strategies, stage_layers=None, rule: str = "",
                  virtual_stages: int = 1) -> Plan:
    """The pipeline of `stage_of_eqn`, each stage's VirtualDevice recording its strategy in
    `strategies`; `stage_layers` names the modules per stage (by default the top-level layers of each
    stage's equations); `rule` says why this is a pipeline. Split TaskGraphs inside the stages make it 3D: a
    ('data', 'stage', 'model') mesh, the split layers sharded over `model` by the sharding patterns. With
    `virtual_stages` V > 1, `stage_of_eqn` (and `stage_layers`) name S x V interleaved chunks, chunk c on
    stage c % S."""
    config, cluster = req.config, req.cluster
    m, V = config.num_micro_batch, virtual_stages
    # decide: the stages, the degrees, the micro-batch loss, the schedule, the devices and the mesh
    st = _stages(stage_of_eqn, stage_layers, V)
    num_stages, stage_of_eqn = st.num_stages, st.stage_of_eqn
    mp, dp, micro = _degrees(cluster, full, num_stages, m)
    cap, parts = _micro_batch_loss(req, full, dp, m, micro)
    cut = cut_stages(cap, st.chunk_of_eqn, st.num_chunks)
    schedule = make_schedule(config.schedule, num_stages, m, V)
    placement = stage_devices(cluster, num_stages, config.hardware_aware)   # [stage][replica] -> device
    lay = _layout(cap, config, placement, dp, num_stages, mp)
    # build: lowering's program
    program = _program(req, full, cap, cut, schedule, lay, dp, mp, parts)
    # report: the stage rows, and the collectives the program reports (the split layers' among them)
    rows, vds = _stage_rows(full, st, cut, program, strategies, placement, dp, mp)
    comms = program.collectives()
    # assemble: the state is stored spread over every device; while computing, a device also holds
    # its stage's gathered parameter row and the row's gradient accumulator (stage_bytes)
    grad_bytes = program.param_width * np.dtype(program.param_dtype).itemsize
    assign = {(i,): s for i, s in enumerate(stage_of_eqn)}
    return assemble(req, program, lay.layout, vds, rows, Work(cap, assign, m * dp),
                    batch_sizes=(full.global_batch // dp,) * lay.layout.size, global_batch=full.global_batch,
                    param_specs=dict(zip(cap.param_paths, program.param_spec_list())), comms=comms,
                    sharding=lay.sharding, stage_bytes=grad_bytes, schedule=schedule,
                    batch_couplings=Lazy.of(tuple(parts.sem.lines())), placement=rule,
                    stage_layers=tuple(st.stage_layers) if st.stage_layers is not None else
                    tuple(stage_layer_names(full, stage_of_eqn, s) for s in range(num_stages)))


def _stages(stage_of_eqn, stage_layers, V: int) -> _Stages:
    """Stages from chunks: `stage_of_eqn` names S x V chunks; with V > 1 each stage's layers are
    those of its chunks."""
    num_chunks = max(stage_of_eqn) + 1 if stage_of_eqn else 1
    num_stages = num_chunks // V
    chunk_of_eqn, stage_of_eqn = list(stage_of_eqn), [c % num_stages for c in stage_of_eqn]
    if stage_layers is not None and V > 1:
        stage_layers = [tuple(n for c in range(s, num_chunks, num_stages) for n in stage_layers[c])
                        for s in range(num_stages)]
    return _Stages(num_chunks, num_stages, chunk_of_eqn, stage_of_eqn, stage_layers)


def _degrees(cluster, full, num_stages: int, m: int) -> tuple[int, int, int]:
    """(model degree, pipeline replicas, micro-batch rows); PlanError when the cluster or the global
    batch does not divide."""
    k = cluster.size
    mp = model_degree(full)
    if k % (num_stages * mp):
        raise PlanError(f"{num_stages} pipeline stages x split({mp}) need a multiple of {num_stages * mp} devices, but "
                        f"the cluster has {k}; use a stage count or split degree that divides it.")
    dp = k // (num_stages * mp)            # nested data parallelism (includes replicate(n) inside stages)
    if full.global_batch % (dp * m):
        raise PlanError(
            f"the global batch of {full.global_batch} cannot be split into {m} micro-batches on each of the "
            f"{dp} pipeline replicas; use a batch size that is a multiple of {dp * m}.")
    return mp, dp, full.global_batch // (dp * m)


def _micro_batch_loss(req: Request, full, dp: int, m: int, micro: int):
    """(the loss at one micro-batch ending in its sums over the batch, its loss contract); PlanError
    when the micro-batch traces differently or the loss is not affine in its sums."""
    cap = req.capture(micro)
    way_out = (f"a global batch of {dp * m * (micro + 1)} or another larger multiple of {dp * m} ({m} micro-batches "
               f"on each of the {dp} pipeline replicas, of more than {micro} samples each), or a plan without a "
               "pipeline")
    if not traces_alike(cap.jaxpr.jaxpr, full.jaxpr.jaxpr):
        raise PlanError(refusal(cap, full, "pipeline micro-batches", way_out))
    parts = loss_parts(cap, full, req.config, "pipeline micro-batches", way_out)
    if not parts.sem.affine:
        raise PlanError("the loss is not affine in its sums over the batch (e.g. the log of a mean); a pipeline "
                        "cannot split its gradient over micro-batches in one pass. Write the loss as a sum or mean "
                        "of per-example terms, or use a plan without micro-batches.")
    return parts.body(parts.part_outputs()[0]), parts   # stages end in the loss's sums over each micro-batch


def _layout(cap, config, placement, dp: int, num_stages: int, mp: int) -> _Layout:
    """The mesh over the stages' devices; with split TaskGraphs (mp > 1) a `model` axis and the split
    layers' sharding, PlanError for what is not built for them (padding, ZeRO, offload)."""
    if mp == 1:
        grid = [[placement[s][r] for s in range(num_stages)] for r in range(dp)]
        return _Layout(MeshLayout((DATA, STAGE), (dp, num_stages)), grid)
    layout = MeshLayout((DATA, STAGE, MODEL), (dp, num_stages, mp))
    grid = [[placement[s][r * mp + j] for s in range(num_stages) for j in range(mp)] for r in range(dp)]
    sharding = stage_shardings(cap, mp)
    model_dims = tuple(next((d for d, a in enumerate(spec) if a is not None), None)
                       for spec in sharding.param_specs)
    if sharding.padding:
        leaf, d, k = sharding.padding[0]
        raise PlanError(f"split({k}) inside a pipeline stage would pad {cap.param_paths[leaf]} (dimension {d} of "
                        f"{cap.jaxpr.jaxpr.invars[leaf].aval.shape[d]}, which {k} does not divide); padded "
                        "parameters are not built for pipeline stages yet. Use a split degree that divides it.")
    if config.zero_level or config.offload:
        raise PlanError("ZeRO and offload are not built for pipelines with split TaskGraphs inside the stages yet; "
                        "drop Config(zero=...)/offload, or the split annotations inside the stages.")
    return _Layout(layout, grid, sharding, model_dims, sharding.constraints)


def _program(req: Request, full, cap, cut, schedule, lay: _Layout, dp: int, mp: int, parts) -> PipelineProgram:
    """The PipelineProgram on the mesh, with remat="full" each stage's layers checkpointed; PlanError for
    other remat modes or activation offload, which a pipeline's recomputation of each stage replaces."""
    config, cluster = req.config, req.cluster
    ordered = [cluster.devices[i] for row in lay.grid for i in row] if cluster.devices is not None else None
    mesh = lay.layout.build(ordered)
    mem = MemoryOptions.from_config(config, ((DATA,),) * cap.num_params)
    planned = tuple(lay.sharding.comms) if lay.sharding is not None else ()
    if config.remat not in (None, "full") or "activations" in (config.offload or ()):
        raise PlanError(f"a pipeline recomputes each stage's forward from its stashed input, and remat='full' "
                        f"checkpoints each layer inside it; remat={config.remat!r} / offload={config.offload!r} are "
                        "not supported with pipelines. Use remat=None or 'full' and offload 'opt_state'/'params' only.")
    layer_cuts = find_layers(cap).cuts if config.remat == "full" else ()
    constraints, head_comms = lay.constraints, ()
    head = head_equations(cap, list(cut.eqns[-1]))
    rows_split = head_rows(cap, head, mp, full.global_batch // (dp * schedule.num_micro_batch))
    if rows_split:
        constraints = {**rows_split, **constraints}
        last = (cut.num_stages - 1) % schedule.num_stages
        head_comms = head_collectives(cap, head, mp, schedule.num_micro_batch, last)
    program = PipelineProgram(cap, cut, schedule, mesh, req.optimizer, cluster.platform, full.global_batch, dp, mem,
                              parts=parts, model_parallel=mp, model_dims=lay.model_dims, constraints=constraints,
                              model_comms=planned, head_comms=head_comms, layer_cuts=layer_cuts)
    _ = program.param_dtype
    num_stages = schedule.num_stages
    return configure_memory(program, config.replace(remat=None), cluster, [(DATA,)] * num_stages)


def _stage_rows(full, st: _Stages, cut, program, strategies, placement, dp: int, mp: int):
    """(the plan's row per stage, the VirtualDevice per stage)."""
    num_stages, num_chunks = st.num_stages, st.num_chunks
    labels = stage_labels(full, st.stage_of_eqn, num_stages)
    held = [tuple(sorted({p for c in range(s, num_chunks, num_stages) for p in cut.params[c]}))
            for s in range(num_stages)]
    rows = [Row(s, f"stage {s}: {labels[s]}", True, len(program.device_eqns[s]), held[s]) for s in range(num_stages)]
    vds = [stage_virtual_device(full, st.stage_of_eqn, s, strategies[s], mp,
                                tuple(tuple(placement[s][r * mp:(r + 1) * mp]) for r in range(dp)))
           for s in range(num_stages)]
    return rows, vds


def stage_virtual_device(cap, stage_of_eqn, s: int, strategy: Strategy, mp: int, groups) -> VirtualDevice:
    """Stage `s` as a VirtualDevice: its strategy, the `mp` devices of each pipeline replica, and the
    axes its weights and its micro-batch are split over."""
    tgs = {cap.taskgraphs[cap.assign[(i,)]] for i, st in enumerate(stage_of_eqn) if st == s}
    if any(over_model(t, mp) for t in tgs):
        return VirtualDevice(s, strategy, mp, groups, (), (DATA, MODEL))
    return VirtualDevice(s, strategy, mp, groups, (MODEL,) if mp > 1 else (), (DATA,))


def stage_shardings(cap, mp: int):
    """The sharding patterns of the split TaskGraphs inside the stages, planned over a `model` axis of
    `mp` devices alone: inside a stage's shard_map, `data` and `stage` are manual and only `model`
    is left to GSPMD, so the constraints name `model` only."""
    layout = MeshLayout((MODEL,), (mp,))
    vds = [VirtualDevice(tg.index, tg.strategy, mp if tg.strategy.kind == "split" or over_model(tg, mp) else 1,
                         (tuple(range(mp)),), (MODEL,) if tg.strategy.kind == "split" else (),
                         (MODEL,) if over_model(tg, mp) else ()) for tg in cap.taskgraphs]
    try:
        sharding = plan_shardings(cap, vds, layout)
    except PlanError as e:
        raise PlanError(f"{e} (inside a pipeline stage, each micro-batch of {cap.global_batch} samples on a pipeline "
                        "replica must divide over the stage's devices)") from None
    return dataclasses.replace(sharding, constraints={**batch_over_model(cap, mp), **sharding.constraints})


def over_model(tg, mp: int) -> bool:
    """An annotated `replicate(mp)` stage of a 3D pipeline: its `mp` devices per replica are data
    parallel (each takes 1/mp of the micro-batch, Whale's replicate), over the `model` axis."""
    return tg.annotated and tg.strategy.kind == "replicate" and tg.strategy.device_count == mp > 1


def batch_over_model(cap, mp: int) -> dict:
    """Constraints that split the micro-batch over `model` where a `replicate(mp)` stage reads a batch
    leaf; XLA's partitioner carries the split through the stage and gathers it where a value leaves."""
    batch = {v for v in cap.batch_vars if v.aval.shape and v.aval.shape[0] == cap.global_batch}
    out = {}
    for i, eqn in enumerate(cap.jaxpr.jaxpr.eqns):
        if over_model(cap.taskgraphs[cap.assign[(i,)]], mp):
            out.update({((i,), "in", pos): P(MODEL) for pos, v in enumerate(eqn.invars)
                        if not isinstance(v, C.Literal) and v in batch})
    return out


def stage_labels(cap, stage_of_eqn, num_stages):
    labels = []
    for s in range(num_stages):
        tgs = sorted({cap.assign[(i,)] for i, st in enumerate(stage_of_eqn) if st == s})
        strategies = sorted({cap.taskgraphs[t].strategy.label() for t in tgs if cap.taskgraphs[t].annotated})
        labels.append(", ".join(strategies) or "auto")
    return labels


def stage_layer_names(cap, stage_of_eqn, s) -> tuple[str, ...]:
    """Names of the model's top-level layers (Flax module paths) whose equations are in stage s."""
    names = []
    for i, st in enumerate(stage_of_eqn):
        key = layer_key(cap.jaxpr.jaxpr.eqns[i]) if st == s else None
        if key is not None and key.split("/")[-1] not in names:
            names.append(key.split("/")[-1])
    return tuple(names)
