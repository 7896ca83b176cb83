"""A chunk's backward split in two (zero-bubble schedules): B, the input gradient the previous stage
waits for, and W, the weight gradient nothing waits for, run at a later tick.

The chunk's values fall in three classes: constant (literals, constants and what only they make),
parameter (made from parameters and constants) and activation (anything that reads the stage's
input, batch or extra leaves). A weight equation reads an activation and a floating parameter value
(a Dense layer's matmul, its bias add, a LayerNorm's scale). W needs, for each, the cotangent of its
floating outputs and the activations it reads; B taps the cotangents (a zero added to each output and
differentiated) and saves both in a row of the W stash. W recomputes the parameter values from the
parameters, evaluates each weight equation on its saved activations, and pulls the cotangents back to
the parameters: the weight gradient, without the chain of input gradients B already ran.

Three facts keep the row small. An add, subtract or concatenate is linear in its parameter operand,
so its activation operand is not saved (W evaluates it on zeros). A weight equation whose output is
read only by a same-shape add (a matmul before its bias) takes the add's cotangent, which equals its
own, so one tap serves both. A batch or extra leaf the step holds anyway (the first layer's input) is
read again by W, not saved.

And an elementwise weight equation on a parameter smaller than its cotangent (a LayerNorm's scale and
bias, a position table added to the activations) runs in B itself: B keeps its gradient, parameter
sized, in the row instead of the cotangent, which is as large as the activations (its work is
elementwise, so B barely grows). It runs there only where no deferred equation shares its tap.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from whalex import _compat as C

LINEAR_IN_EACH = frozenset({"add", "add_any", "sub", "concatenate"})   # a parameter operand's vjp reads no activation
SAME_COTANGENT = frozenset({"add", "add_any"})                     # a same-shape operand's cotangent is the output's
ELEMENTWISE = frozenset({"add", "add_any", "sub", "mul", "div"})   # a weight equation B may differentiate at once


def _floating(v) -> bool:
    return jnp.issubdtype(v.aval.dtype, jnp.floating)


@dataclasses.dataclass(frozen=True)
class WeightSplit:
    """What W needs of one chunk: its weight equations, the parameter and constant equations they read,
    the values whose cotangent B taps, each weight output's tap, and the activations B saves."""

    weight_eqns: tuple[int, ...]         # positions in the chunk's equation list
    param_eqns: tuple[int, ...]          # parameter and constant equations W recomputes, in order
    taps: tuple[Any, ...]                # vars whose cotangent B saves
    tap_of: dict                         # floating output of a weight equation -> its tap
    saved: tuple[Any, ...]               # activations B saves
    reread: tuple[Any, ...] = ()         # the step's inputs (batch, extra leaves) W reads again
    eager: WeightSplit | None = None     # the weight equations B differentiates itself, as a split of their own
    eager_params: tuple[int, ...] = ()   # the parameters (positions in the chunk's) they reach, whose gradient B keeps
    eager_grads: tuple[Any, ...] = ()    # those parameters' Vars (the row holds their gradients)

    @property
    def row_vars(self) -> tuple:
        """The W stash row's values: the saved activations, the tapped cotangents, then the gradients B
        computed of the eager equations' parameters."""
        return self.saved + self.taps + self.eager_grads

    @property
    def keep(self) -> tuple:
        """The activations B's forward hands back: W's, then the eager equations'."""
        return self.saved + (self.eager.saved if self.eager else ())

    @property
    def all_taps(self) -> tuple:
        """The values whose cotangent B taps: W's, then the eager equations' (never shared with W's)."""
        return self.taps + (self.eager.taps if self.eager else ())

    def sort_b(self, kept: Sequence, tapped: Sequence) -> tuple[list, list]:
        """B's values of `keep` and `all_taps` as (W's part of the row, the eager split's row)."""
        ns, nt = len(self.saved), len(self.taps)
        return list(kept[:ns]) + list(tapped[:nt]), list(kept[ns:]) + list(tapped[nt:])

    def row_parts(self, row: Sequence) -> tuple[Sequence, Sequence, Sequence]:
        """A row's values (in `row_vars` order) as (saved activations, tapped cotangents, eager gradients)."""
        ns, nt = len(self.saved), len(self.taps)
        return row[:ns], row[ns:ns + nt], row[ns + nt:]


def weight_split(eqns: Sequence, param_vars: Sequence, const_vars: Sequence, live_out: Sequence,
                 input_vars: Sequence = ()) -> WeightSplit:
    """The split of a chunk whose equations are `eqns` (in order), reading `param_vars`; `live_out`: the
    values the chunk hands on (their cotangents arrive from outside, so they are never aliased);
    `input_vars`: the step's inputs after the parameters (batch and extra leaves), which W reads again."""
    params, consts = set(param_vars), set(const_vars)
    kind: dict = {}                      # var -> "const" | "param"; absent: an activation

    def of(v):
        if isinstance(v, C.Literal) or v in consts:
            return "const"
        return "param" if v in params else kind.get(v)

    weight, fixed = [], []
    for k, e in enumerate(eqns):
        kinds = [of(v) for v in e.invars]
        if all(x is not None for x in kinds):
            kind.update((v, "param" if "param" in kinds else "const") for v in e.outvars)
            fixed.append(k)
        elif any(x == "param" and _floating(v) for x, v in zip(kinds, e.invars)):
            weight.append(k)
    tap_of = _tap_of(eqns, weight, live_out)
    reach = _reach(eqns, fixed, param_vars)
    eager = _eager(eqns, weight, tap_of, reach, param_vars)
    deferred = [k for k in weight if k not in eager]

    def part(ks):
        return _taps_and_saved(eqns, ks, _needed(eqns, ks, fixed, of), of, tap_of, set(input_vars))

    split = part(deferred)
    if not eager:
        return split
    grads = sorted(set().union(*(_params_of(eqns[k], reach) for k in eager)))
    return dataclasses.replace(split, eager=part(eager), eager_params=tuple(grads),
                               eager_grads=tuple(param_vars[i] for i in grads))


