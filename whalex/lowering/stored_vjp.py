"""A part's vjp split into arrays a loop can store, and the pullback rebuilt from them.

A loop whose trip count differs between devices (the uneven chunk loop) cannot hand its residuals
to `jax.grad`, which stacks them per iteration of a `scan`. `jax.vjp` of one part returns a pytree
(the `VJP` object) whose leaves are the residuals; the forward loop writes them into preallocated
buffers and the backward loop reads them back and unflattens the pullback: no forward recompute.

Not every leaf is stored. Reading the vjp's jaxpr once (`part_vjp`) tells each leaf's source:
a parameter or a part input (forwarded as is: taken again from the parameters or the batch block),
a constant (depends on no input, e.g. the zeros of ReLU's jvp: rebuilt once from the jaxpr), or a
value computed from the inputs (stored, one slot per part).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from whalex import _compat as C

PARAM, INPUT, CONST, STORED = "param", "input", "const", "stored"


@dataclasses.dataclass(frozen=True)
class PartVjp:
    """`fn(params, part) -> outputs` linearised with its residual leaves sorted by source."""

    fn: Callable
    treedef: Any                       # of the VJP object jax.vjp returns
    sources: tuple                     # per residual leaf: (PARAM | INPUT | CONST | STORED, index)
    stored: tuple                      # ShapeDtypeStruct of each STORED leaf, in order
    closed: Any                        # the jaxpr of (params, part) -> (outputs, residual leaves)
    num_outputs: int

    def forward(self, params, part) -> tuple[list, list]:
        """(outputs, the residuals to store) of one part."""
        out, vjp = _vjp(self.fn, params, part)
        leaves = jax.tree.leaves(vjp)
        got = [(tuple(x.shape), x.dtype) for x in leaves]
        want = [(tuple(v.aval.shape), v.aval.dtype) for v in self.closed.jaxpr.outvars[self.num_outputs:]]
        if got != want:                  # the abstract trace in `part_vjp` and this one must agree
            raise AssertionError(f"the part's vjp traced residuals {got}, expected {want}")
        return out, [leaves[i] for i, (kind, _) in enumerate(self.sources) if kind == STORED]

    def constants(self) -> list:
        """The CONST residual leaves (no input reaches them): evaluated once, outside any loop."""
        jaxpr = self.closed.jaxpr
        env = dict(zip(jaxpr.constvars, self.closed.consts))
        for eqn in jaxpr.eqns:
            if all(isinstance(v, C.Literal) or v in env for v in eqn.invars):
                env.update(zip(eqn.outvars, C.bind(eqn, [C.read(env, v) for v in eqn.invars])))
        res = jaxpr.outvars[self.num_outputs:]
        return [C.read(env, res[i]) for i, (kind, _) in enumerate(self.sources) if kind == CONST]

    def backward(self, params, part, stored, constants, cts) -> list:
        """The cotangents of `params` from `cts` (of the outputs) and the part's stored residuals."""
        pools = {PARAM: list(params), INPUT: list(part), CONST: list(constants), STORED: list(stored)}
        leaves = [pools[kind][i] for kind, i in self.sources]
        return jax.tree.unflatten(self.treedef, leaves)(list(cts))[0]


def part_vjp(fn: Callable, param_shapes, part_shapes) -> PartVjp:
    """Trace `jax.vjp` of `fn(params, part)` (lists of ShapeDtypeStructs) once, abstractly, and sort
    its residual leaves: forwarded parameters and inputs, constants, and values to store."""
    closed, (out_shapes, vjp_shapes) = jax.make_jaxpr(functools.partial(_vjp, fn), return_shape=True)(
        list(param_shapes), list(part_shapes))
    jaxpr = closed.jaxpr
    n_out = len(jax.tree.leaves(out_shapes))
    params_in = {v: i for i, v in enumerate(jaxpr.invars[: len(param_shapes)])}
    part_in = {v: i for i, v in enumerate(jaxpr.invars[len(param_shapes):])}
    live = set(jaxpr.invars)                     # values some input reaches
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, C.Literal) and v in live for v in eqn.invars):
            live.update(eqn.outvars)
    sources, stored, k = [], [], 0
    for v in jaxpr.outvars[n_out:]:
        if isinstance(v, C.Literal) or v not in live:
            sources.append((CONST, sum(s == CONST for s, _ in sources)))
        elif v in params_in:
            sources.append((PARAM, params_in[v]))
        elif v in part_in:
            sources.append((INPUT, part_in[v]))
        else:
            sources.append((STORED, k))
            stored.append(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype))
            k += 1
    return PartVjp(fn, jax.tree.structure(vjp_shapes), tuple(sources), tuple(stored), closed, n_out)


def _vjp(fn, params, part):
    """(outputs, pullback) of `fn` at `params`, the part held fixed (its cotangent is never needed)."""
    return jax.vjp(lambda p: fn(p, part), params)
