"""Per-device sizes outside `shard_map`: a value's sharding as GSPMD propagates it, from the step's
input shardings, sharding constraints and shard_map out_specs, through each equation (forward from
operands to results, and back from users to operands).

A sharding is a `Spec`: per dimension, the tuple of mesh axes it is split over. `propagate` gives
each result's Spec and whether it is all-reduced (a contraction or reduction over a sharded
dimension: partial sums first); `wanted` what an operand takes from its result.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from jax.sharding import PartitionSpec as P

from whalex.memory.op_kinds import CHEAP, EXPENSIVE, HOST_KINDS, OPAQUE_DIMS, REDUCE, VIEW

Spec = tuple            # per dimension: a tuple of mesh axis names (empty: not sharded)


def shards(spec: Spec | None, axis_sizes: dict) -> int:
    """How many pieces `spec` cuts a value into."""
    return math.prod(axis_sizes.get(a, 1) for entry in (spec or ()) for a in entry)


def spec_of(pspec, ndim: int) -> Spec:
    """A PartitionSpec as a per-dimension tuple of axis-name tuples of length `ndim` (an UNCONSTRAINED
    dimension as an unsharded one: GSPMD picks its sharding, and none is the bound)."""
    out = []
    for k in range(ndim):
        e = pspec[k] if pspec is not None and k < len(pspec) else None
        out.append(() if e is None or e is P.UNCONSTRAINED else tuple(e) if isinstance(e, (tuple, list)) else (e,))
    return tuple(out)


def sharding_spec(sharding, ndim: int) -> Spec:
    return spec_of(getattr(sharding, "spec", None), ndim)


def on_host(sharding) -> bool:
    return getattr(sharding, "memory_kind", None) in HOST_KINDS


def valid(spec: Spec, shape, axis_sizes: dict) -> Spec:
    """`spec` without axes used twice or on a dimension they do not divide."""
    seen, out = set(), []
    for entry, n in zip(spec, shape):
        k = math.prod(axis_sizes.get(a, 1) for a in entry)
        ok = entry and not (set(entry) & seen) and n % k == 0
        out.append(tuple(entry) if ok else ())
        seen |= set(entry) if ok else set()
    return tuple(out)


def _merge(specs: Sequence[Spec], ndim: int) -> Spec:
    """Per dimension, the first sharded entry among operands of the same rank."""
    out = [()] * ndim
    for s in specs:
        if s is not None and len(s) == ndim:
            out = [o or e for o, e in zip(out, s)]
    return tuple(out)


def reshape_spec(spec: Spec, old, new) -> Spec:
    """Sharding of a reshape: a group of input dims that maps onto a group of output dims passes the
    major input dim's axes to the major output dim (with those of size-1 dims merged in front of it)."""
    out: list = [()] * len(new)
    i = j = 0
    while i < len(old) and j < len(new):
        i0, j0, a, b = i, j, old[i], new[j]
        while a != b:
            if a < b:
                i += 1
                a *= old[i] if i < len(old) else 1
            else:
                j += 1
                b *= new[j] if j < len(new) else 1
            if i >= len(old) or j >= len(new):
                break
        if j0 < len(new):
            k, axes = i0, ()
            while k < min(i, len(old) - 1, len(spec) - 1) and old[k] == 1:   # size-1 dims merged in front
                axes, k = axes + tuple(spec[k]), k + 1
            out[j0] = axes + tuple(spec[k]) if k < len(spec) else axes
        i, j = i + 1, j + 1
    return tuple(out)


def _dims(params, key):
    v = params.get(key)
    return tuple(v) if v is not None else ()


