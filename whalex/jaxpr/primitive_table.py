"""The one table of the JAX primitives whalex tells apart, by what they do: calls and the other
equations with sub-jaxprs, element-wise math, reductions and how their partial results combine,
operations that run along an axis, data movement, collectives, randomness, linear operations.

Every module that classifies equations by primitive name reads these classes (the loss contract
and the batch-dependence analysis, the sharding patterns, FLOP counting, the memory prediction).
What a class costs stays beside the code that prices it (`jaxpr/flop_rules.py`: FLOPs per element;
`memory/op_kinds.py`: what XLA fuses, duplicates or does in place), built from these classes.
Version-dependent names (the checkpoint primitive, the call primitives) come from `_compat`.
"""
from __future__ import annotations

from whalex import _compat as C


def _names(text: str) -> frozenset:
    return frozenset(text.split())


# ------------------------------------------------------------------- equations with sub-jaxprs
CALLS = frozenset(C.CALL_PRIMITIVES)               # plain calls (jit): no semantics of their own
CHECKPOINTS = frozenset(C.CHECKPOINT_PRIMITIVES)   # jax.checkpoint / nn.remat
CUSTOM_DERIVATIVES = frozenset(C.OPAQUE_CALL_PRIMITIVES) - CHECKPOINTS
# calls with a rule of their own around a sub-jaxpr that takes the equation's operands one to one
OPAQUE_CALLS = CUSTOM_DERIVATIVES | CHECKPOINTS
LOOPS = _names("scan while")
CONDITIONALS = _names("cond")

# ------------------------------------------------------------------- element-wise
ELEMENTWISE = _names("""
    add sub mul div neg max min abs sign select_n convert_element_type eq ne lt le gt ge and or not xor
    square integer_pow clamp copy copy_p floor ceil round rem nextafter is_finite shift_left
    shift_right_logical shift_right_arithmetic real imag conj stop_gradient pvary pcast reduce_precision
    add_any one_minus_square
    exp exp2 log log1p expm1 tanh logistic sqrt rsqrt cbrt pow erf erfc erf_inv sin cos tan atan2 asin
    acos atan sinh cosh asinh acosh atanh lgamma digamma""")

# ------------------------------------------------------------------- reductions
REDUCTIONS = _names("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin")
# how the results of a reduction over parts of its reduced dimension combine into the whole one
# (a dot product contracting the dimension sums)
COMBINE = {"reduce_sum": "sum", "dot_general": "sum", "reduce_max": "max", "reduce_min": "min",
           "reduce_or": "max", "reduce_and": "min"}

# ------------------------------------------------------------------- along an axis
# operations whose every output element reads a whole line of their operand along one axis
# (a scan or a sort): the primitive -> the parameter naming that axis
ALONG_AXIS = {"cumsum": "axis", "cumprod": "axis", "cummax": "axis", "cummin": "axis", "cumlogsumexp": "axis",
              "sort": "dimension"}
CUMULATIVE = frozenset(k for k in ALONG_AXIS if k.startswith("cum"))

# ------------------------------------------------------------------- data movement
# rearranging or generating elements without arithmetic
LAYOUT = _names("broadcast_in_dim reshape squeeze expand_dims iota slice dynamic_slice concatenate pad rev "
                "transpose stack unstack")
# outputs that are their first operand's elements rearranged, broadcast, recast or copied: a parameter
# read through them is still that parameter
PASS_THROUGH = _names("reshape transpose broadcast_in_dim squeeze expand_dims convert_element_type copy copy_p")
# writing into (a copy of) their first operand
UPDATES = _names("scatter scatter-add scatter_add scatter-mul scatter-min scatter-max dynamic_update_slice")
COLLECTIVES = _names("psum pmax pmin ppermute all_gather all_to_all psum_scatter reduce_scatter pbroadcast "
                     "psum_invariant")
# where a value lives, not what it is
PLACEMENT = _names("device_put sharding_constraint mesh_cast reshard pcast pvary")

# ------------------------------------------------------------------- randomness
RANDOM = _names("random_bits random_seed random_split random_fold_in random_wrap random_unwrap threefry2x32 "
                "rng_bit_generator rng_uniform")

# ------------------------------------------------------------------- linear
# linear in their floating operands (indices aside): a derivative that reads no forward value
LINEAR = _names("""add add_any sub neg convert_element_type reduce_sum cumsum reduce_precision real imag conj
    select_n gather scatter-add scatter_add broadcast_in_dim reshape squeeze expand_dims transpose slice
    concatenate copy copy_p pad dynamic_slice""")
