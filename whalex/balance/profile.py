"""Profiling: FLOPs per TaskGraph counted from the jaxpr.

FLOPs are counted, not measured (`whalex.jaxpr.flops`): XLA's cost analysis has no FLOPs on a GPU,
and lowering each TaskGraph only to ask is slow. The trained parameters are differentiated, the
loss (a captured jaxpr's first output) is seeded.
"""
from __future__ import annotations

import dataclasses

from whalex import _compat as C
from whalex.jaxpr.capture import taskgraph_eqns
from whalex.jaxpr.flops import equation_flops


@dataclasses.dataclass(eq=False)
class FlopsCache:
    """Counts shared between calls of `group_flops` on one jaxpr: `measured` holds each jaxpr's
    per-equation FLOPs, `memo` the counts of the jaxprs it calls. Mutable: calls fill it."""

    measured: dict = dataclasses.field(default_factory=dict)
    memo: dict = dataclasses.field(default_factory=dict)


def taskgraph_flops(closed: C.ClosedJaxpr, assign: dict, num_taskgraphs: int,
                    num_params: int | None = None) -> tuple[float, ...]:
    """Forward + backward FLOPs of each TaskGraph on the global batch (`group_flops`)."""
    return group_flops(closed, taskgraph_eqns(C.open_jaxpr(closed)[0], assign, num_taskgraphs), num_params=num_params)


def group_flops(closed: C.ClosedJaxpr, groups, cache: FlopsCache | None = None,
                num_params: int | None = None) -> tuple[float, ...]:
    """Forward + backward FLOPs of each group of top-level equations of a captured loss, when the
    first `num_params` inputs (default: all) are trained: the floating ones among them are
    differentiated and the first output, the loss, is seeded."""
    cache = FlopsCache() if cache is None else cache
    per_eqn = _eqn_flops(closed, num_params, cache)
    return tuple(float(sum(per_eqn[i] for i in indices)) for indices in groups)


def _eqn_flops(closed, num_params: int | None, cache: FlopsCache) -> list[float]:
    """Forward + backward FLOPs of each top-level equation (cached per jaxpr and `num_params`)."""
    key = (id(closed), num_params)
    if key not in cache.measured:
        jaxpr, _ = C.open_jaxpr(closed)
        n = len(jaxpr.invars) if num_params is None else num_params
        trained = [k < n for k in range(len(jaxpr.invars))]
        seeds = [k == 0 for k in range(len(jaxpr.outvars))]
        counts = equation_flops(jaxpr, trained, seeds, cache.memo)
        cache.measured[key] = (closed, [f + b for f, b in counts.per_eqn])   # closed kept: its id stays its own
    return cache.measured[key][1]
