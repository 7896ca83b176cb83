"""Evaluate a captured jaxpr with the plan's sharding constraints inserted (the graph rewrite).

Running the original equations keeps the maths of the unannotated model exactly; the constraints
(bridges, pattern inputs and outputs) tell XLA's SPMD partitioner where each value lives, and it
emits the collectives. Calls are entered so constraints inside them apply too.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax.sharding import NamedSharding

from whalex import _compat as C


def make_evaluator(closed: C.ClosedJaxpr, constraints: dict, mesh, overrides: dict | None = None) -> Callable[..., list]:
    """A function of the jaxpr's inputs that applies `constraints[(path, "in"|"out", pos)]`.

    `overrides[path]` replaces one equation by a function of its inputs (e.g. an uneven split).
    """
    overrides = overrides or {}
    shardings = {key: NamedSharding(mesh, spec) for key, spec in constraints.items()}
    paths = {key[0] for key in shardings}
    prefixes = {p[:k] for p in paths | set(overrides) for k in range(1, len(p) + 1)}

    def evaluate(jaxpr, consts, args: Sequence[Any], frame: tuple) -> list:
        env: dict = {}
        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for i, eqn in enumerate(jaxpr.eqns):
            path = frame + (i,)
            invals = [C.read(env, v) for v in eqn.invars]
            if path in paths:
                for pos in range(len(invals)):
                    s = shardings.get((path, "in", pos))
                    if s is not None:
                        invals[pos] = jax.lax.with_sharding_constraint(invals[pos], s)
            if path in overrides:
                outs = list(overrides[path](*invals))
            elif path in prefixes and C.is_call(eqn):
                sub, sub_consts = C.call_jaxpr(eqn)
                outs = evaluate(sub, sub_consts, invals, path)
            else:
                outs = C.bind(eqn, invals)
            if path in paths:
                for pos in range(len(outs)):
                    s = shardings.get((path, "out", pos))
                    if s is not None:
                        outs[pos] = jax.lax.with_sharding_constraint(outs[pos], s)
            env.update(zip(eqn.outvars, outs))
        return [C.read(env, v) for v in jaxpr.outvars]

    def run(*args):
        return evaluate(closed.jaxpr, closed.consts, args, ())

    return run


def subgraph_function(jaxpr, indices: Sequence[int]):
    """The top-level equations `indices` as a function: (inputs, outputs, fn(*inputs) -> outputs)."""
    eqns = [jaxpr.eqns[i] for i in indices]
    defined, inputs, seen = set(), [], set()
    for eqn in eqns:
        for v in eqn.invars:
            if not isinstance(v, C.Literal) and v not in defined and v not in seen:
                seen.add(v)
                inputs.append(v)
        defined.update(eqn.outvars)
    used_outside = {v for e in jaxpr.eqns if e not in eqns for v in e.invars if not isinstance(v, C.Literal)}
    used_outside.update(v for v in jaxpr.outvars if not isinstance(v, C.Literal))
    outputs = [v for e in eqns for v in e.outvars if v in used_outside]

    def fn(*args):
        env = dict(zip(inputs, args))
        for eqn in eqns:
            env.update(zip(eqn.outvars, C.bind(eqn, [C.read(env, v) for v in eqn.invars])))
        return [env[v] for v in outputs]

    return inputs, outputs, fn


def apply_eqn(eqn, path: tuple, invals: Sequence[Any], overrides: dict, prefixes: set | None = None) -> list:
    """Evaluate one equation, replacing it (or an equation inside a call it makes) by
    `overrides[path]`; `prefixes` are the paths that lead to an override (computed when None)."""
    if prefixes is None:
        prefixes = {p[:k] for p in overrides for k in range(1, len(p) + 1)}
    if path in overrides:
        return list(overrides[path](*invals))
    if path in prefixes and C.is_call(eqn):
        sub, consts = C.call_jaxpr(eqn)
        env = dict(zip(sub.constvars, consts))
        env.update(zip(sub.invars, invals))
        for j, e in enumerate(sub.eqns):
            env.update(zip(e.outvars, apply_eqn(e, path + (j,), [C.read(env, v) for v in e.invars], overrides,
                                                prefixes)))
        return [C.read(env, v) for v in sub.outvars]
    return C.bind(eqn, invals)
