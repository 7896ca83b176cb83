"""Which rule an equation of a `split` TaskGraph follows, by primitive: the matmul and embedding
patterns where they match, then one rule per family of operations."""
from __future__ import annotations

from whalex.jaxpr import primitive_table as P
from whalex.planner.patterns import elementwise as ew, reshape as rs
from whalex.planner.patterns.embedding import embedding
from whalex.planner.patterns.layout import Info
from whalex.planner.patterns.matmul import generic_dot, matmul
from whalex.planner.patterns.state import Site, Walk


def _dot(w: Walk, s: Site, eqn, ins, batch) -> list[Info]:
    """A weight's matmul pattern; failing one, a product of activations."""
    res = matmul(w, s, eqn, ins)
    if res is not None:
        return [res]
    for v in eqn.invars:
        o = w.param_of(s.frame, v)
        if o is not None:
            w.unmatched.setdefault(o[0], (s.tg, "dot_general with dimension_numbers "
                                                f"{eqn.params['dimension_numbers']} not matched"))
    return [generic_dot(w, s, eqn, ins, batch)]


def _gather(w: Walk, s: Site, eqn, ins, batch) -> list[Info]:
    """An embedding lookup; any other gather is opaque."""
    res = embedding(w, s, eqn, ins)
    return [res] if res is not None else ew.opaque(w, s, eqn, ins, batch)


# Later entries win where a primitive is in two families.
RULES = {
    **{name: ew.opaque for name in P.OPAQUE_CALLS},
    **{name: ew.reduction for name in P.REDUCTIONS},
    "broadcast_in_dim": ew.broadcast, "transpose": ew.transpose, "squeeze": ew.squeeze,
    "reshape": rs.reshape, "slice": rs.cut, "dynamic_slice": rs.cut, "split": rs.cut,
    "concatenate": rs.concatenate,
    **{name: ew.elementwise for name in P.ELEMENTWISE},
    "dot_general": _dot, "gather": _gather,
}


def split_rule(w: Walk, s: Site, eqn, ins) -> list[Info]:
    """The layouts of an equation's outputs inside a split TaskGraph (recording what it decides)."""
    name = eqn.primitive.name
    for v in eqn.invars:
        o = w.param_of(s.frame, v)
        if o is not None and name not in P.PASS_THROUGH:      # a view of the parameter passes it on
            w.readers.setdefault(o[0], f"read by {name}, which no sharding pattern splits")
    return RULES.get(name, ew.needs_whole)(w, s, eqn, ins, any(i.batch for i in ins))
