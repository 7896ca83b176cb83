"""The embedding pattern: a lookup `table[ids]` (a gather of whole rows of a 2-D parameter), the
table split on the hidden dim (no communication) or on the vocabulary (a masked lookup, then an
all-reduce); the cheaper wins, the hidden split on a tie."""
from __future__ import annotations

from whalex.errors import PlanError
from whalex.planner.patterns import cost
from whalex.planner.patterns.layout import Info, to_spec
from whalex.planner.patterns.state import Site, Walk
from whalex.records.sharding_plan import PatternChoice


def _lookup(w: Walk, s: Site, eqn):
    """(leaf, dims) of the table of a whole-row lookup, or None for any other gather."""
    o = w.param_of(s.frame, eqn.invars[0])
    if o is None or len(eqn.invars[0].aval.shape) != 2:
        return None
    dn = eqn.params["dimension_numbers"]
    table = eqn.invars[0].aval.shape
    if tuple(dn.collapsed_slice_dims) != (0,) or tuple(dn.start_index_map) != (0,) or \
            tuple(eqn.params["slice_sizes"]) != (1, table[1]) or None in o[1]:
        return None
    return o


def _unshardable(w: Walk, s: Site, leaf, table, forced: str, n: int) -> PlanError:
    what = ("its hidden size is" if forced == "column" else "its vocabulary is" if forced == "row"
            else "its vocabulary and hidden size are both")
    return PlanError(
        f"split({n}) cannot shard the embedding {w.cap.param_paths[leaf]} (shape {tuple(table)}): "
        f"{what} smaller than the {n} devices of {w.cap.taskgraphs[s.tg].name}. Use a smaller split degree, "
        f"or move the embedding out of the split scope.")


def embedding(w: Walk, s: Site, eqn, ins) -> Info | None:
    """The hidden or the vocabulary split for a table lookup (None: not a lookup of a parameter)."""
    o = _lookup(w, s, eqn)
    if o is None:
        return None
    leaf, dims = o
    table = eqn.invars[0].aval.shape
    ma = s.vd.model_axes
    n = w.shards(ma)
    idx = ins[1]
    y_info = w.plain(s.vd, eqn.outvars[0].aval, idx.batch)
    y_bytes = w.group_bytes(eqn.outvars[0].aval, y_info)
    costs = cost.embedding_costs(table, y_bytes, n)
    decided = w.param_spec.get(leaf)
    if decided is not None:
        pattern = "row" if decided[dims[0]] == ma else "column"
    else:
        forced = w.forced(s.vd)
        if forced != "auto" and costs[forced] == cost.INF or costs["column"] == costs["row"] == cost.INF:
            raise _unshardable(w, s, leaf, table, forced, n)
        pattern = forced if forced != "auto" else min(("column", "row"), key=lambda k: (costs[k], k != "column"))
        w.decide_param(leaf, dims[1] if pattern == "column" else dims[0], ma)
    name = w.cap.param_paths[leaf]
    w.choices.append(PatternChoice(s.tg, "embedding", name, "hidden split" if pattern == "column" else "vocab split",
                                   tuple(sorted(costs.items()))))
    out = list(y_info.spec)
    if pattern == "column":
        out[-1] = ma
    else:
        w.comm(s.tg, "all-reduce", ma, y_bytes, f"vocab-split embedding {name}")
    w.constraints[(s.path, "out", 0)] = to_spec(tuple(out))
    return Info(tuple(out), idx.batch)
