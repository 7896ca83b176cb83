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
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from whalex import _compat as C
from whalex.jaxpr import flop_rules as R


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
    if name in R.NONDIFF:
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
        return R.conv_flops(eqn)
    if name == "scan":
        return eqn.params["length"] * _fwd_total(C.open_jaxpr(eqn.params["jaxpr"])[0], memo)
    if name == "while":
        trips = R.trip_count(eqn) or 1
        return trips * (_fwd_total(C.open_jaxpr(eqn.params["cond_jaxpr"])[0], memo)
                        + _fwd_total(C.open_jaxpr(eqn.params["body_jaxpr"])[0], memo))
    if name == "cond":
        return max(_fwd_total(C.open_jaxpr(b)[0], memo) for b in eqn.params["branches"])
    sub = _sub(eqn)
    if sub is not None:
        return _shards(eqn) * _fwd_total(sub, memo)
    subs = C.sub_jaxprs(eqn)
    if subs:
        return sum(_fwd_total(C.open_jaxpr(s)[0], memo) for s in subs)
    if name in R.MOVE or name in R.TRANSCENDENTAL or name in ("broadcast_in_dim", "gather"):
        return 0.0
    if name in R.REDUCE:
        per = 9.0 if name in ("argmax", "argmin") else 1.0     # a variadic (value, index) comparison
        return per * max(0.0, _size(eqn.invars[0]) - out)
    if name in R.CUMULATIVE:
        return out
    if name == "integer_pow":
        return out * R.pow_muls(int(eqn.params["y"]))
    if name == "sort":
        length = eqn.invars[0].aval.shape[eqn.params["dimension"]] if eqn.invars[0].aval.shape else 1
        return out * math.ceil(math.log2(max(int(length), 1))) if length > 1 else 0.0
    if name in ("scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min",
                "scatter-max", "scatter_max"):
        return _size(eqn.invars[2]) if len(eqn.invars) > 2 else out
    if name == "random_bits":
        return out * R.FWD[name] * max(1, int(eqn.params.get("bit_width", 32)) // 32)
    return out * R.FWD.get(name, 1.0)


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
        return (R.trip_count(eqn) or 1) * _counts(body, din, seeds, memo).backward
    if name == "cond":
        return max(_counts(C.open_jaxpr(b)[0], ains[1:], lout, memo).backward for b in eqn.params["branches"])
    sub = _sub(eqn)
    if sub is not None and name == "custom_jvp_call" and _is_relu(sub):
        return 2.0 * out                                    # its rule: select(x > 0, g, 0)
    if sub is not None:
        recompute = _recompute(sub, ains, lout, eqn.params.get("policy"), memo) if name in R.REMAT else 0.0
        return _shards(eqn) * (_counts(sub, ains, lout, memo).backward + recompute)
    if C.sub_jaxprs(eqn):
        return 2.0 * _eqn_fwd(eqn, memo)
    if name in R.MOVE or name in ("reduce_sum", "scatter-add", "scatter_add"):
        return 0.0
    if name == "broadcast_in_dim":
        return max(0.0, out - _size(eqn.invars[0]))         # the transpose sums over the new axes
    if name == "gather":
        return out if ains[0] else 0.0                      # scatter-add of the cotangent
    if name in R.BWD_REDUCE:
        return R.BWD_REDUCE[name] * _size(eqn.invars[0])
    if name in R.CUMULATIVE:
        return R.CUMULATIVE[name] * out
    if name == "sort":
        return out
    if name == "integer_pow":
        return out * (R.pow_muls(int(eqn.params["y"]) - 1) + 2)
    if name in R.BWD_UNARY:
        return out * R.BWD_UNARY[name]
    if name == "div" and ains[1]:       # -g * x at the output's size, y ** -2 at y's
        return (out if ains[0] else 0.0) + 3 * out + 2 * _size(eqn.invars[1]) + max(0.0, out - _size(eqn.invars[1])) \
            + (max(0.0, out - _size(eqn.invars[0])) if ains[0] else 0.0)
    if name == "select_n":
        per = (0,) + (1,) * (len(ains) - 1)
    else:
        per = R.BWD_OPERANDS.get(name, (1,) * len(ains))
    # an operand broadcast along size-1 dimensions gets its cotangent summed back to its shape
    return sum(out * c + max(0.0, out - _size(v)) for c, a, v in zip(per, ains, eqn.invars) if a)


def _is_relu(jaxpr) -> bool:
    """Whether a custom_jvp body is `max(x, 0)` (jax.nn.relu, maybe inside a jit)."""
    while len(jaxpr.eqns) == 1 and _sub(jaxpr.eqns[0]) is not None:
        jaxpr = _sub(jaxpr.eqns[0])
    if len(jaxpr.eqns) != 1 or jaxpr.eqns[0].primitive.name != "max":
        return False
    return any(not _var(v) and R.literal(v) == 0 for v in jaxpr.eqns[0].invars)


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
    if name in R.LINEAR or name == "broadcast_in_dim" or name in R.MOVE:
        return [v for v in ins if _var(v) and not _inexact(v)]          # indices, predicates
    if name in R.USES_OUTPUT:
        return outs + [v for v in ins if _var(v)]
    if _sub(eqn) is not None or C.sub_jaxprs(eqn):
        return outs + [v for v in ins if _var(v)]                       # a call runs again whole
    return [v for v in ins if _var(v)]


