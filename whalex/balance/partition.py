"""Automatic pipeline partitioning (Whale's `auto_parallel` + `num_task_graph`, Example 3).

The model is cut into units (`balance.layers`: module paths at increasing depths, then single
equations); each unit's forward+backward FLOPs are counted from its equations (`jaxpr.flops`) and
its memory from its parameter, gradient and optimizer-state bytes plus
the activations its stage stashes. Contiguous units are split into k stages minimising the slowest
stage's time (FLOPs / device FLOP/s) with every stage under its device's memory; among the cuts
that reach that time, boundaries between blocks are preferred. The coarsest granularity whose best
split is within `TOLERANCE` of the ideal (total time / total speed) is used.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import jax
import numpy as np

from whalex import _compat as C
from whalex.balance.layers import cut_penalties, granularities, stage_names
from whalex.balance.profile import FlopsCache, group_flops
from whalex.errors import PlanError
from whalex.jaxpr.module_paths import Unit
from whalex.records import schedules
from whalex.records.lockstep import TickTable

__all__ = ["AutoStages", "Layer", "auto_stages", "lockstep_time", "partition", "profile_layers",
           "refine_lockstep", "stage_devices"]

TOLERANCE = 0.10        # a granularity is fine enough when its slowest stage is within 10% of the ideal
SLACK = 0.05            # otherwise: the coarsest within 5% of the best granularity found
# a forward task's share of the FLOPs a backward task runs (its forward again, then the backward)
FORWARD_SHARE = schedules.RECOMPUTE_COSTS[0] / schedules.RECOMPUTE_COSTS[1]


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    eqns: tuple[int, ...]
    flops: float
    state_bytes: float       # parameters + gradients + optimizer state
    input_bytes: float       # activations entering the layer (stashed per in-flight micro-batch)


@dataclasses.dataclass(frozen=True)
class AutoStages:
    """What `auto_stages` decided: the stage of every top-level equation, the modules each stage
    holds, the granularity cut ("depth 3": module paths three deep) and the predicted stage FLOPs."""

    stage_of_eqn: tuple[int, ...]
    layers: tuple[tuple[str, ...], ...]
    granularity: str
    flops: tuple[float, ...]


def profile_layers(cap, optimizer=None, units: Sequence[Unit] | None = None, cache: FlopsCache | None = None,
                   opt_factor: float | None = None) -> list[Layer]:
    """FLOPs and memory of each unit (default: the model's top-level layers)."""
    units = units if units is not None else next(granularities(cap)).units
    flops = group_flops(cap.jaxpr, [list(u.eqns) for u in units], cache, cap.num_params)
    jaxpr = cap.jaxpr.jaxpr
    param_index = {v: k for k, v in enumerate(jaxpr.invars[: cap.num_params])}
    factor = _optimizer_factor(optimizer, cap) if opt_factor is None else opt_factor
    produced = {v: u for u, unit in enumerate(units) for i in unit.eqns for v in jaxpr.eqns[i].outvars}
    layers = []
    for u, unit in enumerate(units):
        ps, ins = set(), set()
        for i in unit.eqns:
            for v in jaxpr.eqns[i].invars:
                if isinstance(v, C.Literal):
                    continue
                if v in param_index:
                    ps.add(v)
                elif produced.get(v, u) < u:
                    ins.add(v)
        pbytes = sum(_nbytes(v) for v in ps)
        layers.append(Layer("/".join(unit.key) or f"op{unit.eqns[0]}", unit.eqns, flops[u],
                            pbytes * (2 + factor), sum(_nbytes(v) for v in ins)))
    return layers


def _nbytes(v) -> float:
    return float(np.prod(v.aval.shape, dtype=np.float64)) * np.dtype(v.aval.dtype).itemsize


def _optimizer_factor(optimizer, cap) -> float:
    """Optimizer-state bytes per parameter byte (Adam: 2)."""
    if optimizer is None:
        return 0.0
    invars = cap.jaxpr.jaxpr.invars[: cap.num_params]
    shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars]
    state = jax.eval_shape(optimizer.init, shapes)
    sbytes = sum(float(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))
    pbytes = sum(_nbytes(v) for v in invars)
    return sbytes / pbytes if pbytes else 0.0


def lockstep_time(stage_flops: Sequence[float], speeds: Sequence[float], ticks: TickTable,
                  exchange: float = 0.0) -> float:
    """Predicted compute time of one step of a pipeline run in ticks (whalex's SPMD loop: devices wait
    for each other at the ticks whose messages move, `schedules.lockstep_time`).

    `ticks` (`Schedule.tick_table`): per tick each stage's task kind and whether messages move. A backward
    recomputes its stage's forward from the stashed input, so it costs the stage's forward+backward
    FLOPs; a forward costs `FORWARD_SHARE` of them. With uneven speeds this, not the slowest stage's
    total, is what a cut changes: in 1F1B a fast stage's backward runs beside the slow stage's
    forward and the other way round, so a tick pairs unlike tasks. `exchange`: seconds each tick
    that moves a message adds."""
    per = np.asarray(stage_flops, np.float64) / np.asarray(speeds, np.float64)
    return ticks.time(per * FORWARD_SHARE, per, exchange=exchange)


