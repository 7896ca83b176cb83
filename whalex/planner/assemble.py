"""One place that turns what a planner chose into a `Plan`: the rows of `plan.task_graphs`
(parameters read, FLOPs counted from the jaxpr, predicted traffic), the per-device memory (the
program's stored state, and the predicted peak of its step, traced when first asked) and the Plan
record. The planners (`spmd`, `uneven`, `pipeline`, `hybrid`) decide; this module adds up."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from whalex.balance.profile import taskgraph_flops
from whalex.jaxpr.capture import Captured
from whalex.memory import plan_memory, with_peak
from whalex.memory.peak import Peak, traced_peak
from whalex.mesh.virtual import MeshLayout, VirtualDevice
from whalex.plan import CompiledStep, Plan, TaskGraphInfo
from whalex.planner.common import Request
from whalex.records.comm import Comm
from whalex.records.lazy import Lazy
from whalex.records.program import StepProgram


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of `plan.task_graphs` as a planner chose it: a TaskGraph, or a pipeline stage."""

    index: int
    label: str                   # "split(8)", "stage 0: replicate(1)"
    annotated: bool
    num_eqns: int
    params: tuple[int, ...]      # the parameter leaves it reads


def taskgraph_rows(cap: Captured) -> list[Row]:
    """One row per TaskGraph of `cap`."""
    return [Row(t.index, t.strategy.label(), t.annotated, t.num_eqns, tuple(t.params)) for t in cap.taskgraphs]


@dataclasses.dataclass(frozen=True)
class Work:
    """Where a plan's FLOPs are counted: the loss captured at some batch size, the row of each
    top-level equation, and the factor from that capture to one step over the global batch."""

    captured: Captured
    assign: dict
    scale: float = 1


def assemble(req: Request, program: StepProgram, layout: MeshLayout, vds: Sequence[VirtualDevice],
             rows: Sequence[Row], work: Work, *, batch_sizes: Sequence[int], global_batch: int, param_specs: dict,
             comms: Sequence[Comm] = (), comm_scale: float = 1, sharding=None, stage_bytes: float = 0.0,
             **fields) -> Plan:
    """The Plan of `program` on `layout`: `rows` with their VirtualDevices `vds`; `comms` are the
    collectives the planner predicts (each row's traffic: the sum of its own, times `comm_scale`);
    `sharding`, the sharding patterns' decisions (patterns and coverage); `stage_bytes`, what a
    device holds while computing beside its stored state, once as parameters and once as gradients
    (a pipeline stage's gathered parameter row and its accumulator). `fields`: the Plan's other
    fields (balance, batch_couplings, schedule, stage_layers)."""
    cap = work.captured
    flops = [f * work.scale for f in taskgraph_flops(cap.jaxpr, work.assign, len(rows), cap.num_params)]
    invars = cap.jaxpr.jaxpr.invars
    infos = []
    for row, vd, f in zip(rows, vds, flops):
        sizes = [int(np.prod(invars[i].aval.shape)) for i in row.params]
        nbytes = sum(s * np.dtype(invars[i].aval.dtype).itemsize for s, i in zip(sizes, row.params))
        traffic = float(sum(c.bytes for c in comms if c.taskgraph == row.index) * comm_scale)
        infos.append(TaskGraphInfo(row.index, row.label, row.annotated, vd.device_count, vd.devices, vd.nested_dp,
                                   row.num_eqns, sum(sizes), float(nbytes), f, traffic))
    memory = plan_memory(program.state_layout(), req.cluster.specs[: layout.size])
    if stage_bytes:
        memory = [dataclasses.replace(d, params=d.params + stage_bytes, grads=d.grads + stage_bytes) for d in memory]
    peak = predicted_peak(program)
    return Plan(cluster=req.cluster, config=req.config, layout=layout, task_graphs=tuple(infos),
                virtual_devices=tuple(vds), batch_sizes=tuple(batch_sizes), global_batch=global_batch,
                param_specs=param_specs, patterns=sharding.choices if sharding is not None else (),
                coverage=sharding.coverage if sharding is not None else (), comms=tuple(comms),
                memory=with_peak(memory, peak.get), program=program, predicted_peak=peak, **fields)


def with_program(plan: Plan, program: StepProgram, **fields) -> Plan:
    """`plan` carried out by another program over the same stored state (a hybrid's backbone on
    uneven rows): the predicted peak is the new program's, nothing of the old one's compiled step
    is kept; `fields` replace the Plan's others."""
    peak = predicted_peak(program)
    return dataclasses.replace(plan, program=program, memory=with_peak(plan.memory, peak.get), predicted_peak=peak,
                               compiled=CompiledStep(), **fields)


def predicted_peak(program: StepProgram) -> Lazy[Peak | None]:
    """The predicted per-device memory of `program`'s step as `wh.parallelize` runs it, traced when
    first read (planning stays free of the trace until a view or a caller asks): memory replays the
    traced step, never the program."""
    return Lazy(lambda: traced_peak(program.traced_step()))