def _reach(eqns, fixed, param_vars) -> dict:
    """{parameter-derived var: the positions of the floating parameters it is made from}."""
    reach = {v: frozenset({i}) for i, v in enumerate(param_vars) if _floating(v)}
    for k in fixed:
        got = frozenset().union(*(reach[v] for v in eqns[k].invars if not isinstance(v, C.Literal) and v in reach))
        if got:
            reach.update((v, got) for v in eqns[k].outvars)
    return reach


def _params_of(eqn, reach) -> set:
    """The positions of the floating parameters an equation's operands are made from."""
    return {i for v in eqn.invars if not isinstance(v, C.Literal) and v in reach for i in reach[v]}


def _size(v) -> int:
    return int(np.prod(v.aval.shape, dtype=np.int64))


def _eager(eqns, weight, tap_of, reach, param_vars) -> list[int]:
    """The weight equations B differentiates at once: elementwise, reaching parameters smaller than their
    tapped cotangents, and tapping nothing a deferred equation taps."""
    taps = {k: {tap_of[v] for v in eqns[k].outvars if v in tap_of} for k in weight}

    def small(k):
        return (eqns[k].primitive.name in ELEMENTWISE and bool(taps[k])
                and sum(_size(param_vars[i]) for i in _params_of(eqns[k], reach)) < sum(_size(t) for t in taps[k]))

    candidates = [k for k in weight if small(k)]
    shared = set().union(*(taps[k] for k in weight if k not in candidates))
    return [k for k in candidates if not taps[k] & shared]


def _needed(eqns, weight, fixed, of) -> list[int]:
    """The parameter and constant equations the weight equations read, directly or through others."""
    want = {v for k in weight for v in eqns[k].invars if not isinstance(v, C.Literal) and of(v) is not None}
    keep = []
    for k in reversed(fixed):
        if any(v in want for v in eqns[k].outvars):
            keep.append(k)
            want |= {v for v in eqns[k].invars if not isinstance(v, C.Literal)}
    return sorted(keep)


def _tap_of(eqns, weight, live_out) -> dict:
    """{floating output of a weight equation: the value whose cotangent B taps for it}."""
    readers: dict = {}
    for e in eqns:
        for v in e.invars:
            if not isinstance(v, C.Literal):
                readers.setdefault(v, []).append(e)
    outs = set(live_out)

    def tap(v):                          # follow single same-shape adds: their cotangent is v's
        while v not in outs and len(readers.get(v, ())) == 1:
            e = readers[v][0]
            if e.primitive.name not in SAME_COTANGENT or e.outvars[0].aval != v.aval:
                break
            v = e.outvars[0]
        return v

    return {v: tap(v) for k in weight for v in eqns[k].outvars if _floating(v) and not isinstance(v, C.DropVar)}


def _taps_and_saved(eqns, weight, param_eqns, of, taps_of: dict, inputs: set) -> WeightSplit:
    tap_of = {v: taps_of[v] for k in weight for v in eqns[k].outvars if v in taps_of}
    read = dict.fromkeys(v for k in weight if eqns[k].primitive.name not in LINEAR_IN_EACH
                         for v in eqns[k].invars if not isinstance(v, C.Literal) and of(v) is None)
    return WeightSplit(tuple(weight), tuple(param_eqns), tuple(dict.fromkeys(tap_of.values())), tap_of,
                       tuple(v for v in read if v not in inputs), tuple(v for v in read if v in inputs))


def weight_grads(split: WeightSplit, eqns: Sequence, indices: Sequence[int], apply, param_vars: Sequence,
                 consts: dict, params: Sequence, row: Sequence, reread: Sequence = ()) -> list:
    """W: the gradient of the chunk's parameters from a W stash row (`row`: the values of
    `split.row_vars`) and the values of `split.reread`. `apply(eqn, index, invals)` evaluates one
    equation of the chunk (with the plan's overrides and constraints); `indices[k]`: the jaxpr index of
    `eqns[k]`."""
    kept, tapped, _ = split.row_parts(row)
    saved = dict(zip(split.saved, kept))
    saved.update(zip(split.reread, reread))
    ct_of_tap = dict(zip(split.taps, tapped))
    outs = list(split.tap_of)

    def weight_outputs(p):
        env = dict(consts)
        env.update(zip(param_vars, p))
        for k in split.param_eqns:
            e = eqns[k]
            env.update(zip(e.outvars, apply(e, indices[k], [C.read(env, v) for v in e.invars])))
        values: dict = {}
        for k in split.weight_eqns:
            e = eqns[k]
            ins = [C.read(env, v) if isinstance(v, C.Literal) or v in env
                   else saved[v] if v in saved else jnp.zeros(v.aval.shape, v.aval.dtype) for v in e.invars]
            values.update(zip(e.outvars, apply(e, indices[k], ins)))
        return [values[v] for v in outs]

    _, pullback = jax.vjp(weight_outputs, list(params))
    cts = [ct_of_tap[split.tap_of[v]].astype(v.aval.dtype) for v in outs]
    return pullback(cts)[0]
