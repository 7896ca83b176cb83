"""Repeated blocks evaluated through one function: the captured loss segment by segment, where
segments that compute the same function with the same constraints and overrides (the identical
blocks of a transformer) share one `jax.jit` of their equations.

JAX traces a jitted function once per input types and caches what it derives from the traced
jaxpr (linearization, transpose, StableHLO lowering), so a model of 24 identical blocks is traced,
differentiated and lowered as one block called 24 times instead of 24 copies. The StableHLO holds
the block as a function and 24 calls; XLA inlines them, so the compiled program is the same.
Segments that occur once are evaluated inline, and a loss without repeats by `make_evaluator` itself.
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import jax

from whalex.jaxpr.interpret import make_evaluator, subgraph_key
from whalex.jaxpr.segments import Segment, local_constraints, local_overrides, run_segments, segment_function, segments


def block_key(cap, seg: Segment, constraints: dict, overrides: dict, memo: dict) -> tuple:
    """Equal keys: the segments compute the same function of the same input types with the same
    constraints (relative path, side, position, spec) and the same override objects."""
    jaxpr = cap.jaxpr.jaxpr
    consts = set(jaxpr.constvars)
    eqns = subgraph_key(jaxpr, range(seg.start, seg.stop), seg.inputs, seg.outputs, consts, memo)
    cons = tuple(sorted((k, repr(s)) for k, s in local_constraints(seg, constraints).items()))
    ovr = tuple(sorted((p, id(f)) for p, f in local_overrides(seg, overrides).items()))
    return eqns, cons, ovr


def shared_blocks(cap, segs: Sequence[Segment], constraints: dict, overrides: dict) -> list[int]:
    """For each segment, the index of the first segment with the same `block_key` (itself if none)."""
    first: dict = {}
    memo: dict = {}
    return [first.setdefault(block_key(cap, seg, constraints, overrides, memo), k) for k, seg in enumerate(segs)]


def _named(fn: Callable, name: str) -> Callable:
    def block(*args):
        return fn(*args)

    block.__name__ = block.__qualname__ = name
    return block


def block_evaluator(cap, constraints: dict, mesh, overrides: dict | None = None) -> Callable[..., list]:
    """The captured loss with the plan's constraints and overrides (as `make_evaluator`), each
    repeated segment through one jitted function shared by its copies."""
    overrides = overrides or {}
    segs = segments(cap)
    shared = shared_blocks(cap, segs, constraints, overrides)
    repeated = {k for k, n in collections.Counter(shared).items() if n > 1}
    if not repeated:
        return make_evaluator(cap.jaxpr, constraints, mesh, overrides)
    fns: dict = {}
    parts = []
    for seg, first in zip(segs, shared):
        if first not in fns:
            fn = segment_function(cap, segs[first], constraints, mesh, overrides)
            fns[first] = jax.jit(_named(fn, f"whalex_block_{first}")) if first in repeated else fn
        parts.append((seg, fns[first]))
    return run_segments(cap, parts)
