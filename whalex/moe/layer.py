"""`MoE`: a Flax Mixture-of-Experts feed-forward layer (Switch top-1 / GShard top-2).

Drop it in where a transformer block has its MLP. It routes each token to k experts under a
capacity, runs the experts, combines their outputs, and sows the load-balancing and router z-losses
into the `"moe_losses"` collection (apply with `mutable=["moe_losses"]` and add
`moe_losses(updates)` to the training loss). `expert_parallel=n` writes Whale's Example 5 inside the
layer: the experts run under `wh.split(n)`, gating and combine with the default strategy.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from whalex.moe.dispatch import ACTIVATIONS, combine, dispatch, experts
from whalex.moe.gating import capacity, top_k_gating
from whalex.primitives.scopes import split

COLLECTION = "moe_losses"

_expert_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
                                                batch_axis=(0,))


class MoE(nn.Module):
    """Mixture-of-Experts MLP on x [batch, ..., d] -> same shape.

    num_experts, hidden: expert count and each expert's hidden width.
    k: experts per token (1 = Switch, 2 = GShard).
    capacity_factor: slots per expert = ceil(k * group_size * factor / num_experts); None = dropless.
    group_size: tokens routed together (must divide the tokens per sequence); None = one sequence.
    expert_parallel: if set, the experts run under `wh.split(expert_parallel)` (expert parallelism).
    """

    num_experts: int
    hidden: int
    k: int = 1
    capacity_factor: float | None = 1.25
    group_size: int | None = None
    activation: str = "gelu"
    expert_parallel: int | None = None
    router_init: Callable = nn.initializers.lecun_normal()
    expert_init: Callable = _expert_init
    bias_init: Callable = nn.initializers.zeros
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        if x.ndim < 2:
            raise ValueError(f"MoE wants x [batch, ..., features], got shape {x.shape}.")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown MoE activation {self.activation!r}; use one of {sorted(ACTIVATIONS)}.")
        d, e, h = x.shape[-1], self.num_experts, self.hidden
        per_row = math.prod(x.shape[1:-1])
        gs = self.group_size or per_row
        if per_row % gs:
            raise ValueError(f"MoE group_size={gs} must divide the {per_row} tokens of each sequence (groups never "
                             f"span sequences); use a divisor of {per_row}.")
        xg = x.reshape(-1, gs, d)
        router = self.param("router", self.router_init, (d, e), self.param_dtype)
        w_in = self.param("w_in", self.expert_init, (e, d, h), self.param_dtype)
        b_in = self.param("b_in", self.bias_init, (e, h), self.param_dtype)
        w_out = self.param("w_out", self.expert_init, (e, h, d), self.param_dtype)
        b_out = self.param("b_out", self.bias_init, (e, d), self.param_dtype)
        cap = capacity(gs, e, self.k, self.capacity_factor)
        routing = top_k_gating(xg @ router, self.k, cap)
        buf = dispatch(xg, routing, e, cap)
        if self.expert_parallel:
            with split(self.expert_parallel):
                out = experts(buf, w_in, b_in, w_out, b_out, self.activation)
        else:
            out = experts(buf, w_in, b_in, w_out, b_out, self.activation)
        self.sow(COLLECTION, "aux_loss", routing.aux_loss)
        self.sow(COLLECTION, "z_loss", routing.z_loss)
        return combine(out, routing).reshape(x.shape)


def moe_losses(variables) -> dict[str, jax.Array]:
    """Sum of every MoE layer's sown `aux_loss` and `z_loss` in `variables` (or its "moe_losses")."""
    tree = variables.get(COLLECTION, variables) if hasattr(variables, "get") else variables
    totals = {"aux_loss": jnp.zeros((), jnp.float32), "z_loss": jnp.zeros((), jnp.float32)}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        keys = [getattr(p, "key", None) for p in path]
        for name in totals:
            if name in keys:
                totals[name] = totals[name] + leaf
    return totals
