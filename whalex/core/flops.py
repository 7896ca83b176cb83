"""Training FLOPs (forward + backward) counted from a jaxpr's equations, the same on every platform.

XLA's cost analysis cannot be the source: on a GPU `Lowered.cost_analysis()` has no FLOPs and
`Compiled.cost_analysis()` leaves out library calls, and lowering a function only to ask is slow.
The count follows the conventions of XLA's HloCostAnalysis, so on CPU the two compare.

Forward, per equation:
- dot_general: 2 x output size x contracted size; conv_general_dilated: 2 x the multiply-adds at
  valid kernel positions (padding and dilation holes skipped), as XLA counts them.
- element-wise arithmetic, comparisons, selects, converts: 1 per output element (`integer_pow`: its
  multiplications); transcendental functions (exp, log, tanh, ...) 0, as XLA counts them apart; the
  few that XLA expands into arithmetic (logistic, erfc, erf_inv) what XLA counts.
- reductions: input size - output size; cumulative ones (cumsum, ...): their size (a scan's work;
  XLA on CPU counts a reduce-window, size x length); sort: size x log2(length); threefry random
  bits: 29 per 32-bit word.
- data movement (reshape, broadcast, slices, gather, concatenate, ...) and collectives: 0.

Backward, as `jax.vjp` builds it: a value is *differentiated* when it is floating and depends on a
differentiated input (the trained parameters, not the data); it *needs a cotangent* when it leads,
through differentiated values, to a seeded output (the loss). Only an equation with a differentiated
input and an output that needs a cotangent has a backward:
- dot_general, convolution: one product of the forward's size per differentiated operand (a layer
  applied to the data, or to an integer input, costs 1x its forward more; two activations 2x);
- element-wise ops and reductions: what JAX's JVP and transpose rules emit (those of the newest
  supported JAX), per differentiated operand: mul 1, tanh 4, div 1 and 5, reduce_max 4 per input
  element, an operand broadcast along size-1 axes the sum back to its shape, broadcast_in_dim its
  reduction, gather a scatter-add, relu (a custom_jvp) 2;
- a value whose cotangent comes from k uses: k - 1 additions of its size, counted with its first
  reader (the backward sums the contributions there, before the value's maker sees them).

Control flow and calls:
- scan: its body x `length`, forward and backward; while: (cond + body) x the trip count when it is
  static (a counter from a literal start to a literal bound by a literal step), once otherwise;
- cond / switch: the costliest branch, forward and backward apart (one branch runs);
- jit, closed_call, custom_jvp_call, custom_vjp_call: their body (a custom rule's backward is
  estimated by the body's own rules);
- checkpoint (remat): the forward equations that make the values its backward reads, once more in
  the backward, less those its policy saves; shard_map: its body (per-shard shapes) x the number of
  shards.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import numpy as np

from whalex import _compat as C

# Forward: 0 FLOPs (data movement, collectives, bookkeeping; their transposes are data movement too).
_MOVE = frozenset({
    "reshape", "transpose", "squeeze", "expand_dims", "slice", "dynamic_slice", "dynamic_update_slice",
    "concatenate", "pad", "rev", "iota", "copy", "copy_p", "device_put", "sharding_constraint", "mesh_cast",
    "reshard", "pcast", "pvary", "psum", "pmax", "pmin", "ppermute", "all_gather", "all_to_all",
    "psum_scatter", "reduce_scatter", "axis_index", "pbroadcast", "psum_invariant", "bitcast_convert_type",
    "stop_gradient", "optimization_barrier", "name", "random_wrap", "random_unwrap", "top_k", "split",
    "scatter", "empty", "broadcast"})
# Forward: 0 FLOPs (XLA counts transcendental functions apart from FLOPs).
_TRANSCENDENTAL = frozenset({
    "exp", "log", "tanh", "sin", "cos", "tan", "sqrt", "rsqrt", "cbrt", "pow", "atan2", "expm1", "log1p",
    "erf", "atan", "asin", "acos", "sinh", "cosh", "atanh", "acosh", "lgamma", "digamma", "igamma",
    "igammac", "polygamma", "zeta", "bessel_i0e", "bessel_i1e", "random_gamma_grad",
    "regularized_incomplete_beta"})
# Forward FLOPs per output element where not 1 (XLA expands these into arithmetic).
_FWD = {"logistic": 3.0, "erfc": 62.0, "erf_inv": 37.0, "asinh": 11.0, "nextafter": 24.0,
        "random_bits": 29.0, "threefry2x32": 14.5, "random_split": 28.0, "random_fold_in": 37.0}
# Backward FLOPs per output element, per differentiated operand (JVP + transpose rules).
_BWD_UNARY = {
    "neg": 1, "exp": 1, "log": 1, "tanh": 4, "logistic": 3, "sqrt": 2, "rsqrt": 3, "cbrt": 4, "erf": 24,
    "erfc": 24, "erf_inv": 3, "sin": 1, "cos": 2, "tan": 3, "atan": 3, "asinh": 10, "expm1": 1, "log1p": 2,
    "exp2": 2, "abs": 5, "square": 2, "convert_element_type": 1, "reduce_precision": 1, "real": 1,
    "imag": 1, "conj": 1}
_BWD_OPERANDS = {
    "add": (0, 0), "add_any": (0, 0), "sub": (0, 1), "mul": (1, 1), "div": (1, 5), "max": (5, 5),
    "min": (5, 5), "pow": (3, 4), "atan2": (5, 6), "rem": (0, 8), "clamp": (2, 4, 2)}
_REDUCE = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                     "reduce_xor", "argmax", "argmin"})
_BWD_REDUCE = {"reduce_max": 4, "reduce_min": 4, "reduce_prod": 4}      # per input element
_CUMULATIVE = {"cumsum": 1, "cumprod": 3, "cummax": 3, "cummin": 3, "cumlogsumexp": 3}  # backward per element
# Outputs never differentiated (zero derivative, or not numbers).
_NONDIFF = frozenset({
    "sign", "floor", "ceil", "round", "nextafter", "is_finite", "argmax", "argmin", "iota", "stop_gradient",
    "random_bits", "random_seed", "random_split", "random_fold_in", "random_wrap", "random_unwrap",
    "threefry2x32", "rng_bit_generator", "rng_uniform", "population_count", "clz", "axis_index"})
_REMAT = frozenset(C.CHECKPOINT_PRIMITIVES)
# Linear in their differentiated operands: the backward reads no forward value (but indices).
_LINEAR = frozenset({"add", "add_any", "sub", "neg", "reduce_sum", "convert_element_type", "cumsum",
                     "reduce_precision", "real", "imag", "conj", "select_n", "gather", "scatter-add",
                     "scatter_add"})
# Their backward reads their output (exp's cotangent is g * exp(x)).
_USES_OUTPUT = frozenset({"exp", "exp2", "tanh", "logistic", "sqrt", "rsqrt", "cbrt", "expm1", "reduce_max",
                          "reduce_min", "max", "min", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort"})


@dataclasses.dataclass(frozen=True)
class Counts:
    """(forward, backward) FLOPs of each equation of a jaxpr; `extra` is backward work no equation
    owns (the cotangent additions of an input passed straight to several outputs); `live_in` marks
    the inputs the backward sends a cotangent to; `live_eqns` the differentiated inputs of each
    equation that has a backward (None for the others)."""

    per_eqn: tuple[tuple[float, float], ...]
    extra: float
    live_in: tuple[bool, ...]
    live_eqns: tuple = ()

    @property
    def forward(self) -> float:
        return float(sum(f for f, _ in self.per_eqn))

    @property
    def backward(self) -> float:
        return float(sum(b for _, b in self.per_eqn)) + self.extra


def equation_flops(jaxpr, differentiated: Sequence[bool], seeds: Sequence[bool],
                   memo: dict | None = None) -> Counts:
    """(forward, backward) FLOPs of each equation of `jaxpr` (open or closed) when the inputs marked
    `differentiated` are differentiated and the outputs marked `seeds` receive a cotangent (see the
    module's docstring for the rules). `memo` shares the counts of called jaxprs between calls."""
    jaxpr, _ = C.open_jaxpr(jaxpr)
    return _counts(jaxpr, tuple(map(bool, differentiated)), tuple(map(bool, seeds)), {} if memo is None else memo)


def training_flops(jaxpr, differentiated: Sequence[bool], seeds: Sequence[bool]) -> float:
    """Forward + backward FLOPs of a whole jaxpr (`equation_flops` summed)."""
    c = equation_flops(jaxpr, differentiated, seeds)
    return c.forward + c.backward


# ------------------------------------------------------------------ analysis of one jaxpr

def _memo(memo: dict, key: tuple, keep: Any, make):
    """memo[key], made once; `keep` (the jaxpr whose id is in the key) is kept alive with it."""
    if key not in memo:
        memo[key] = (keep, make())
    return memo[key][1]


def _inexact(v) -> bool:
    dtype = getattr(getattr(v, "aval", None), "dtype", None)
    try:
        return dtype is not None and bool(jax.dtypes.issubdtype(dtype, np.inexact))
    except TypeError:
        return False


def _size(v) -> float:
    shape = getattr(getattr(v, "aval", None), "shape", None)
    return 0.0 if shape is None else float(math.prod(int(d) for d in shape))


def _var(v) -> bool:
    return not isinstance(v, C.Literal)


def _forward(jaxpr, din: tuple, memo: dict) -> tuple[frozenset, tuple]:
    """(the differentiated values, which outputs are differentiated)."""
    def make():
        active = {v for v, d in zip(jaxpr.invars, din) if d and _inexact(v)}
        for eqn in jaxpr.eqns:
            ins = tuple(_var(v) and v in active for v in eqn.invars)
            if any(ins):
                active.update(v for v, a in zip(eqn.outvars, _eqn_active(eqn, ins, memo)) if a)
        return frozenset(active), tuple(_var(v) and v in active for v in jaxpr.outvars)
    return _memo(memo, ("fwd", id(jaxpr), din), jaxpr, make)


def _counts(jaxpr, din: tuple, seeds: tuple, memo: dict) -> Counts:
    return _memo(memo, ("counts", id(jaxpr), din, seeds), jaxpr, lambda: _count_jaxpr(jaxpr, din, seeds, memo))


def _count_jaxpr(jaxpr, din: tuple, seeds: tuple, memo: dict) -> Counts:
    active, _ = _forward(jaxpr, din, memo)
    live = {v for v, s in zip(jaxpr.outvars, seeds) if s and _var(v) and v in active}
    uses: dict = {}
    for v, s in zip(jaxpr.outvars, seeds):
        if s and _var(v) and v in active:
            uses[v] = uses.get(v, 0) + 1
    costs = [[_eqn_fwd(e, memo), 0.0] for e in jaxpr.eqns]
    live_eqns: list = [None] * len(jaxpr.eqns)
    first_reader: dict = {}
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        lout = tuple(_var(v) and v in live for v in eqn.outvars)
        if not any(lout):
            continue
        ains = tuple(_var(v) and v in active for v in eqn.invars)
        if not any(ains):
            continue
        lin = _eqn_live_in(eqn, ains, lout, memo)
        costs[i][1] = _eqn_bwd(eqn, ains, lout, memo)
        live_eqns[i] = ains
        for v, l in zip(eqn.invars, lin):
            if l and _var(v):
                live.add(v)
                uses[v] = uses.get(v, 0) + 1
                first_reader[v] = i
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}    # for outputs no one reads
    extra = 0.0
    for v, k in uses.items():
        if k > 1:
            owner = first_reader.get(v, producer.get(v))
            if owner is None:
                extra += (k - 1) * _size(v)
            else:
                costs[owner][1] += (k - 1) * _size(v)
    live_in = tuple(_var(v) and v in live for v in jaxpr.invars)
    return Counts(tuple((float(f), float(b)) for f, b in costs), float(extra), live_in, tuple(live_eqns))


