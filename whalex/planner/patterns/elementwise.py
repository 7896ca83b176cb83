"""Rules for the operations that keep or drop dimensions without a pattern of their own:
elementwise ops, broadcasts, transposes, squeezes, reductions (softmax cross-entropy and argmax
over a split class dimension: a local reduction, then an all-reduce of the per-example result),
opaque calls, everything else (gathered whole), and every op of a replicated TaskGraph."""
from __future__ import annotations

from whalex.planner.patterns.layout import Info
from whalex.planner.patterns.state import Site, Walk


def elementwise(w: Walk, s: Site, eqn, ins, batch) -> list[Info]:
    """Each dimension keeps the split of an input of the same rank; a parameter combined with a
    split value (a bias) is split the same way."""
    ndim = len(eqn.outvars[0].aval.shape)
    spec = [None] * ndim
    for info in ins:
        if len(info.spec) == ndim:
            for d, a in enumerate(info.spec):
                if spec[d] is None and a:
                    spec[d] = a
    for v in eqn.invars:
        o = w.param_of(s.frame, v)
        if o is None or len(v.aval.shape) != ndim:
            continue
        leaf, dims = o
        for d, a in enumerate(spec):
            if a == s.vd.model_axes and dims[d] is not None and v.aval.shape[d] == eqn.outvars[0].aval.shape[d]:
                w.decide_param(leaf, dims[d], a)
    return [Info(tuple(spec), batch)]


def broadcast(w: Walk, s: Site, eqn, ins, batch) -> list[Info]:
    out = eqn.outvars[0].aval.shape
    spec = [None] * len(out)
    for d_in, d_out in enumerate(eqn.params["broadcast_dimensions"]):
        if eqn.invars[0].aval.shape[d_in] == out[d_out]:
            spec[d_out] = ins[0].spec[d_in]
    return [Info(tuple(spec), batch)]


def transpose(w: Walk, s: Site, eqn, ins, batch) -> list[Info]:
    return [Info(tuple(ins[0].spec[p] for p in eqn.params["permutation"]), batch)]


def squeeze(w: Walk, s: Site, eqn, ins, batch) -> list[Info]:
    drop = set(d % len(ins[0].spec) for d in eqn.params["dimensions"])
    return [Info(tuple(a for d, a in enumerate(ins[0].spec) if d not in drop), batch)]


def reduction(w: Walk, s: Site, eqn, ins, batch) -> list[Info]:
    """A reduction over a split dimension: local, then all-reduced over its axes."""
    axes = set(eqn.params["axes"])
    spec = ins[0].spec
    reduced = [spec[d] for d in axes if spec[d]]
    info = Info(tuple(a for d, a in enumerate(spec) if d not in axes), batch)
    for a in reduced:
        w.comm(s.tg, "all-reduce", a, w.group_bytes(eqn.outvars[0].aval, info),
               f"{eqn.primitive.name} over a split dimension")
    return [Info(tuple(a if a not in reduced else None for a in info.spec), batch)]


def opaque(w: Walk, s: Site, eqn, ins, batch) -> list[Info]:
    """A call with a rule of its own (custom derivatives, remat) or an unmatched gather: an output
    shaped like its first split or batch input keeps that input's layout."""
    first = next((i for i in ins if any(i.spec[1:]) or i.batch), ins[0] if ins else None)
    result = []
    for v in eqn.outvars:
        if first is not None and len(first.spec) == len(v.aval.shape) and \
                eqn.invars and v.aval.shape == eqn.invars[ins.index(first)].aval.shape:
            result.append(Info(first.spec, batch))
        else:
            result.append(w.plain(s.vd, v.aval, batch))
    return result


def needs_whole(w: Walk, s: Site, eqn, ins, batch) -> list[Info]:
    """Any other operation needs whole tensors along split dims: they are gathered."""
    for v, info in zip(eqn.invars, ins):
        for a in info.spec[1:]:
            if a:
                w.comm(s.tg, "all-gather", a, w.group_bytes(v.aval, info),
                       f"{eqn.primitive.name} needs the whole tensor")
    return [w.plain(s.vd, v.aval, batch) for v in eqn.outvars]


def replicate_rule(w: Walk, vd, eqn, ins) -> list[Info]:
    """Inside a replicate TaskGraph values are batch-split or whole."""
    batch = any(i.batch for i in ins)
    return [w.plain(vd, v.aval, batch) for v in eqn.outvars]
