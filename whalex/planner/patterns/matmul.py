"""Matmul patterns (Whale section 3.2.2) for any dot_general that reads one weight: SP1 column
(the weight split on a free dim, the input whole: no forward communication, the input gradient
all-reduced) and SP2 row (the weight split on a contracting dim, the input split on it: the
partial sums all-reduced). The weight may have several contracting and free dimensions
(DenseGeneral's (in, heads, head_dim) kernels and its (heads, head_dim, out) output kernel,
einsum-written layers, fused (in, 3, heads, head_dim) qkv kernels). Column splits one free dim, row
one contracting dim (the one the input is already split on, if any); the cheaper of the two in
communication wins, among those whose dimension the split degree divides. A product of two
activations (attention's scores and context) follows `generic_dot`."""
from __future__ import annotations

import dataclasses

from whalex.errors import PlanError
from whalex.planner.patterns import cost
from whalex.planner.patterns.layout import Info, to_spec, unsplit
from whalex.planner.patterns.state import Site, Walk
from whalex.records.sharding_plan import PatternChoice


@dataclasses.dataclass(frozen=True)
class Operands:
    """A dot_general that reads one weight, seen from the weight."""

    w_pos: int               # the weight's operand position; the input is the other one
    leaf: int                # the weight's parameter leaf ...
    dims: tuple              # ... and, per weight dim, the leaf's dim (None: not a view of one)
    wc: tuple                # the weight's contracting dims
    xc: tuple                # the input's contracting dims, in the same order
    w_free: tuple            # the weight's free dims
    w_shape: tuple

    @property
    def x_pos(self) -> int:
        return 1 - self.w_pos


@dataclasses.dataclass(frozen=True)
class Candidates:
    """Where each pattern would split the weight: `col` a free dim, `row_k` a position in `wc`."""

    col_dims: tuple          # the free dims a column split may take
    row_ks: tuple            # the contracting positions a row split may take
    col: int | None
    row_k: int | None
    x_split_k: int | None    # the contracting position the input is already split on


@dataclasses.dataclass(frozen=True)
class Pick:
    """The pattern chosen, and the weight dim it splits (`col`, or position `row_k` in `wc`)."""

    pattern: str             # column | row
    col: int | None
    row_k: int | None


def _prefer(candidates: list[int], shape, skip_last: bool) -> int | None:
    """The dimension to split among `candidates`: not the innermost one when there are several
    (split heads, not head_dim: the score contraction stays local), then the largest (3 < heads in
    a fused (3, heads, head_dim) kernel), then the first."""
    if not candidates:
        return None
    inner = max(candidates) if skip_last and len(candidates) > 1 else None
    return min(candidates, key=lambda d: (d == inner, -shape[d], d))


def _choose(candidates: list[int], shape, n: int, skip_last: bool) -> int | None:
    """`_prefer` among the dimensions `n` divides; failing those, among the dimensions of at least
    `n` elements, which the plan stores padded to a multiple of `n` (None: no dimension can split)."""
    even = _prefer([d for d in candidates if shape[d] % n == 0], shape, skip_last)
    return even if even is not None else _prefer([d for d in candidates if shape[d] >= n], shape, skip_last)