# ------------------------------------------------------------------ one equation

def _sub(eqn):
    """The body of a call-like equation (its inputs are the equation's), or None."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        value = eqn.params.get(key)
        if isinstance(value, (C.ClosedJaxpr, C.Jaxpr)):
            sub, _ = C.open_jaxpr(value)
            return sub if len(sub.invars) == len(eqn.invars) else None
    return None


def _jaxprs_in(eqn) -> list:
    """Every jaxpr among an equation's parameters (an unknown primitive's bodies: each counted once)."""
    found = []
    for value in eqn.params.values():
        for item in (value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(item, (C.ClosedJaxpr, C.Jaxpr)):
                found.append(item)
    return found


def _shards(eqn) -> int:
    """How many copies of a shard_map body run (the sizes of its manual mesh axes); 1 otherwise."""
    if eqn.primitive.name != "shard_map":
        return 1
    mesh = eqn.params["mesh"]
    sizes = dict(mesh.shape)
    axes = eqn.params.get("newly_manual_axes", eqn.params.get("manual_axes"))
    if axes is None:
        axes = set(sizes) - set(eqn.params.get("auto", ()))
    return int(math.prod(sizes[a] for a in axes))


def _eqn_active(eqn, ains: tuple, memo: dict) -> tuple:
    name = eqn.primitive.name
    if name in _NONDIFF:
        return (False,) * len(eqn.outvars)
    if name == "scan":
        outs = _scan_flow(eqn, ains, None, memo)[2]
    elif name == "while":
        outs = _while_flow(eqn, ains, None, memo)[2]
    elif name == "cond":
        outs = tuple(map(any, zip(*(_forward(C.open_jaxpr(b)[0], ains[1:], memo)[1] for b in eqn.params["branches"]))))
    elif _sub(eqn) is not None:
        outs = _forward(_sub(eqn), ains, memo)[1]
    else:
        outs = (any(ains),) * len(eqn.outvars)
    return tuple(bool(a) and _inexact(v) for a, v in zip(outs, eqn.outvars))


def _eqn_live_in(eqn, ains: tuple, lout: tuple, memo: dict) -> tuple:
    name = eqn.primitive.name
    if name == "scan":
        return _scan_flow(eqn, ains, lout, memo)[3]
    if name == "while":
        return _while_flow(eqn, ains, lout, memo)[3]
    if name == "cond":
        lins = [_counts(C.open_jaxpr(b)[0], ains[1:], lout, memo).live_in for b in eqn.params["branches"]]
        return (False,) + tuple(map(any, zip(*lins)))
    sub = _sub(eqn)
    if sub is not None:
        return _counts(sub, ains, lout, memo).live_in
    return ains


def _scan_flow(eqn, ains: tuple, lout: tuple | None, memo: dict):
    """(body, its differentiated inputs, the scan's differentiated outputs, the scan's live inputs,
    the body's seeds) at the fixpoint over the carry; the last two are None when `lout` is."""
    nc, nk = C.scan_counts(eqn)
    body, _ = C.open_jaxpr(eqn.params["jaxpr"])
    consts, carry, xs = ains[:nc], list(ains[nc:nc + nk]), ains[nc + nk:]
    while True:
        outs = _forward(body, tuple(consts) + tuple(carry) + tuple(xs), memo)[1]
        new = [a or b for a, b in zip(carry, outs[:nk])]
        if new == carry:
            break
        carry = new
    din = tuple(consts) + tuple(carry) + tuple(xs)
    if lout is None:
        return body, din, outs, None, None
    seed_carry, ys = list(lout[:nk]), tuple(lout[nk:])
    while True:
        lin = _counts(body, din, tuple(seed_carry) + ys, memo).live_in
        new = [a or b for a, b in zip(seed_carry, lin[nc:nc + nk])]
        if new == seed_carry:
            break
        seed_carry = new
    return body, din, outs, lin, tuple(seed_carry) + ys


def _while_flow(eqn, ains: tuple, lout: tuple | None, memo: dict):
    """As `_scan_flow` for a while loop (body inputs: its consts then the carry; outputs: the carry)."""
    cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    body, _ = C.open_jaxpr(eqn.params["body_jaxpr"])
    consts, carry = ains[cn:cn + bn], list(ains[cn + bn:])
    while True:
        outs = _forward(body, tuple(consts) + tuple(carry), memo)[1]
        new = [a or b for a, b in zip(carry, outs)]
        if new == carry:
            break
        carry = new
    din = tuple(consts) + tuple(carry)
    if lout is None:
        return body, din, outs, None, None
    seeds = list(lout)
    while True:
        lin = _counts(body, din, tuple(seeds), memo).live_in
        new = [a or b for a, b in zip(seeds, lin[bn:])]
        if new == seeds:
            break
        seeds = new
    return body, din, outs, (False,) * cn + tuple(lin), tuple(seeds)


def _eqn_fwd(eqn, memo: dict) -> float:
    name = eqn.primitive.name
    out = _size(eqn.outvars[0]) if eqn.outvars else 0.0
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        shape = eqn.invars[0].aval.shape
        return 2.0 * out * float(math.prod(int(shape[d]) for d in lc))
    if name == "conv_general_dilated":
        return _conv_flops(eqn)
    if name == "scan":
        return eqn.params["length"] * _fwd_total(C.open_jaxpr(eqn.params["jaxpr"])[0], memo)
    if name == "while":
        trips = _trip_count(eqn) or 1
        return trips * (_fwd_total(C.open_jaxpr(eqn.params["cond_jaxpr"])[0], memo)
                        + _fwd_total(C.open_jaxpr(eqn.params["body_jaxpr"])[0], memo))
    if name == "cond":
        return max(_fwd_total(C.open_jaxpr(b)[0], memo) for b in eqn.params["branches"])
    sub = _sub(eqn)
    if sub is not None:
        return _shards(eqn) * _fwd_total(sub, memo)
    subs = _jaxprs_in(eqn)
    if subs:
        return sum(_fwd_total(C.open_jaxpr(s)[0], memo) for s in subs)
    if name in _MOVE or name in _TRANSCENDENTAL or name in ("broadcast_in_dim", "gather"):
        return 0.0
    if name in _REDUCE:
        per = 9.0 if name in ("argmax", "argmin") else 1.0     # a variadic (value, index) comparison
        return per * max(0.0, _size(eqn.invars[0]) - out)
    if name in _CUMULATIVE:
        return out
    if name == "integer_pow":
        return out * _pow_muls(int(eqn.params["y"]))
    if name == "sort":
        length = eqn.invars[0].aval.shape[eqn.params["dimension"]] if eqn.invars[0].aval.shape else 1
        return out * math.ceil(math.log2(max(int(length), 1))) if length > 1 else 0.0
    if name in ("scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min",
                "scatter-max", "scatter_max"):
        return _size(eqn.invars[2]) if len(eqn.invars) > 2 else out
    if name == "random_bits":
        return out * _FWD[name] * max(1, int(eqn.params.get("bit_width", 32)) // 32)
    return out * _FWD.get(name, 1.0)


def _eqn_bwd(eqn, ains: tuple, lout: tuple, memo: dict) -> float:
    name = eqn.primitive.name
    out = _size(eqn.outvars[0]) if eqn.outvars else 0.0
    if name in ("dot_general", "conv_general_dilated"):
        return _eqn_fwd(eqn, memo) * sum(ains[:2])
    if name == "scan":
        body, din, _, lin, seeds = _scan_flow(eqn, ains, lout, memo)
        nc, _ = C.scan_counts(eqn)
        accumulate = sum(_size(v) for v, l in zip(eqn.invars[:nc], lin[:nc]) if l)   # ct of each const, per step
        return eqn.params["length"] * (_counts(body, din, seeds, memo).backward + accumulate)
    if name == "while":
        body, din, _, _, seeds = _while_flow(eqn, ains, lout, memo)
        return (_trip_count(eqn) or 1) * _counts(body, din, seeds, memo).backward
    if name == "cond":
        return max(_counts(C.open_jaxpr(b)[0], ains[1:], lout, memo).backward for b in eqn.params["branches"])
    sub = _sub(eqn)
    if sub is not None and name == "custom_jvp_call" and _is_relu(sub):
        return 2.0 * out                                    # its rule: select(x > 0, g, 0)
    if sub is not None:
        recompute = _recompute(sub, ains, lout, eqn.params.get("policy"), memo) if name in _REMAT else 0.0
        return _shards(eqn) * (_counts(sub, ains, lout, memo).backward + recompute)
    if _jaxprs_in(eqn):
        return 2.0 * _eqn_fwd(eqn, memo)
    if name in _MOVE or name in ("reduce_sum", "scatter-add", "scatter_add"):
        return 0.0
    if name == "broadcast_in_dim":
        return max(0.0, out - _size(eqn.invars[0]))         # the transpose sums over the new axes
    if name == "gather":
        return out if ains[0] else 0.0                      # scatter-add of the cotangent
    if name in _BWD_REDUCE:
        return _BWD_REDUCE[name] * _size(eqn.invars[0])
    if name in _CUMULATIVE:
        return _CUMULATIVE[name] * out
    if name == "sort":
        return out
    if name == "integer_pow":
        return out * (_pow_muls(int(eqn.params["y"]) - 1) + 2)
    if name in _BWD_UNARY:
        return out * _BWD_UNARY[name]
    if name == "div" and ains[1]:       # -g * x at the output's size, y ** -2 at y's
        return (out if ains[0] else 0.0) + 3 * out + 2 * _size(eqn.invars[1]) + max(0.0, out - _size(eqn.invars[1])) \
            + (max(0.0, out - _size(eqn.invars[0])) if ains[0] else 0.0)
    if name == "select_n":
        per = (0,) + (1,) * (len(ains) - 1)
    else:
        per = _BWD_OPERANDS.get(name, (1,) * len(ains))
    # an operand broadcast along size-1 dimensions gets its cotangent summed back to its shape
    return sum(out * c + max(0.0, out - _size(v)) for c, a, v in zip(per, ains, eqn.invars) if a)


def _is_relu(jaxpr) -> bool:
    """Whether a custom_jvp body is `max(x, 0)` (jax.nn.relu, maybe inside a jit)."""
    while len(jaxpr.eqns) == 1 and _sub(jaxpr.eqns[0]) is not None:
        jaxpr = _sub(jaxpr.eqns[0])
    if len(jaxpr.eqns) != 1 or jaxpr.eqns[0].primitive.name != "max":
        return False
    return any(not _var(v) and _literal(v) == 0 for v in jaxpr.eqns[0].invars)


def _fwd_total(jaxpr, memo: dict) -> float:
    return _memo(memo, ("fwd_total", id(jaxpr)), jaxpr, lambda: float(sum(_eqn_fwd(e, memo) for e in jaxpr.eqns)))


def _recompute(jaxpr, din: tuple, seeds: tuple, policy, memo: dict) -> float:
    """Forward FLOPs a checkpointed body runs again in its backward: the equations that make the
    values its backward reads (`_residuals`), and what they read in turn, except those the policy
    saves (a call or loop is run again whole)."""
    def make():
        counts = _counts(jaxpr, din, seeds, memo)
        needed: set = set()
        for eqn, ains in zip(jaxpr.eqns, counts.live_eqns):
            if ains is not None:
                needed.update(_residuals(eqn, ains))
        total = 0.0
        for eqn in reversed(jaxpr.eqns):
            if any(_var(v) and v in needed for v in eqn.outvars) and not C.saved_by_policy(policy, eqn):
                total += _eqn_fwd(eqn, memo)
                needed.update(v for v in eqn.invars if _var(v))
        return total
    return _memo(memo, ("recompute", id(jaxpr), din, seeds, id(policy)), (jaxpr, policy), make)


def _residuals(eqn, ains: tuple) -> list:
    """The forward values an equation's backward reads (its JVP rule's primal operands)."""
    name, ins, outs = eqn.primitive.name, eqn.invars, list(eqn.outvars)
    if name in ("dot_general", "conv_general_dilated"):
        return [ins[1 - k] for k in (0, 1) if ains[k] and _var(ins[1 - k])]
    if name == "mul":
        return [ins[1 - k] for k in (0, 1) if ains[k] and _var(ins[1 - k])]
    if name in _LINEAR or name == "broadcast_in_dim" or name in _MOVE:
        return [v for v in ins if _var(v) and not _inexact(v)]          # indices, predicates
    if name in _USES_OUTPUT:
        return outs + [v for v in ins if _var(v)]
    if _sub(eqn) is not None or _jaxprs_in(eqn):
        return outs + [v for v in ins if _var(v)]                       # a call runs again whole
    return [v for v in ins if _var(v)]


def _pow_muls(y: int) -> float:
    """Multiplications (and the division of a negative power) XLA counts for x ** y."""
    k = abs(y)
    muls = (k.bit_length() - 1) + bin(k).count("1") - 1 if k else 0
    return float(max(muls, 0) + (1 if y < 0 else 0))


def _conv_flops(eqn) -> float:
    """2 x multiply-adds of a convolution at valid kernel positions (XLA's HandleConvolution)."""
    p = eqn.params
    lhs, rhs, out = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape, eqn.outvars[0].aval.shape
    dn = p["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    valid = 1.0
    for k in range(len(lhs_spec) - 2):
        size_in, size_k, size_out = lhs[lhs_spec[k + 2]], rhs[rhs_spec[k + 2]], out[out_spec[k + 2]]
        stride, (lo, _) = p["window_strides"][k], p["padding"][k]
        base, window = p["lhs_dilation"][k], p["rhs_dilation"][k]
        o = np.arange(int(size_out))[:, None]
        kk = np.arange(int(size_k))[None, :]
        undilated = o * stride - lo + kk * window
        ok = (undilated % base == 0) & (undilated // base >= 0) & (undilated // base < size_in)
        valid *= float(ok.sum())
    fma = (lhs[lhs_spec[1]] / p["feature_group_count"]) * rhs[rhs_spec[0]] * (lhs[lhs_spec[0]] / p["batch_group_count"])
    return 2.0 * float(fma) * valid


def _trip_count(eqn) -> int | None:
    """The static trip count of a while loop `for i in range(start, bound, step)`-shaped: a carried
    counter from a literal, moved by a literal, compared with a literal (or a literal carried
    unchanged or passed as a cond constant); None for any other loop."""
    cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    cond, _ = C.open_jaxpr(eqn.params["cond_jaxpr"])
    body, _ = C.open_jaxpr(eqn.params["body_jaxpr"])
    init = eqn.invars[cn + bn:]
    if len(cond.eqns) != 1 or cond.eqns[0].primitive.name not in ("lt", "le", "gt", "ge"):
        return None
    cmp = cond.eqns[0]
    if cond.outvars[0] is not cmp.outvars[0]:
        return None
    flip = {"lt": "gt", "gt": "lt", "le": "ge", "ge": "le"}
    a, b, op = cmp.invars[0], cmp.invars[1], cmp.primitive.name
    if not (_var(a) and a in cond.invars[cn:]):
        a, b, op = b, a, flip[op]
    if not (_var(a) and a in cond.invars[cn:]):
        return None
    j = cond.invars.index(a) - cn
    start, bound, step = _literal(init[j]), _static(b, cond, cn, eqn, body, bn), _step(body, bn, j)
    if start is None or bound is None or not step:
        return None
    span = {"lt": bound - start, "le": bound - start + (1 if step > 0 else -1),
            "gt": bound - start, "ge": bound - start + (1 if step > 0 else -1)}[op]
    if (op in ("lt", "le")) != (step > 0):
        return None
    return max(0, math.ceil(span / step))


def _literal(v):
    return np.asarray(v.val).item() if isinstance(v, C.Literal) and np.ndim(v.val) == 0 else None


def _static(v, cond, cn: int, eqn, body, bn: int):
    """The value of a cond input known before the loop runs, or None."""
    if not _var(v):
        return _literal(v)
    k = cond.invars.index(v) if v in cond.invars else -1
    if k < 0:
        return None
    if k < cn:
        return _literal(eqn.invars[k])
    j = k - cn
    passed = body.outvars[j] is body.invars[bn + j]
    return _literal(eqn.invars[cn + bn + j]) if passed else None


def _step(body, bn: int, j: int):
    """The literal a loop's body adds to carry `j` (negative for a subtraction), or None."""
    out, carried = body.outvars[j], body.invars[bn + j]
    for e in body.eqns:
        if e.outvars[0] is out and e.primitive.name in ("add", "sub"):
            x, y = e.invars
            if x is carried and not _var(y):
                lit = _literal(y)
                return None if lit is None else (lit if e.primitive.name == "add" else -lit)
            if y is carried and not _var(x) and e.primitive.name == "add":
                return _literal(x)
    return None
