"""The walk over the captured equations in order: batch inputs placed, calls entered, each
equation's outputs laid out by its TaskGraph's rule (`split_rule`, `replicate_rule`, experts), and
a bridge wherever a value enters a TaskGraph whose layout differs (Whale section 3.2.3)."""
from __future__ import annotations

from collections.abc import Sequence

from jax.sharding import PartitionSpec as P

from whalex import _compat as C
from whalex.errors import PlanError
from whalex.jaxpr.capture import Captured, passed_origin
from whalex.loss.analysis import is_floating
from whalex.mesh.virtual import MeshLayout, VirtualDevice
from whalex.planner.patterns import cost, report
from whalex.planner.patterns.elementwise import replicate_rule
from whalex.planner.patterns.experts import expert_parallel
from whalex.planner.patterns.layout import Info, to_spec, unsplit
from whalex.planner.patterns.rules import split_rule
from whalex.planner.patterns.state import Site, Walk
from whalex.records.call_names import parse_call_name
from whalex.records.sharding_plan import ShardingPlan


def plan_shardings(cap: Captured, vds: Sequence[VirtualDevice], layout: MeshLayout,
                   matmul_pattern: str = "auto") -> ShardingPlan:
    """Match sharding patterns and place bridges for every TaskGraph."""
    w = Walk(cap, vds, layout, matmul_pattern)
    jaxpr = cap.jaxpr.jaxpr
    for i, v in enumerate(jaxpr.invars[:cap.num_params]):
        w.origin[((), v)] = (i, tuple(range(len(v.aval.shape))))
    batch_specs = _place_batch(w, jaxpr)
    _walk(w, jaxpr, ())
    report.gradient_sync(w)
    specs = [to_spec(tuple(w.param_spec[i])) if w.param_spec.get(i) else P() for i in range(cap.num_params)]
    return ShardingPlan(tuple(specs), tuple(batch_specs), w.constraints, tuple(w.choices), tuple(w.comms),
                        tuple(w.experts), report.coverage(w, specs), report.padding(w))


def _batch_error(w: Walk, dp: int, name: str, vd: VirtualDevice) -> PlanError:
    return PlanError(
        f"the global batch of {w.b} cannot be divided over the {dp} data-parallel replicas of "
        f"{name} (wh.{vd.strategy.label()}); use a batch size that is a multiple of {dp}.")


def _place_batch(w: Walk, jaxpr) -> list[P]:
    """Each batch leaf split over the batch axes of the TaskGraph that first reads it."""
    first_use = _first_consumers(w, jaxpr)
    batch_specs = []
    for v in w.cap.batch_vars:
        tg = first_use.get(v, 0)
        vd = w.vds[tg]
        spec = w.batch_spec(vd, v.aval)
        dp = w.shards(vd.batch_axes)
        if w.b % dp:
            raise _batch_error(w, dp, w.cap.taskgraphs[tg].name, vd)
        w.info[((), v)] = Info(spec, True)
        w.producer[((), v)] = -1
        batch_specs.append(to_spec(spec))
    for vd in w.vds:
        dp = w.shards(vd.batch_axes)
        if w.b % dp:
            raise _batch_error(w, dp, f"TG{vd.taskgraph}", vd)
    return batch_specs


def _first_consumers(w: Walk, jaxpr) -> dict:
    first: dict = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, C.Literal) and v not in first:
                first[v] = _deep_tg(w, (i,), eqn, v)
    return first


def _deep_tg(w: Walk, path, eqn, v):
    """The TaskGraph that really consumes `v` through `eqn` (looking into calls)."""
    if C.is_call(eqn):
        sub, _ = C.call_jaxpr(eqn)
        idx = [k for k, x in enumerate(eqn.invars) if x is v]
        if idx:
            inner = sub.invars[idx[0]]
            for j, e in enumerate(sub.eqns):
                if any(x is inner for x in e.invars):
                    return _deep_tg(w, path + (j,), e, inner)
    return w.cap.assign[path]


def _enter_call(w: Walk, s: Site, eqn, ins) -> list[Info]:
    """A call: its inner values start as the call's inputs (parameters stay parameters)."""
    sub, _ = C.call_jaxpr(eqn)
    for iv, v, info in zip(sub.invars, eqn.invars, ins):
        w.info[(s.path, iv)] = info
        w.producer[(s.path, iv)] = s.tg
        o = w.param_of(s.frame, v)
        if o is not None:
            w.origin[(s.path, iv)] = o
    _walk(w, sub, s.path)
    return [w.read(s.path, v) for v in sub.outvars]