def _operands(w: Walk, s: Site, eqn) -> Operands | None:
    """The weight and the input of a dot_general with exactly one parameter operand, or None."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lo, ro = w.param_of(s.frame, eqn.invars[0]), w.param_of(s.frame, eqn.invars[1])
    if (lo is None) == (ro is None):
        return None
    w_pos = 0 if lo is not None else 1
    leaf, dims = lo if lo is not None else ro
    wc, xc = (lc, rc) if w_pos == 0 else (rc, lc)
    wb = lb if w_pos == 0 else rb
    w_shape = eqn.invars[w_pos].aval.shape
    if wb:
        w.unmatched.setdefault(leaf, (s.tg, f"dot_general with the weight's dimensions {tuple(wb)} as batch "
                                            f"dimensions (dimension_numbers {eqn.params['dimension_numbers']})"))
        return None
    w_free = tuple(d for d in range(len(w_shape)) if d not in wc and d not in wb)
    return Operands(w_pos, leaf, tuple(dims), tuple(wc), tuple(xc), w_free, tuple(w_shape))


def _candidates(op: Operands, x: Info, ma, n: int) -> Candidates | None:
    col_dims = tuple(d for d in op.w_free if op.dims[d] is not None)
    row_ks = tuple(k for k, d in enumerate(op.wc) if op.dims[d] is not None)
    if not col_dims and not row_ks:
        return None
    x_split_k = next((k for k, d in enumerate(op.xc) if x.spec[d] == ma), None)
    col = _choose(list(col_dims), op.w_shape, n, len(op.w_free) > 1)
    if x_split_k is not None and x_split_k in row_ks:
        row_k = x_split_k
    else:
        k_dim = _choose([op.wc[k] for k in row_ks], op.w_shape, n, len(op.wc) > 1)
        row_k = None if k_dim is None else list(op.wc).index(k_dim)
    return Candidates(col_dims, row_ks, col, row_k, x_split_k)


def _unshardable(w: Walk, s: Site, op: Operands, cand: Candidates, forced: str, n: int) -> PlanError:
    rows = [op.wc[k] for k in cand.row_ks]
    dims = list(cand.col_dims) if forced == "column" else rows if forced == "row" else list(cand.col_dims) + rows
    sizes = ", ".join(f"{op.w_shape[d]}" for d in dims)
    which = {"column": "output (free)", "row": "contracted"}.get(forced, "output and contracted")
    return PlanError(
        f"split({n}) cannot shard {w.cap.param_paths[op.leaf]} (shape {op.w_shape}): its {which} dimensions "
        f"({sizes}) are all smaller than the {n} devices of {w.cap.taskgraphs[s.tg].name}, so no "
        f"split gives every device a part. Use a split degree of at most the largest of them, or move "
        f"this layer out of the split scope.")


def _pick(w: Walk, s: Site, op: Operands, cand: Candidates, costs: dict, n: int) -> Pick | None:
    """A weight used twice keeps its first layout (None: it cannot); else
    the forced pattern, or the cheaper one (then the unpadded one, then the one that takes the
    input as it is laid out)."""
    ma = s.vd.model_axes
    decided = w.param_spec.get(op.leaf)
    if decided is not None:
        on = [d for d in range(len(op.w_shape)) if op.dims[d] is not None and decided[op.dims[d]] == ma]
        if on and on[0] in op.wc:
            return Pick("row", cand.col, list(op.wc).index(on[0]))
        if on and on[0] in op.w_free:
            return Pick("column", on[0], cand.row_k)
        return None
    forced = w.forced(s.vd)
    if forced != "auto" and costs[forced] == cost.INF or costs["column"] == costs["row"] == cost.INF:
        raise _unshardable(w, s, op, cand, forced, n)
    pads = {"column": cand.col is not None and op.w_shape[cand.col] % n != 0,
            "row": cand.row_k is not None and op.w_shape[op.wc[cand.row_k]] % n != 0}
    natural = "row" if cand.x_split_k is not None else "column"      # on a tie: the one that takes x as it is laid out
    pattern = forced if forced != "auto" else \
        min(("column", "row"), key=lambda k: (costs[k], pads[k], k != natural))
    w.decide_param(op.leaf, op.dims[cand.col] if pattern == "column" else op.dims[op.wc[cand.row_k]], ma)
    return Pick(pattern, cand.col, cand.row_k)


def _record(w: Walk, s: Site, op: Operands, pick: Pick, costs: dict, x_bytes, y_bytes, x_split_k, n: int,
            x_gathered: bool = False):
    """The choice and the collectives it implies. `x_gathered`: the input came through a bridge that
    gathered its batch over the model axes, so its gradient's sum over them is also that bridge's
    transpose: one reduce-scatter instead of an all-reduce."""
    ma, name = s.vd.model_axes, w.cap.param_paths[op.leaf]
    pattern, col, row_k = pick.pattern, pick.col, pick.row_k
    label = "SP1 column" if pattern == "column" else "SP2 row"
    size = op.w_shape[col] if pattern == "column" else op.w_shape[op.wc[row_k]]
    if size % n:
        label += f", padded {size} -> {-(-size // n) * n}"
    w.choices.append(PatternChoice(s.tg, "matmul", name, label, tuple(sorted(costs.items()))))
    if pattern == "column":
        if x_split_k is not None:
            w.comm(s.tg, "all-gather", ma, x_bytes, f"SP1 {name}: gather input")
            w.comm(s.tg, "reduce-scatter", ma, x_bytes, f"SP1 {name}: input grad (bwd)")
        elif x_gathered:
            w.comm(s.tg, "reduce-scatter", ma, x_bytes, f"SP1 {name}: input grad (bwd), scattered back to the batch")
        else:
            w.comm(s.tg, "all-reduce", ma, x_bytes, f"SP1 {name}: input grad (bwd)")
    else:
        w.comm(s.tg, "all-reduce", ma, y_bytes, f"SP2 {name}: partial sums")
        if x_split_k != row_k:
            w.comm(s.tg, "all-gather", ma, x_bytes, f"SP2 {name}: input grad (bwd)")


def _pin(w: Walk, s: Site, eqn, op: Operands, x: Info, pick: Pick) -> tuple:
    """Pin the input's layout (contracting dims whole for column, split on the row dim for row; the
    model axes leave its other dims) and the output's; the output's spec."""
    ma = s.vd.model_axes
    pattern, col, row_k = pick.pattern, pick.col, pick.row_k
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    x_want = [None if a == ma else a for a in x.spec]
    for k, d in enumerate(op.xc):
        x_want[d] = ma if pattern == "row" and k == row_k else None
    w_spec = [ma if pattern == "column" and d == col else None for d in range(len(op.w_shape))]
    lhs, rhs = (w_spec, x_want) if op.w_pos == 0 else (x_want, w_spec)
    out = [lhs[d] for d in lb]
    out += [lhs[d] for d in range(len(lhs)) if d not in lc and d not in lb]
    out += [rhs[d] for d in range(len(rhs)) if d not in rc and d not in rb]
    w.constraints[(s.path, "in", op.x_pos)] = to_spec(tuple(x_want))     # pinned: XLA must not re-split it
    w.constraints[(s.path, "out", 0)] = to_spec(tuple(out))
    return tuple(out)


def matmul(w: Walk, s: Site, eqn, ins) -> Info | None:
    """SP1 column or SP2 row for a dot_general that reads one weight (None: no pattern applies)."""
    op = _operands(w, s, eqn)
    if op is None:
        return None
    ma = s.vd.model_axes
    n = w.shards(ma)
    x = ins[op.x_pos]
    cand = _candidates(op, x, ma, n)
    if cand is None:
        return None
    x_bytes = w.group_bytes(eqn.invars[op.x_pos].aval, x)
    y_aval = eqn.outvars[0].aval
    y_bytes = w.group_bytes(y_aval, Info(w.batch_spec(s.vd, y_aval) if x.batch else unsplit(len(y_aval.shape)),
                                         x.batch))
    costs = cost.matmul_costs(x_bytes, y_bytes, n, cand.col is not None, cand.row_k is not None,
                              cand.x_split_k is not None, cand.x_split_k == cand.row_k)
    pick = _pick(w, s, op, cand, costs, n)
    if pick is None:
        return None
    gathered = set(w.gathered.get((s.frame, eqn.invars[op.x_pos]), ()))
    _record(w, s, op, pick, costs, x_bytes, y_bytes, cand.x_split_k, n, bool(ma) and set(ma) <= gathered)
    return Info(_pin(w, s, eqn, op, x, pick), x.batch)


def generic_dot(w: Walk, s: Site, eqn, ins, batch) -> Info:
    """A product of two activations (attention's scores and context): batch dims keep their
    splits (heads stay split), a contraction over a split dim is all-reduced. When the result is
    split over this TaskGraph's own axes its layout is pinned, operands and result, so that
    XLA keeps the heads where the projections put them."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = ins
    out_spec = [lhs.spec[d] for d in lb]
    out_spec += [lhs.spec[d] for d in range(len(lhs.spec)) if d not in lc and d not in lb]
    out_spec += [rhs.spec[d] for d in range(len(rhs.spec)) if d not in rc and d not in rb]
    partial = [lhs.spec[a] for a, b in zip(lc, rc) if lhs.spec[a] and lhs.spec[a] == rhs.spec[b]]
    info = Info(tuple(out_spec), batch)
    for a in partial:
        w.comm(s.tg, "all-reduce", a, w.group_bytes(eqn.outvars[0].aval, info), "contraction over a split dim")
    seen, clean = set(), []
    for a in out_spec:          # one mesh axis may shard only one dimension
        clean.append(a if a and a not in seen else None)
        if a:
            seen.add(a)
    if s.vd.model_axes and s.vd.model_axes in clean and not partial:
        for pos, i in enumerate(ins):
            w.constraints[(s.path, "in", pos)] = to_spec(i.spec)
        w.constraints[(s.path, "out", 0)] = to_spec(tuple(clean))
    return Info(tuple(clean), batch)
