"""Expert parallelism for an MoE experts call under `split` (Whale's Example 5): experts split over
the model axes, tokens stay data parallel. The dispatched buffer [G, E, C, d] keeps its groups
sharded over every axis of the replica (no bridge gather); lowering runs the call as an all-to-all
/ local experts / all-to-all shard_map (`whalex.moe.parallel`)."""
from __future__ import annotations

from whalex.errors import PlanError
from whalex.planner.patterns import cost
from whalex.planner.patterns.layout import Info, to_spec, unsplit
from whalex.planner.patterns.state import Site, Walk
from whalex.records.sharding_plan import ExpertCall


def _check_counts(w: Walk, s: Site, g: int, e: int, n: int, shards: int):
    if e % n:
        raise PlanError(
            f"the MoE layer has {e} experts, which cannot be spread evenly over the {n} devices of "
            f"{w.cap.taskgraphs[s.tg].name} (wh.{s.vd.strategy.label()}); use a number of experts that is a "
            f"multiple of {n}, or a split degree that divides {e}.")
    if g % w.b or g % shards:
        raise PlanError(
            f"the MoE layer routes {g} token groups, which do not divide over the {shards} devices that "
            f"hold tokens (global batch {w.b}); use a batch size that is a multiple of {shards}.")


def _split_weights(w: Walk, s: Site, weights):
    """Every expert weight split on its leading (expert) dim over the model axes."""
    ma = s.vd.model_axes
    for v in weights:
        o = w.param_of(s.frame, v)
        if o is None:
            raise PlanError("the MoE experts' weights must be parameters of the model (leaves of params), "
                            "so that whalex can shard them over the expert devices.")
        leaf, dims = o
        if dims[0] is None or not w.decide_param(leaf, dims[0], ma):
            spec = w.param_spec.get(leaf)
            if spec is None or spec[dims[0]] != ma:
                raise PlanError(f"MoE expert weight {w.cap.param_paths[leaf]} is also used outside the "
                                "experts with another layout; give the experts their own parameters.")


def expert_parallel(w: Walk, s: Site, eqn, activation: str) -> list[Info]:
    """The experts call's layout, its weights' splits, its four all-to-alls and its ExpertCall."""
    buf, weights = eqn.invars[0], eqn.invars[1:]
    ma = s.vd.model_axes
    n = w.shards(ma)
    g, e = buf.aval.shape[:2]
    token_axes = tuple(a for a in w.layout.axis_names
                       if a in ma or (a in s.vd.batch_axes and w.shards((a,)) > 1))
    shards = w.shards(token_axes)
    _check_counts(w, s, g, e, n, shards)
    want = (token_axes,) + unsplit(len(buf.aval.shape) - 1)
    if w.read(s.frame, buf).spec != want:
        w.constraints[(s.path, "in", 0)] = to_spec(want)
    _split_weights(w, s, weights)
    local = cost.nbytes(buf.aval) / shards
    for what in ("dispatch", "combine", "dispatch (bwd)", "combine (bwd)"):
        w.comm(s.tg, "all-to-all", ma, local, f"MoE {what}")
    w.experts.append(ExpertCall(s.path, s.tg, activation, token_axes, ma, e // n))
    return [Info(want, True)]