def propagate(eqn, specs: Sequence[Spec]) -> list[tuple[Spec, bool]]:
    """(sharding, all-reduced) of each result of `eqn` outside shard_map, from its operands' shardings."""
    name, p = eqn.primitive.name, eqn.params
    outs = [v.aval for v in eqn.outvars]
    nd = [len(getattr(a, "shape", ())) for a in outs]
    if name in ("sharding_constraint", "reshard"):
        return [(sharding_spec(p.get("sharding"), nd[0]), False)]
    if name == "device_put":
        dsts = p.get("devices") or [None] * len(outs)
        return [(sharding_spec(d, n) if hasattr(d, "spec") else (s if s is not None else ((),) * n), False)
                for d, s, n in zip(dsts, specs, nd)]
    if name == "broadcast_in_dim":
        src, shape = specs[0], outs[0].shape
        out = [()] * nd[0]
        for i, d in enumerate(p["broadcast_dimensions"]):
            if eqn.invars[0].aval.shape[i] == shape[d]:
                out[d] = src[i]
        return [(tuple(out), False)]
    if name in ("reshape", "squeeze", "expand_dims"):
        return [(reshape_spec(specs[0], eqn.invars[0].aval.shape, outs[0].shape), False)]
    if name == "transpose":
        return [(tuple(specs[0][k] for k in p["permutation"]), False)]
    if name == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        ls, rs = specs
        lfree = [k for k in range(len(ls)) if k not in lc and k not in lb]
        rfree = [k for k in range(len(rs)) if k not in rc and k not in rb]
        out = [ls[a] or rs[b] for a, b in zip(lb, rb)] + [ls[k] for k in lfree] + [rs[k] for k in rfree]
        reduced = any(ls[k] for k in lc) or any(rs[k] for k in rc)
        return [(tuple(out), reduced)]
    if name in REDUCE or name in ("argmax", "argmin"):
        axes = set(_dims(p, "axes"))
        src = specs[0]
        return [(tuple(e for k, e in enumerate(src) if k not in axes), any(src[k] for k in axes))] * len(outs)
    if name == "concatenate":
        d = p["dimension"]
        m = _merge(specs, nd[0])
        return [(tuple(() if k == d else e for k, e in enumerate(m)), False)]
    if name in CHEAP or name in EXPENSIVE:
        return [(_merge(specs, n), False) for n in nd]
    if name == "gather":
        return [(_gather_spec(p["dimension_numbers"], specs[0], specs[1], nd[0]), False)]
    return [(_same_size_spec(eqn, specs, a), False) for a in outs]


def _gather_spec(dn, operand: Spec, indices: Spec, ndim: int) -> Spec:
    """A gather's output: batch dimensions follow the indices (less their last, the index vector),
    offset dimensions the operand's dimensions that are not collapsed."""
    skip = set(dn.collapsed_slice_dims) | set(getattr(dn, "operand_batching_dims", ()) or ())
    kept = [operand[k] for k in range(len(operand)) if k not in skip]
    batch = list(indices[:-1])
    out = []
    for k in range(ndim):
        if k in dn.offset_dims:
            out.append(kept.pop(0) if kept else ())
        else:
            out.append(batch.pop(0) if batch else ())
    return tuple(out)


def _same_size_spec(eqn, specs, aval) -> Spec:
    """Any other op: per dimension, the sharding of an operand dimension of the same size at the same
    position (operands of the same rank first); else not sharded."""
    shape = getattr(aval, "shape", ())
    ranked = sorted(zip(specs, eqn.invars), key=lambda sv: len(getattr(sv[1].aval, "shape", ())) != len(shape))
    out = []
    for k, n in enumerate(shape):
        out.append(next((sp[k] for sp, v in ranked if sp is not None and k < len(sp)
                         and getattr(v.aval, "shape", ())[k] == n and sp[k]), ()))
    return tuple(out)


def adopt(spec: Spec, want: Spec, shape, axis_sizes: dict) -> Spec:
    """`spec` with its unsharded dimensions sharded as in `want`, where that stays valid."""
    merged = tuple(s or w for s, w in zip(spec, want))
    ok = valid(merged, shape, axis_sizes)
    return ok if ok != spec and all(v == m for v, m in zip(ok, merged)) else spec


def wanted(eqn, k: int, out: Spec) -> Spec | None:
    """The sharding operand `k` of `eqn` takes from its result's sharding `out` (GSPMD propagates
    from users to operands too), or None."""
    name, p = eqn.primitive.name, eqn.params
    shape = getattr(eqn.invars[k].aval, "shape", ())
    oshape = getattr(eqn.outvars[0].aval, "shape", ())
    if name in CHEAP or name in EXPENSIVE:
        return out if shape == oshape else None
    if name == "broadcast_in_dim":
        return tuple(out[d] if shape[i] == oshape[d] else () for i, d in enumerate(p["broadcast_dimensions"]))
    if name == "transpose":
        inv = {d: j for j, d in enumerate(p["permutation"])}
        return tuple(out[inv[d]] for d in range(len(shape)))
    if name in VIEW:
        return reshape_spec(out, oshape, shape)
    if name in OPAQUE_DIMS or len(shape) != len(oshape):
        return None
    return tuple(o if a == b else () for o, a, b in zip(out, shape, oshape))   # scatter, pad, slice...
