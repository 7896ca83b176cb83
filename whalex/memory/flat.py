"""A jaxpr level flattened as the memory replay reads it: calls inlined (XLA inlines them too), every
value named by a key unique on the level, and the bytes of an abstract value."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from whalex import _compat as C
from whalex.memory.op_kinds import BODIES, CALLS


def itemsize(aval) -> int:
    try:
        return np.dtype(aval.dtype).itemsize
    except TypeError:         # PRNG keys and other extended dtypes
        return 8


def aval_bytes(aval) -> float:
    shape = getattr(aval, "shape", None)
    if shape is None or not hasattr(aval, "dtype"):
        return 0.0
    return float(math.prod(shape)) * itemsize(aval)


@dataclasses.dataclass(frozen=True)
class Op:
    """One equation of a jaxpr level with its calls inlined (XLA inlines them too): its operands and
    results as keys unique on the level (a call's body may be shared by several call sites)."""

    eqn: Any
    ins: tuple               # per operand: a key, or a Literal
    outs: tuple              # per result: a key


def flatten(jaxpr, ins: Sequence, path: tuple = ()) -> tuple[list[Op], list]:
    """The equations of `jaxpr` with calls (jit, checkpoint, custom derivatives) replaced by their
    bodies, and the keys (or Literals) of its outputs; `ins` are its invars' keys."""
    env: dict = dict(zip(jaxpr.invars, ins))
    for v in jaxpr.constvars:
        env[v] = (path, "const", v)
    ops: list = []

    def key(v):
        return v if isinstance(v, C.Literal) else env[v]

    for k, e in enumerate(jaxpr.eqns):
        operands = [key(v) for v in e.invars]
        if e.primitive.name in CALLS and bodies(e):
            body, _ = C.open_jaxpr(bodies(e)[0])
            inner, outs = flatten(body, operands[len(operands) - len(body.invars):], path + (k,))
            ops += inner
            env.update(zip(e.outvars, outs))
            continue
        outs = tuple((path, v) for v in e.outvars)
        env.update(zip(e.outvars, outs))
        ops.append(Op(e, tuple(operands), outs))
    return ops, [key(v) for v in jaxpr.outvars]


def bodies(eqn) -> list:
    """The bodies of a call, loop or conditional (others, e.g. a scatter's update function, are opaque)."""
    name = eqn.primitive.name
    if name == "while":
        return [eqn.params["body_jaxpr"]]
    return C.sub_jaxprs(eqn) if name in BODIES else []
