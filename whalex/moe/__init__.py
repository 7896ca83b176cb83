"""Mixture-of-Experts: gating, dispatch/combine, the Flax layer, and expert parallelism."""
from whalex.moe.dispatch import combine, dispatch, experts, feed_forward
from whalex.moe.gating import Routing, capacity, top_k_gating
from whalex.moe.layer import MoE, moe_losses

__all__ = ["MoE", "Routing", "capacity", "combine", "dispatch", "experts", "feed_forward", "moe_losses",
           "top_k_gating"]
