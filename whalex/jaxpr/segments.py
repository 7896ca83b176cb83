"""The captured loss as segments: maximal runs of consecutive top-level equations of one
TaskGraph, each evaluated as a function of the values crossing its edges (through
`make_evaluator`, so the plan's constraints apply unchanged). Remat wraps segments in
`jax.checkpoint`; comm_dtype runs data-parallel ones in a shard_map (whalex.precision.comm)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from whalex import _compat as C
from whalex.jaxpr.interpret import make_evaluator


@dataclasses.dataclass(frozen=True)
class Segment:
    """Top-level equations [start, stop) of one TaskGraph, with the values crossing its edges."""

    taskgraph: int
    start: int
    stop: int
    inputs: tuple          # Vars read here and defined before (invars, constvars, earlier outputs)
    outputs: tuple         # Vars defined here and read later (or returned)


def segments(cap, cuts: Sequence[int] = ()) -> tuple[Segment, ...]:
    """Maximal runs of consecutive top-level equations that belong to one TaskGraph, also cut before
    each equation index in `cuts` (the model's layers, for remat per layer)."""
    jaxpr = cap.jaxpr.jaxpr
    eqns = jaxpr.eqns
    cut = set(cuts)
    runs: list[list[int]] = []
    for i in range(len(eqns)):
        tg = cap.assign[(i,)]
        if runs and cap.assign[(runs[-1][0],)] == tg and i not in cut:
            runs[-1].append(i)
        else:
            runs.append([i])
    edges = run_edges([[eqns[i] for i in run] for run in runs], jaxpr.outvars)
    out = [Segment(cap.assign[(run[0],)], run[0], run[-1] + 1, tuple(reads), tuple(writes))
           for run, (reads, writes) in zip(runs, edges)]
    return tuple(out)


def run_edges(groups: Sequence[Sequence], live_out: Sequence) -> list[tuple[list, list]]:
    """Each of consecutive runs of equations `groups`, evaluated as one function: (the Vars it reads and
    does not define, in the order first read; the Vars it defines that a later run reads or `live_out`
    holds, in the order defined)."""
    needed = {v for v in live_out if isinstance(v, C.Var)}
    later: list[set] = []
    for group in reversed(groups):           # what each run's successors (and the outputs) read
        later.append(set(needed))
        needed |= {v for e in group for v in e.invars if isinstance(v, C.Var)}
    later.reverse()
    edges = []
    for group, after in zip(groups, later):
        defined = {v for e in group for v in e.outvars}
        reads = list(dict.fromkeys(v for e in group for v in e.invars if isinstance(v, C.Var) and v not in defined))
        writes = [v for e in group for v in e.outvars if v in after and not isinstance(v, C.DropVar)]
        edges.append((reads, writes))
    return edges


def _debug_info(jaxpr, seg: Segment):
    """The parent's DebugInfo resized to the segment's inputs and outputs."""
    info = jaxpr.debug_info
    if info is None:
        return None
    return info._replace(arg_names=tuple(str(v) for v in seg.inputs),
                         result_paths=tuple(f"[{i}]" for i in range(len(seg.outputs))))


def segment_function(cap, seg: Segment, constraints: dict, mesh, overrides: dict | None) -> Callable[..., list]:
    """fn(*seg.inputs) -> seg.outputs: the segment's equations through `make_evaluator`, with the
    constraints and overrides whose (absolute) paths fall inside it."""
    jaxpr = cap.jaxpr.jaxpr
    sub = jaxpr.replace(constvars=[], invars=list(seg.inputs), outvars=list(seg.outputs),
                        eqns=jaxpr.eqns[seg.start:seg.stop], debug_info=_debug_info(jaxpr, seg))
    return make_evaluator(C.ClosedJaxpr(sub, []), local_constraints(seg, constraints), mesh,
                          local_overrides(seg, overrides))


def local_constraints(seg: Segment, constraints: dict) -> dict:
    """The constraints whose (absolute) paths fall inside `seg`, keyed by paths relative to it."""
    return {((k[0][0] - seg.start,) + tuple(k[0][1:]),) + tuple(k[1:]): s
            for k, s in constraints.items() if seg.start <= k[0][0] < seg.stop}


def local_overrides(seg: Segment, overrides: dict | None) -> dict:
    """The overrides whose (absolute) paths fall inside `seg`, keyed by paths relative to it."""
    return {(p[0] - seg.start,) + tuple(p[1:]): f for p, f in (overrides or {}).items() if seg.start <= p[0] < seg.stop}


def run_segments(cap, parts: Sequence[tuple[Segment, Callable]]) -> Callable[..., list]:
    """Evaluate the captured loss segment by segment: parts = [(segment, fn(*inputs) -> outputs)]."""
    closed = cap.jaxpr
    jaxpr = closed.jaxpr

    def evaluate(*args):
        env = dict(zip(jaxpr.constvars, closed.consts))
        env.update(zip(jaxpr.invars, args))
        for seg, fn in parts:
            env.update(zip(seg.outputs, fn(*[env[v] for v in seg.inputs])))
        return [C.read(env, v) for v in jaxpr.outvars]

    return evaluate