def _apply_rule(w: Walk, s: Site, eqn, ins) -> list[Info]:
    """One equation: parameter views tracked, then its TaskGraph's rule."""
    passed = passed_origin(eqn, {v: w.origin[(s.frame, v)] for v in eqn.invars
                                 if not isinstance(v, C.Literal) and (s.frame, v) in w.origin})
    if passed is not None:
        w.origin[(s.frame, eqn.outvars[0])] = passed
    return split_rule(w, s, eqn, ins) if s.vd.model_axes else replicate_rule(w, s.vd, eqn, ins)


def _walk(w: Walk, jaxpr, frame):
    for i, eqn in enumerate(jaxpr.eqns):
        path = frame + (i,)
        tg = w.cap.assign[path]
        s = Site(path, frame, tg, w.vds[tg])
        activation = parse_call_name(str(eqn.params.get("name", ""))) if C.is_call(eqn) else None
        if activation is not None and s.vd.model_axes:
            for v, info in zip(eqn.outvars, expert_parallel(w, s, eqn, activation)):
                w.info[(frame, v)] = info
                w.producer[(frame, v)] = tg
            continue
        ins = [_bridge(w, s, pos, v) for pos, v in enumerate(eqn.invars)]
        outs = _enter_call(w, s, eqn, ins) if C.is_call(eqn) else _apply_rule(w, s, eqn, ins)
        for k, (v, info) in enumerate(zip(eqn.outvars, outs)):
            w.info[(frame, v)] = info
            w.producer[(frame, v)] = tg
            w.made_at[(frame, v)] = (path, k)


def _sliced_gradient(w: Walk, s: Site, v, info: Info, want: tuple) -> None:
    """A value the consumer splits over axes its producer held it whole on is sliced for free going
    forward; its gradient, split the same way, is gathered back for the producer's backward pass
    (once per value and consumer TaskGraph)."""
    new = tuple(a for have, need in zip(info.spec, want) for a in (need or ()) if not have or a not in have)
    producer = w.producer.get((s.frame, v), -1)
    key = (s.frame, v, s.tg)
    if not new or producer < 0 or key in w.sliced or not is_floating(v):
        return
    w.sliced.add(key)
    held = cost.laid_out_bytes(v.aval, info.spec, w.shards)
    w.comm(s.tg, "all-gather", new, held, f"bridge out of TG{producer}: its gradient gathered (bwd)")


def _bridge(w: Walk, s: Site, pos: int, v) -> Info:
    """The layout `v` enters equation `s` with: its own, or, coming from another TaskGraph whose
    layout differs, the consumer's (gathered; a split on the consumer's own axes is kept, fused)."""
    info = w.read(s.frame, v)
    if isinstance(v, C.Literal) or w.param_of(s.frame, v) is not None:
        return info
    if w.producer.get((s.frame, v), s.tg) == s.tg:
        return info
    aval = v.aval
    if info.batch:
        want = list(w.batch_spec(s.vd, aval))
        for d, a in enumerate(info.spec):
            if d > 0 and a and a == s.vd.model_axes:
                want[d] = a
    else:
        want = list(unsplit(len(aval.shape)))
    want = tuple(want)
    if want == info.spec:
        return info
    # the gathered buffer: the value as the consumer lays it out (a batch split over the consumer's own
    # model axes is gathered whole)
    size = cost.laid_out_bytes(aval, want, w.shards)
    for d, (have, need) in enumerate(zip(info.spec, want)):
        if have and have != need:
            gathered = tuple(a for a in have if not need or a not in need)
            w.comm(s.tg, "all-gather", gathered, size, f"bridge into TG{s.tg}: gather dim {d}")
            w.gathered[(s.frame, v)] = w.gathered.get((s.frame, v), ()) + gathered
    _sliced_gradient(w, s, v, info, want)
    w.constraints[(s.path, "in", pos)] = to_spec(want)
    made = w.made_at.get((s.frame, v))
    if made is not None:            # the producer keeps its own layout up to the bridge
        w.constraints.setdefault((made[0], "out", made[1]), to_spec(info.spec))
    return Info(want, info.batch)
