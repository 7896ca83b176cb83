"""The per-primitive tables and shape formulas behind `whalex.jaxpr.flops`: which primitives cost
nothing, what XLA charges for the few it expands, JAX's backward costs per element, a convolution's
valid multiply-adds, a power's multiplications, and the static trip count of a while loop. The
classes of primitives (reductions, checkpoints, randomness, ...) come from `whalex.jaxpr.primitive_table`;
the costs are this module's."""
from __future__ import annotations

import math

import numpy as np

from whalex import _compat as C
from whalex.jaxpr import primitive_table as P

# Forward: 0 FLOPs (data movement, collectives, bookkeeping; their transposes are data movement too).
MOVE = (P.LAYOUT - {"broadcast_in_dim", "stack", "unstack"}) | P.COLLECTIVES | P.PLACEMENT | frozenset({
    "dynamic_update_slice", "scatter", "copy", "copy_p", "axis_index", "bitcast_convert_type", "stop_gradient",
    "optimization_barrier", "name", "random_wrap", "random_unwrap", "top_k", "split", "empty", "broadcast"})
# Forward: 0 FLOPs (XLA counts transcendental functions apart from FLOPs).
TRANSCENDENTAL = frozenset({
    "exp", "log", "tanh", "sin", "cos", "tan", "sqrt", "rsqrt", "cbrt", "pow", "atan2", "expm1", "log1p",
    "erf", "atan", "asin", "acos", "sinh", "cosh", "atanh", "acosh", "lgamma", "digamma", "igamma",
    "igammac", "polygamma", "zeta", "bessel_i0e", "bessel_i1e", "random_gamma_grad",
    "regularized_incomplete_beta"})
# Forward FLOPs per output element where not 1 (XLA expands these into arithmetic).
FWD = {"logistic": 3.0, "erfc": 62.0, "erf_inv": 37.0, "asinh": 11.0, "nextafter": 24.0,
        "random_bits": 29.0, "threefry2x32": 14.5, "random_split": 28.0, "random_fold_in": 37.0}
# Backward FLOPs per output element, per differentiated operand (JVP + transpose rules).
BWD_UNARY = {
    "neg": 1, "exp": 1, "log": 1, "tanh": 4, "logistic": 3, "sqrt": 2, "rsqrt": 3, "cbrt": 4, "erf": 24,
    "erfc": 24, "erf_inv": 3, "sin": 1, "cos": 2, "tan": 3, "atan": 3, "asinh": 10, "expm1": 1, "log1p": 2,
    "exp2": 2, "abs": 5, "square": 2, "convert_element_type": 1, "reduce_precision": 1, "real": 1,
    "imag": 1, "conj": 1}
BWD_OPERANDS = {
    "add": (0, 0), "add_any": (0, 0), "sub": (0, 1), "mul": (1, 1), "div": (1, 5), "max": (5, 5),
    "min": (5, 5), "pow": (3, 4), "atan2": (5, 6), "rem": (0, 8), "clamp": (2, 4, 2)}
REDUCE = P.REDUCTIONS
BWD_REDUCE = {"reduce_max": 4, "reduce_min": 4, "reduce_prod": 4}      # per input element
# Backward FLOPs per element of each of P.CUMULATIVE.
CUMULATIVE = {"cumsum": 1, "cumprod": 3, "cummax": 3, "cummin": 3, "cumlogsumexp": 3}
# Outputs never differentiated (zero derivative, or not numbers).
NONDIFF = P.RANDOM | frozenset({
    "sign", "floor", "ceil", "round", "nextafter", "is_finite", "argmax", "argmin", "iota", "stop_gradient",
    "population_count", "clz", "axis_index"})
REMAT = P.CHECKPOINTS
# Linear in their differentiated operands: the backward reads no forward value (but indices).
LINEAR = P.LINEAR
# Their backward reads their output (exp's cotangent is g * exp(x)).
USES_OUTPUT = frozenset({"exp", "exp2", "tanh", "logistic", "sqrt", "rsqrt", "cbrt", "expm1", "reduce_max",
                          "reduce_min", "max", "min", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort"})


def _var(v) -> bool:
    return not isinstance(v, C.Literal)


def pow_muls(y: int) -> float:
    """Multiplications (and the division of a negative power) XLA counts for x ** y."""
    k = abs(y)
    muls = (k.bit_length() - 1) + bin(k).count("1") - 1 if k else 0
    return float(max(muls, 0) + (1 if y < 0 else 0))


def conv_flops(eqn) -> float:
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


def trip_count(eqn) -> int | None:
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
    start, bound, step = literal(init[j]), _static(b, cond, cn, eqn, body, bn), _step(body, bn, j)
    if start is None or bound is None or not step:
        return None
    span = {"lt": bound - start, "le": bound - start + (1 if step > 0 else -1),
            "gt": bound - start, "ge": bound - start + (1 if step > 0 else -1)}[op]
    if (op in ("lt", "le")) != (step > 0):
        return None
    return max(0, math.ceil(span / step))


def literal(v):
    return np.asarray(v.val).item() if isinstance(v, C.Literal) and np.ndim(v.val) == 0 else None


def _static(v, cond, cn: int, eqn, body, bn: int):
    """The value of a cond input known before the loop runs, or None."""
    if not _var(v):
        return literal(v)
    k = cond.invars.index(v) if v in cond.invars else -1
    if k < 0:
        return None
    if k < cn:
        return literal(eqn.invars[k])
    j = k - cn
    passed = body.outvars[j] is body.invars[bn + j]
    return literal(eqn.invars[cn + bn + j]) if passed else None


def _step(body, bn: int, j: int):
    """The literal a loop's body adds to carry `j` (negative for a subtraction), or None."""
    out, carried = body.outvars[j], body.invars[bn + j]
    for e in body.eqns:
        if e.outvars[0] is out and e.primitive.name in ("add", "sub"):
            x, y = e.invars
            if x is carried and not _var(y):
                lit = literal(y)
                return None if lit is None else (lit if e.primitive.name == "add" else -lit)
            if y is carried and not _var(x) and e.primitive.name == "add":
                return literal(x)
    return None
