"""What XLA's GPU compiler makes of a shard_map's outputs, for the memory replay: it inlines the body
after partitioning and fuses element-wise values into element-wise users, recomputing them there."""
from __future__ import annotations

from collections.abc import Sequence

from whalex import _compat as C
from whalex.memory.flat import Op, aval_bytes, flatten
from whalex.memory.op_kinds import FUSIBLE


def shared_outputs(op: Op, ops: Sequence[Op], consumers: dict) -> dict:
    """Output key -> the output key whose buffer stands in for it, for a shard_map's element-wise
    outputs on a GPU. XLA inlines the body after partitioning and fuses an element-wise value into
    users that are element-wise too, recomputing it there from the values it was computed from
    (a feed-forward's pre-activation for the activation's derivatives saved for the backward
    pass): such outputs computed from the same values share one buffer, which stands for those
    values. An output read by anything else (a matmul) keeps its own."""
    body, _ = C.open_jaxpr(C.sub_jaxprs(op.eqn)[0])
    inner, outs = flatten(body, [("in", k) for k in range(len(body.invars))])
    producer = {x: o for o in inner for x in o.outs}
    memo: dict = {}

    def roots(x) -> frozenset:                   # the body's own values it is computed from
        if isinstance(x, C.Literal) or x not in producer:      # constants and operands: kept outside
            return frozenset()
        if x not in memo:
            o = producer[x]
            memo[x] = frozenset([x]) if o.eqn.primitive.name not in FUSIBLE else \
                frozenset().union(*[roots(u) for u in o.ins])
        return memo[x]

    groups: dict = {}
    for k, x in enumerate(outs):
        r = roots(x)
        if r and (r == {x} or all(fused_into(ops[c], op.outs[k]) for c in consumers.get(op.outs[k], ()))):
            groups.setdefault(r, []).append(k)
    sizes = [aval_bytes(v.aval) for v in op.eqn.outvars]
    shared = {}
    for r, members in groups.items():
        leader = max(members, key=lambda k: (outs[k] in r, sizes[k]))
        shared.update({op.outs[k]: op.outs[leader] for k in members if k != leader and sizes[k] <= sizes[leader]})
    return shared


def fused_into(user: Op, x) -> bool:
    """Whether XLA can fuse `x` into every use `user` makes of it (element-wise or layout uses,
    directly or inside a shard_map's body)."""
    name = user.eqn.primitive.name
    if name in FUSIBLE:
        return True
    if name != "shard_map":
        return False
    body, _ = C.open_jaxpr(C.sub_jaxprs(user.eqn)[0])
    keys = [("in", k) for k in range(len(body.invars))]
    inner, outs = flatten(body, keys)
    mine = {keys[k] for k, u in enumerate(user.ins) if not isinstance(u, C.Literal) and u == x}
    return not mine & {u for u in outs if not isinstance(u, C.Literal)} and \
        all(o.eqn.primitive.name in FUSIBLE for o in inner
            if any(u in mine for u in o.ins if not isinstance(u, C.Literal)))