def partition(flops: Sequence[float], state_bytes: Sequence[float], input_bytes: Sequence[float],
              speeds: Sequence[float], capacities: Sequence[float], micro_batch_in_flight=None,
              penalties: Sequence[float] | None = None, ticks: TickTable | None = None) -> list[int]:
    """Split layers 0..n-1 into len(speeds) contiguous non-empty stages.

    Minimises the slowest stage's time sum(flops)/speed, subject to each stage's memory
    (state bytes of its layers + its input activations x micro-batches in flight) fitting its
    device's capacity. With `penalties[a]` (the cost of a boundary before layer a), the split with
    the least total penalty among those reaching that time. With `ticks` (the schedule's
    `tick_table`) and unequal speeds, the boundaries are then moved one at a time while `lockstep_time` falls
    (`refine_lockstep`). Returns the first layer index of each stage. Pure; raises PlanError if no
    split fits.
    """
    n, k = len(flops), len(speeds)
    if k > n:
        raise PlanError(f"num_task_graph={k} stages but the model has only {n} layers to split; use at most {n}.")
    in_flight = micro_batch_in_flight or [k - s for s in range(k)]
    pf = np.concatenate([[0.0], np.cumsum(flops)])
    pm = np.concatenate([[0.0], np.cumsum(state_bytes)])
    inb = np.asarray(input_bytes, dtype=float)

    def stage_cost(s, a, b):          # layers a..b-1 on stage s, for an array of starts a
        mem = pm[b] - pm[a] + inb[a] * in_flight[s]
        return np.where(mem > capacities[s], np.inf, (pf[b] - pf[a]) / speeds[s])

    def solve(combine):
        best = np.full((k + 1, n + 1), np.inf)
        cut = np.zeros((k + 1, n + 1), dtype=int)
        best[0, 0] = 0.0
        for s in range(1, k + 1):
            for b in range(s, n - (k - s) + 1):
                a = np.arange(s - 1, b)
                c = combine(best[s - 1, a], stage_cost(s - 1, a, b), a)
                j = int(np.argmin(c))        # the first minimum: the earliest cut, as a loop would find
                if c[j] < np.inf:
                    best[s, b], cut[s, b] = c[j], a[j]
        return best[k, n], cut

    worst, cut = solve(lambda prev, cost, a: np.maximum(prev, cost))
    if worst == np.inf:
        big = max(range(n), key=lambda i: state_bytes[i])
        raise PlanError(
            f"no split of the model into {k} stages fits the devices' memory (largest layer needs "
            f"{state_bytes[big] / 2**30:.2f} GiB of state); use more stages, devices with more memory, or "
            "ZeRO/offload.")
    if penalties is not None:
        bound = worst * (1 + 1e-9)
        pen = np.asarray(penalties, dtype=float)
        _, cut = solve(lambda prev, cost, a: np.where(cost <= bound, prev + pen[a], np.inf))
    starts, b = [], n
    for s in range(k, 0, -1):
        a = cut[s, b]
        starts.append(int(a))
        b = a
    starts = starts[::-1]
    if ticks is not None and len(set(speeds)) > 1:
        fits = lambda s, a, b: pm[b] - pm[a] + inb[a] * in_flight[s] <= capacities[s]   # noqa: E731
        starts = refine_lockstep(starts, flops, speeds, ticks, fits)
    return starts


EXHAUSTIVE_CUTS = 5000      # at most this many contiguous cuts: try every one


def refine_lockstep(starts: Sequence[int], flops: Sequence[float], speeds: Sequence[float], ticks: TickTable,
                    fits=lambda s, a, b: True) -> list[int]:
    """The contiguous split (every stage non-empty and `fits(stage, first, end)`) that minimises
    `lockstep_time`: every split where there are at most EXHAUSTIVE_CUTS, else coordinate descent on
    the boundaries from `starts` (each boundary in turn moves to its best position between its
    neighbours, until no move lowers the time). The min-max split is the start and wins ties, so on
    equal speeds or a schedule without unlike pairs nothing moves."""
    n, k = len(flops), len(starts)
    pf = np.concatenate([[0.0], np.cumsum(flops)])
    cur = list(starts)

    def time(st):
        ends = list(st[1:]) + [n]
        if not all(fits(s, a, b) for s, (a, b) in enumerate(zip(st, ends))):
            return np.inf
        return lockstep_time([pf[b] - pf[a] for a, b in zip(st, ends)], speeds, ticks)

    best = time(cur)
    if math.comb(n - 1, k - 1) <= EXHAUSTIVE_CUTS:
        for inner in itertools.combinations(range(1, n), k - 1):
            t = time([0, *inner])
            if t < best * (1 - 1e-9):
                best, cur = t, [0, *inner]
        return cur
    improved = True
    while improved:
        improved = False
        for j in range(1, k):
            lo, hi = cur[j - 1] + 1, (cur[j + 1] if j + 1 < k else n) - 1
            for pos in range(lo, hi + 1):
                trial = cur[:j] + [pos] + cur[j + 1:]
                t = time(trial)
                if t < best * (1 - 1e-9):
                    best, cur, improved = t, trial, True
    return cur


