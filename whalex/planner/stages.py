"""Pipeline stages or shared devices (Whale sections 3.1.2 and 3.2.1): with micro-batches,
consecutive annotated TaskGraphs of one device count n become pipeline stages on disjoint devices,
whether each is `replicate(n)` or `split(n)`, with nested data parallelism over the rest of the
cluster; `Config(share_devices=True)` collocates them instead (micro-batches accumulate gradients).
`Placement` records the choice and the rule that made it, as the plan's summary prints it."""
from __future__ import annotations

import dataclasses

from whalex.errors import PlanError

SHARE = "Config(share_devices=True) collocates them instead (micro-batches then accumulate gradients)"


@dataclasses.dataclass(frozen=True)
class Placement:
    """Stages as tuples of TaskGraph indices (None: collocated), and the sentence saying which plan
    this is and why."""

    groups: tuple[tuple[int, ...], ...] | None
    rule: str

    @property
    def pipelined(self) -> bool:
        return self.groups is not None


def stage_groups(cap) -> tuple[tuple[int, ...], ...]:
    """TaskGraph indices per stage: each annotated TaskGraph starts a stage and un-annotated runs
    join the stage before them (or the first stage)."""
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
    return tuple(tuple(g) for g in groups)


def collocated(m: int, why: str) -> Placement:
    what = "collocated TaskGraphs" + (f", gradient accumulation over {m} micro-batches" if m > 1 else "")
    return Placement(None, f"{what}: {why}")


def pipeline_rule(num_stages: int, per_stage: int, dp: int, why: str) -> str:
    """The pipeline's sentence: stages, devices per stage and replica, nested data parallelism, why."""
    return (f"pipeline of {num_stages} stages on disjoint devices ({per_stage} per stage and replica), nested DP "
            f"{dp}: {why}")


def choose(cap, config, num_devices: int) -> Placement:
    """Stages on disjoint devices or collocated TaskGraphs for an annotated (not auto_parallel) model."""
    m, groups = config.num_micro_batch, stage_groups(cap)
    if len(groups) < 2:
        return collocated(m, "fewer than two annotated TaskGraphs (a pipeline needs two or more consecutive scopes)")
    if m == 1:
        return collocated(m, "num_micro_batch=1 (with micro-batches, consecutive annotated TaskGraphs of one device "
                             "count become pipeline stages)")
    if config.share_devices:
        return collocated(m, f"Config(share_devices=True) puts the {len(groups)} annotated TaskGraphs on the same "
                             "devices")
    annotated = [t for g in groups for t in (cap.taskgraphs[i] for i in g) if t.annotated]
    counts = sorted({t.strategy.device_count or num_devices for t in annotated})
    s = len(groups)
    if len(counts) > 1:
        raise PlanError(
            f"pipeline stages ask for different device counts {counts}: with num_micro_batch={m} the {s} annotated "
            "TaskGraphs are pipeline stages, and a pipeline replica is a grid of stages x n devices, so replicate or "
            "split stages inside a pipeline are not supported with different n. Give every stage's wh.replicate(n) / "
            f"wh.split(n) the same n, or {SHARE}.")
    n = counts[0]
    if s * n > num_devices:
        return collocated(m, f"{s} annotated TaskGraphs x {n} devices need {s * n} devices, more than the "
                             f"cluster's {num_devices}, so they share devices as in Whale's Example 2")
    if num_devices % (s * n):
        raise PlanError(
            f"{s} pipeline stages of {n} device(s) need a multiple of {s * n} devices, but the cluster has "
            f"{num_devices}; use a stage count or device count whose product divides it, or {SHARE}.")
    why = (f"num_micro_batch={m} with {s} consecutive annotated TaskGraphs of {n} device{'s' if n > 1 else ''} "
           "each (Config(share_devices=True) would collocate them)")
    return Placement(groups, pipeline_rule(s, n, num_devices // (s * n), why))
