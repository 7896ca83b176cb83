"""remat="auto" decided from XLA's own figure where the plan compiles without running (a
`Cluster.gpu_topology`). The replay's choice is compiled; while XLA's per-device bytes exceed the
budget, the choice is made again for a replay budget lowered by the overshoot; when they fit with room
to spare, for one raised by the slack (less recomputation), kept only if it compiles within the budget.
Each try is a compile, so the search is a few steps of that secant on the budget, no more."""
from __future__ import annotations

import dataclasses

from whalex.errors import PlanError
from whalex.jaxpr.compiled import compile_step
from whalex.memory.peak import compiled_peak
from whalex.memory.remat import configure

MAX_COMPILES = 4


def compiled_bytes(program, devices=None) -> float:
    """XLA's per-device bytes of the donated step (arguments + outputs + temp - aliased); `devices`: the
    topology devices a step over an abstract mesh compiles for."""
    return compiled_peak(compile_step(program, program.platform, devices)[0]).total


def fit_compiled(program, config, cluster, batch_axes=(), recapture=None):
    """`program` (remat="auto" already chosen by the replay) with the least remat tried whose compiled
    step fits the budget; its record says what XLA compiled and after how many compiles."""
    devices = program.mesh.size
    budget = float(config.memory_budget if config.memory_budget is not None
                   else min(float(s.memory_bytes) for s in cluster.specs[:devices]))
    target, tried, best, seen = budget, [], None, set()
    while len(tried) < MAX_COMPILES:
        seen.add(_levels(program.remat))
        got = compiled_bytes(program, cluster.compile_devices)
        tried.append(got)
        if got <= budget:
            best = (program, got)
        if (best is not None and best[0] is not program) or not _recomputes(program.remat) and got <= budget:
            break                    # less remat did not fit, or nothing is recomputed: done
        target += budget - got       # over: lower the replay's budget by the overshoot; under: raise it
        try:
            prec, remat = configure(program.captured, dict(program.mesh.shape), program.state_layout(),
                                    config.replace(memory_budget=target), cluster, batch_axes, recapture)
        except PlanError:
            break
        if _levels(remat) in seen:
            break
        program = dataclasses.replace(program, precision=prec, remat=remat)
    if best is not None:
        program, got = best
        return dataclasses.replace(program, remat=dataclasses.replace(program.remat, budget=budget, compiled=got,
                                                                      compiles=len(tried)))
    raise PlanError(
        f"remat='auto' cannot fit the step in memory_budget={budget / 2**20:,.0f} MiB per device as XLA compiles it "
        f"for {cluster.target}: {', '.join(f'{b / 2**20:,.0f}' for b in tried)} MiB after {len(tried)} "
        "compile(s), the last with the most remat the budget's replay allows. Raise memory_budget, use more "
        "devices, zero_level or offload, or a smaller batch.")


def _recomputes(remat) -> bool:
    return remat is not None and remat.active


def _levels(remat) -> tuple:
    return tuple(remat.segment_levels or ()) + tuple(remat.levels) if remat is not None else ()