def stage_devices(cluster, num_stages: int, hardware_aware: bool = True) -> list[list[int]]:
    """Device indices per stage (one per pipeline replica).

    Hardware-aware (section 3.3.2): devices sorted by memory, larger first (early stages stash more
    micro-batches), then speed; stage s takes the next `replicas` devices, so every replica gets
    the same mix of kinds. Otherwise Whale's sequential placement: replica r, stage s -> r*S+s.
    """
    k = cluster.size
    dp = k // num_stages
    uniform = len({(s.memory_bytes, sp) for s, sp in zip(cluster.specs, cluster.speeds)}) == 1
    if not hardware_aware or uniform:
        return [[r * num_stages + s for r in range(dp)] for s in range(num_stages)]
    order = sorted(range(k), key=lambda i: (-cluster.specs[i].memory_bytes, -cluster.speeds[i], i))
    return [order[s * dp:(s + 1) * dp] for s in range(num_stages)]


def auto_stages(cap, num_stages: int, cluster, optimizer=None, micro_fraction: float = 1.0,
                in_flight: Sequence[int] | None = None, hardware_aware: bool = True,
                ticks: TickTable | None = None, virtual_stages: int = 1) -> AutoStages:
    """Balanced stages for `num_stages` devices per pipeline replica.

    Granularities are tried coarse to fine (`balance.layers.granularities`) and the first whose
    best split has its slowest stage within `TOLERANCE` of the ideal is used; if none is, the
    coarsest within `SLACK` of the best one found. `micro_fraction` scales the captured
    (global-batch) activations to one device's micro-batch; `in_flight[s]` is how many
    micro-batches stage s stashes under the schedule; `ticks` (the schedule's `tick_table`) lets a
    heterogeneous cut minimise the lockstep step
    time (`refine_lockstep`). With `virtual_stages` V > 1 the `num_stages` are interleaved chunks,
    chunk c on device stage c % (num_stages / V), which lends it its speed and 1/V of its memory
    (`ticks` then per chunk, as `Schedule.tick_table` is).
    """
    if num_stages < 2:
        raise PlanError("auto_parallel needs num_task_graph >= 2 stages; set Config(num_task_graph=k).")
    S = num_stages // virtual_stages
    placement = stage_devices(cluster, S, hardware_aware)
    speeds = [min(cluster.speeds[i] for i in devs) for devs in placement] if hardware_aware else [1.0] * S
    caps = [float(min(cluster.specs[i].memory_bytes for i in devs)) / virtual_stages for devs in placement]
    speeds, caps = [speeds[c % S] for c in range(num_stages)], [caps[c % S] for c in range(num_stages)]
    cache, factor = FlopsCache(), _optimizer_factor(optimizer, cap)
    tried, error = [], None
    for gran in granularities(cap):
        layers = profile_layers(cap, units=gran.units, cache=cache, opt_factor=factor)
        flops = [l.flops for l in layers]
        try:
            starts = partition(flops, [l.state_bytes for l in layers], [l.input_bytes * micro_fraction for l in layers],
                               speeds, caps, in_flight, cut_penalties(cap, gran.units) if gran.fine else None,
                               ticks)
        except PlanError as e:
            error = e                       # the finest granularity's reason, if none fits
            continue
        stage_flops = np.add.reduceat(np.asarray(flops, dtype=float), starts)
        slowest = float(np.max(stage_flops / np.asarray(speeds)))
        tried.append((slowest, gran, starts, tuple(float(f) for f in stage_flops)))
        if slowest <= (1 + TOLERANCE) * sum(flops) / sum(speeds):
            break
    if not tried:
        raise error
    best = min(t[0] for t in tried)
    _, gran, starts, stage_flops = next(t for t in tried if t[0] <= (1 + SLACK) * best)
    stage_of_unit = np.searchsorted(np.asarray(starts), np.arange(len(gran.units)), side="right") - 1
    out = [0] * len(cap.jaxpr.jaxpr.eqns)
    for unit, s in zip(gran.units, stage_of_unit):
        for i in unit.eqns:
            out[i] = int(s)
    return AutoStages(tuple(out), stage_names(gran.units, [int(s) for s in stage_of_unit]), gran.name, stage_flops)
