"""Evaluate a captured jaxpr with the plan's sharding constraints inserted (the graph rewrite).

Running the original equations keeps the maths of the unannotated model exactly; the constraints
(bridges, pattern inputs and outputs) tell XLA's SPMD partitioner where each value lives, and it
emits the collectives. Calls are entered so constraints inside them apply too.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from whalex import _compat as C


def call_prefixes(paths) -> set:
    """Every prefix of the equation paths `paths`: the calls an evaluator enters to reach them."""
    return {p[:k] for p in paths for k in range(1, len(p) + 1)}


def make_evaluator(closed: C.ClosedJaxpr, constraints: dict, mesh,
                   overrides: dict | None = None) -> Callable[..., list]:
    """A function of the jaxpr's inputs that applies `constraints[(path, "in"|"out", pos)]`.

    `overrides[path]` replaces one equation by a function of its inputs (e.g. an uneven split).
    """
    overrides = overrides or {}
    shardings = {key: NamedSharding(mesh, spec) for key, spec in constraints.items()}
    paths = {key[0] for key in shardings}
    prefixes = call_prefixes(paths | set(overrides))

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
    return subgraph_functions(jaxpr, [indices])[0]


def subgraph_functions(jaxpr, groups: Sequence[Sequence[int]]) -> list:
    """`subgraph_function` of each group of top-level equations (the uses of every value found once)."""
    group_of = {}
    for g, indices in enumerate(groups):
        group_of.update((i, g) for i in indices)
    users: dict = {}                    # value -> the groups (-1: none) of the equations that read it
    for k, e in enumerate(jaxpr.eqns):
        for v in e.invars:
            if not isinstance(v, C.Literal):
                users.setdefault(v, set()).add(group_of.get(k, -1))
    final = {v for v in jaxpr.outvars if not isinstance(v, C.Literal)}
    out = []
    for g, indices in enumerate(groups):
        eqns = [jaxpr.eqns[i] for i in indices]
        defined, inputs, seen = set(), [], set()
        for eqn in eqns:
            for v in eqn.invars:
                if not isinstance(v, C.Literal) and v not in defined and v not in seen:
                    seen.add(v)
                    inputs.append(v)
            defined.update(eqn.outvars)
        outputs = [v for e in eqns for v in e.outvars if v in final or users.get(v, set()) - {g}]
        out.append((inputs, outputs, _run_eqns(eqns, inputs, outputs)))
    return out


def _run_eqns(eqns, inputs, outputs) -> Callable[..., list]:
    def fn(*args):
        env = dict(zip(inputs, args))
        for eqn in eqns:
            env.update(zip(eqn.outvars, C.bind(eqn, [C.read(env, v) for v in eqn.invars])))
        return [env[v] for v in outputs]

    return fn


def subgraph_key(jaxpr, indices: Sequence[int], inputs: Sequence[Any], outputs: Sequence[Any],
                 consts=(), memo: dict | None = None) -> tuple:
    """A hashable description of the equations `indices` as a function of `inputs` (from
    `subgraph_function`), variables numbered in order: equal keys compute the same function of the same input types
    (e.g. the repeated blocks of a model), so a measure of one (FLOPs, residuals) serves them all
    and one traced function evaluates them all (`whalex.jaxpr.blocks`).
    `consts` are the inputs that stand for constants; `memo` shares the keys of called jaxprs (their
    equations, keyed the same way; a closed jaxpr's constants count by identity)."""
    memo = {} if memo is None else memo
    names = {v: k for k, v in enumerate(inputs)}
    key: list = [tuple((v.aval, v in consts) for v in inputs)]
    for i in indices:
        eqn = jaxpr.eqns[i]
        ins = tuple(_literal_key(v) if isinstance(v, C.Literal) else names[v] for v in eqn.invars)
        for v in eqn.outvars:
            names[v] = len(names)
        params = tuple((k, _param_key(p, memo)) for k, p in sorted(eqn.params.items()))
        key.append((eqn.primitive.name, ins, tuple(v.aval for v in eqn.outvars), params, getattr(eqn, "ctx", None)))
    key.append(tuple(_literal_key(v) if isinstance(v, C.Literal) else names[v] for v in outputs))
    return tuple(key)


def _literal_key(v) -> tuple:
    """A literal by its bits (exact: -0.0 is not 0.0; 200x cheaper than the repr of jax's literal arrays)."""
    val = np.asarray(v.val)
    return "literal", val.dtype.str, val.shape, val.tobytes(), v.aval


def _jaxpr_key(value, memo: dict) -> tuple:
    """A called jaxpr as `subgraph_key` of all its equations (structural: cheaper than its text)."""
    jaxpr, consts = C.open_jaxpr(value)
    return subgraph_key(jaxpr, range(len(jaxpr.eqns)), [*jaxpr.constvars, *jaxpr.invars], jaxpr.outvars,
                        set(jaxpr.constvars), memo), tuple(map(id, consts))


def _param_key(value: Any, memo: dict) -> Any:
    if isinstance(value, (C.ClosedJaxpr, C.Jaxpr)):
        if id(value) not in memo:                      # the value kept alive: its id (and its consts') stay its own
            memo[id(value)] = (value, _jaxpr_key(value, memo))
        return memo[id(value)][1]
    if isinstance(value, np.ndarray):
        return ("ndarray", value.shape, str(value.dtype), value.tobytes())
    if isinstance(value, (tuple, list)):
        return tuple(_param_key(x, memo) for x in value)
    if callable(value):                                 # e.g. a custom_jvp rule: the same object, or different
        memo.setdefault(id(value), (value, None))
        return ("callable", id(value))
    return repr(value)


def apply_eqn(eqn, path: tuple, invals: Sequence[Any], overrides: dict, prefixes: set | None = None,
              constraints: dict | None = None) -> list:
    """Evaluate one equation, replacing it (or an equation inside a call it makes) by
    `overrides[path]`; `prefixes` are the paths that lead to an override or a constraint (computed
    when None). `constraints[(path, "in"|"out", pos)]`: a PartitionSpec (or sharding) for
    `with_sharding_constraint`, as `make_evaluator` applies them (a pipeline stage's split layers)."""
    constraints = constraints or {}
    if prefixes is None:
        prefixes = call_prefixes(list(overrides) + [c[0] for c in constraints])
    if constraints:
        invals = [_constrain(x, constraints.get((path, "in", pos))) for pos, x in enumerate(invals)]
    if path in overrides:
        outs = list(overrides[path](*invals))
    elif path in prefixes and C.is_call(eqn):
        sub, consts = C.call_jaxpr(eqn)
        env = dict(zip(sub.constvars, consts))
        env.update(zip(sub.invars, invals))
        for j, e in enumerate(sub.eqns):
            env.update(zip(e.outvars, apply_eqn(e, path + (j,), [C.read(env, v) for v in e.invars], overrides,
                                                prefixes, constraints)))
        outs = [C.read(env, v) for v in sub.outvars]
    else:
        outs = C.bind(eqn, invals)
    if constraints:
        outs = [_constrain(x, constraints.get((path, "out", pos))) for pos, x in enumerate(outs)]
    return outs


def _constrain(x, spec):
    return x if spec is None else jax.lax.with_sharding_constraint(x, spec)
