"""Rules for the operations that regroup, cut or join dimensions: reshape, slice / dynamic_slice /
split, concatenate. A split dimension survives when its blocks stay blocks; otherwise it is
gathered first."""
from __future__ import annotations

from whalex.planner.patterns.layout import Info
from whalex.planner.patterns.state import Site, Walk


def reshape_groups(in_shape, out_shape) -> list[tuple[list[int], list[int]]]:
    """The reshape as groups (input dims, output dims) of equal element count, size-1 dims left out."""
    ins = [d for d, k in enumerate(in_shape) if k != 1]
    outs = [d for d, k in enumerate(out_shape) if k != 1]
    groups, a, b = [], 0, 0
    while a < len(ins) and b < len(outs):
        gi, go = [ins[a]], [outs[b]]
        pi, po = in_shape[ins[a]], out_shape[outs[b]]
        a, b = a + 1, b + 1
        while pi != po:
            if pi < po and a < len(ins):
                gi.append(ins[a])
                pi, a = pi * in_shape[ins[a]], a + 1
            elif po < pi and b < len(outs):
                go.append(outs[b])
                po, b = po * out_shape[outs[b]], b + 1
            else:
                return [(ins, [])]             # not a plain regrouping: nothing survives
        groups.append((gi, go))
    return groups


def reshape(w: Walk, s: Site, eqn, ins, batch) -> list[Info]:
    """A split dimension survives a reshape when it is the major dimension of the group of input
    dimensions that becomes a group of output dimensions, and the group's major output dimension
    divides over the same devices: blocks of the one are then blocks of the other (heads
    [B, L, H, Dh] -> [B, L, KV, G, Dh] stay split on KV; [B, L, KV, G, Dh] -> [B, L, H, Dh] on H).
    Any other split dimension is gathered first."""
    info = ins[0]
    in_shape, out_shape = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    spec = [None] * len(out_shape)
    for gi, go in reshape_groups(in_shape, out_shape):
        for d in gi:
            a = info.spec[d]
            if not a:
                continue
            if d == gi[0] and go and out_shape[go[0]] % w.shards(a) == 0 and \
                    (d > 0 or not batch or out_shape[go[0]] % w.b == 0):
                spec[go[0]] = a
            else:
                w.comm(s.tg, "all-gather", a, w.group_bytes(eqn.invars[0].aval, info), "reshape of a split dim")
    return [Info(tuple(spec), batch)]


def _keep_whole_dims(w: Walk, s: Site, var, info: Info, out_shape, batch, name) -> Info:
    spec = []
    for d, a in enumerate(info.spec):
        if a and out_shape[d] != var.aval.shape[d]:
            w.comm(s.tg, "all-gather", a, w.group_bytes(var.aval, info), f"{name} of a split dim")
            a = None
        spec.append(a)
    return Info(tuple(spec), batch and out_shape[0] == var.aval.shape[0])


def cut(w: Walk, s: Site, eqn, ins, batch) -> list[Info]:
    """slice / dynamic_slice / split: a split dimension the op keeps whole stays split (q, k and v
    sliced out of a fused (..., 3, heads, head_dim) tensor keep their heads split); a split
    dimension the op cuts is gathered first."""
    return [_keep_whole_dims(w, s, eqn.invars[0], ins[0], v.aval.shape, batch, eqn.primitive.name)
            for v in eqn.outvars]


def concatenate(w: Walk, s: Site, eqn, ins, batch) -> list[Info]:
    """Concatenation along a whole dimension keeps the other dimensions' splits (rotary halves
    joined on head_dim keep the heads split)."""
    axis = eqn.params["dimension"]
    spec = [None] * len(eqn.outvars[0].aval.shape)
    for v, info in zip(eqn.invars, ins):
        for d, a in enumerate(info.spec):
            if a and d == axis:
                w.comm(s.tg, "all-gather", a, w.group_bytes(v.aval, info), "concatenate along a split dim")
            elif a and spec[d] is None:
                spec[d] = a
    return [Info(tuple(spec), batch)]
