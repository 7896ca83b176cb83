"""What XLA does with each kind of JAX primitive, as far as buffers go: the kinds the memory
prediction (whalex/memory/peak.py) and its sharding propagation (shard_specs.py) tell apart, built
from the classes of `whalex.jaxpr.primitive_table`."""
from __future__ import annotations

from whalex.jaxpr import primitive_table as P

# element-wise ops XLA's CPU compiler fuses into one consumer but does not duplicate (transcendental)
EXPENSIVE = frozenset("""exp exp2 log log1p expm1 tanh logistic sqrt rsqrt cbrt pow div erf erfc erf_inv sin cos
    tan atan2 asin acos atan sinh cosh asinh acosh atanh lgamma digamma""".split())
# element-wise ops XLA fuses into their consumers and recomputes there (cheap to duplicate)
CHEAP = P.ELEMENTWISE - EXPENSIVE
# platforms whose XLA duplicates those too: its GPU fusion weighs recomputing element-wise math
# against a round trip through memory, and recomputes
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
# layout ops XLA fuses (a loop fusion reads through them)
LAYOUT = P.LAYOUT
# ops XLA does as a bitcast or by choosing its operand's layout: the output is a view of the operand
VIEW = frozenset("reshape squeeze expand_dims name optimization_barrier".split())
REDUCE = P.REDUCTIONS
FUSIBLE = CHEAP | EXPENSIVE | LAYOUT
# ops that write their result into their first operand's buffer when that operand dies there
UPDATES = P.UPDATES
# equations whose sub-jaxprs run as part of them: calls, checkpoints, custom derivatives, control flow
# (`while` apart); CALLS run one body once on the operands: inlined, as XLA does
CALLS = P.CALLS | P.OPAQUE_CALLS
BODIES = CALLS | P.CONDITIONALS | {"scan"}
# ops whose results' dimensions do not line up with their operands' (sharding does not carry over)
OPAQUE_DIMS = REDUCE | {"dot_general", "gather", "dynamic_slice"} | set(P.ALONG_AXIS) | BODIES
HOST_KINDS = ("pinned_host", "unpinned_host")      # memory kinds that are not device memory
