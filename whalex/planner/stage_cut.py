"""Stage cutting: which equations, parameters and boundary values make each pipeline stage. Where the
stages fall is the planner's decision (`balance` sizes them); the pipeline lowering carries out the
`StageCut` it is given."""
from __future__ import annotations

from collections.abc import Sequence

from whalex import _compat as C
from whalex.jaxpr.capture import Captured
from whalex.lowering.pipeline import StageCut


def cut_stages(cap: Captured, stage_of_eqn: Sequence[int], num_stages: int) -> StageCut:
    """Group top-level equations into stages and find the values each boundary must carry. A
    parameter read by several stages (tied weights) is listed in each of them; a parameter no stage
    reads lives on stage 0 (its gradient is zero)."""
    jaxpr = cap.jaxpr.jaxpr
    n = cap.num_params
    eqns = [[] for _ in range(num_stages)]
    for i, s in enumerate(stage_of_eqn):
        eqns[s].append(i)
    produced_at: dict = {}
    for s in range(num_stages):
        for i in eqns[s]:
            for v in jaxpr.eqns[i].outvars:
                produced_at[v] = s
    last_use: dict = {}
    params: list[set] = [set() for _ in range(num_stages)]
    param_vars = {v: k for k, v in enumerate(jaxpr.invars[:n])}
    for s in range(num_stages):
        for i in eqns[s]:
            for v in jaxpr.eqns[i].invars:
                if isinstance(v, C.Literal):
                    continue
                if v in param_vars:
                    params[s].add(param_vars[v])
                if v in produced_at:
                    last_use[v] = max(last_use.get(v, -1), s)
    for v in jaxpr.outvars:
        if not isinstance(v, C.Literal) and v in produced_at:
            last_use[v] = num_stages
    params[0] |= set(range(n)) - {p for ps in params for p in ps}
    boundaries = []
    for k in range(num_stages - 1):
        live = [v for v, s in produced_at.items() if s <= k and last_use.get(v, -1) > k]
        boundaries.append(tuple(sorted(live, key=lambda v: (produced_at[v], str(v)))))
    return StageCut(tuple(tuple(e) for e in eqns), tuple(tuple(sorted(p)) for p in params), tuple(boundaries))
