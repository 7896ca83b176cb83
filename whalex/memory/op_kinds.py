"""What XLA does with each kind of JAX primitive, as far as buffers go: the kinds the memory
prediction (whalex/memory/peak.py) and its sharding propagation (shard_specs.py) tell apart."""
from __future__ import annotations

from whalex import _compat as C

# element-wise ops XLA fuses into their consumers and recomputes there (cheap to duplicate)
CHEAP = frozenset("""add sub mul neg max min abs sign select_n convert_element_type eq ne lt le gt ge and or not
    xor square integer_pow clamp copy copy_p floor ceil round rem nextafter is_finite shift_left
    shift_right_logical shift_right_arithmetic real imag conj stop_gradient pvary pcast reduce_precision add_any
    one_minus_square""".split())
# element-wise ops XLA's CPU compiler fuses into one consumer but does not duplicate (transcendental)
EXPENSIVE = frozenset("""exp exp2 log log1p expm1 tanh logistic sqrt rsqrt cbrt pow div erf erfc erf_inv sin cos
    tan atan2 asin acos atan sinh cosh asinh acosh atanh lgamma digamma""".split())
# platforms whose XLA duplicates those too: its GPU fusion weighs recomputing element-wise math
# against a round trip through memory, and recomputes
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
# layout ops XLA fuses (a loop fusion reads through them)
LAYOUT = frozenset("""broadcast_in_dim reshape squeeze expand_dims iota slice dynamic_slice concatenate pad rev
    transpose stack unstack""".split())
# ops XLA does as a bitcast or by choosing its operand's layout: the output is a view of the operand
VIEW = frozenset("reshape squeeze expand_dims name optimization_barrier".split())
REDUCE = frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin".split())
FUSIBLE = CHEAP | EXPENSIVE | LAYOUT
# ops that write their result into their first operand's buffer when that operand dies there
UPDATES = frozenset("scatter scatter-add scatter_add scatter-mul scatter-min scatter-max dynamic_update_slice".split())
# equations whose sub-jaxprs run as part of them: calls, checkpoints, custom derivatives, control flow
BODIES = frozenset(C.CALL_PRIMITIVES) | frozenset("""custom_jvp_call custom_vjp_call custom_vjp_call_jaxpr checkpoint
    remat2 cond scan""".split())
CALLS = BODIES - {"cond", "scan"}       # one body run once on the operands: inlined, as XLA does
# ops whose results' dimensions do not line up with their operands' (sharding does not carry over)
OPAQUE_DIMS = REDUCE | {"dot_general", "gather", "dynamic_slice", "cumsum", "cumprod", "cummax", "sort"} | BODIES
HOST_KINDS = ("pinned_host", "unpinned_host")      # memory kinds that are not device memory
