"""Sharding patterns (Whale section 3.2.2) and bridges (3.2.3): the planner's choice of a layout
for every value of the captured TaskGraphs.

Walking the captured equations in order (`walk`), each value carries an `Info`: for every
dimension the mesh axes it is split over (or None). Inside a `split` TaskGraph, ShardingUnits that
read a parameter are matched against patterns, and the pattern with the least communication
(`cost`, priced by `whalex.records.comm.ring_bytes`) wins:

- matmul SP1 (column): weight split on its output dim, input whole -> output split, no forward
  communication, input gradient all-reduced in the backward pass (`matmul`).
- matmul SP2 (row): weight split on its contraction dim, input split on the same dim -> partial
  sums all-reduced in the forward pass, input gradient stays local.
- embedding: table split on the hidden dim (no communication) or on the vocabulary (masked lookup,
  all-reduce) (`embedding`).
- MoE experts calls: expert parallel, all-to-all dispatch and combine (`experts`).
Softmax cross-entropy and argmax over a split class dimension follow from the reduction rule
(`elementwise`): local max/sum/argmax, then an all-reduce of the per-example result, never a
gather of the logits; reshapes, slices and concatenations keep splits whose blocks stay blocks
(`reshape`).

A value that crosses from one TaskGraph to another whose layout differs gets a bridge: a sharding
constraint that gathers it to the consumer's layout. When the layouts agree (same batch axes,
same split axes) the bridge is fused away. The result is data, a `ShardingPlan`
(`whalex.records.sharding_plan`): parameter and batch PartitionSpecs plus the constraints lowering
inserts; XLA's SPMD partitioner then emits the collectives, so the maths is that of the
unannotated model by construction.
"""
from whalex.planner.patterns.walk import plan_shardings

__all__ = ["plan_shardings"]
