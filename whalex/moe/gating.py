"""Top-k gating with expert capacity (Switch top-1, GShard top-2), as pure functions.

Tokens are routed in groups (GShard): a group of `group_size` consecutive tokens of one sequence
shares each expert's `capacity` slots. Groups never span sequences, so routing is the same whatever
the batch layout: a data-parallel shard holds whole groups, and expert parallelism changes where an
expert runs, never which tokens it gets.

The rule, per group: every token picks its top-k experts by router probability. Slots are filled
choice-major (all first choices in token order, then all second choices in token order); a choice
whose expert is already full is dropped and contributes nothing. Top-1 gates are the router
probability (Switch); top-k gates are the chosen probabilities renormalised to sum to 1 (GShard).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
    """Routing of tokens [groups, group_size] to k experts each."""

    expert: jax.Array    # [G, T, k] int32: chosen expert
    position: jax.Array  # [G, T, k] int32: slot in that expert's buffer
    keep: jax.Array      # [G, T, k] bool: position < capacity (not dropped)
    gate: jax.Array      # [G, T, k] float32: combine weight (0 where dropped)
    aux_loss: jax.Array  # []: load-balancing loss (Switch eq. 4), mean over groups
    z_loss: jax.Array    # []: router z-loss (ST-MoE), mean over tokens


def capacity(group_size: int, num_experts: int, k: int, capacity_factor: float | None) -> int:
    """Slots per expert and group: ceil(k * group_size * factor / experts); None = dropless."""
    if capacity_factor is None:
        return group_size
    return max(1, min(group_size, math.ceil(k * group_size * capacity_factor / num_experts)))


def _top_k(probs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` as k argmax passes (lowest index wins ties): XLA's SPMD partitioner keeps these
    sharded over the batch, while it gathers the whole tensor for a TopK (an all-gather every step,
    bench/moe_dispatch.py)."""
    gates, experts, p = [], [], probs
    for _ in range(k):
        idx = jnp.argmax(p, axis=-1)
        gates.append(jnp.take_along_axis(probs, idx[..., None], axis=-1)[..., 0])
        experts.append(idx)
        p = jnp.where(jax.nn.one_hot(idx, p.shape[-1], dtype=bool), -jnp.inf, p)
    return jnp.stack(gates, -1), jnp.stack(experts, -1)


def top_k_gating(logits: jax.Array, k: int, capacity: int) -> Routing:
    """Route each group's tokens (logits [G, T, E]) to their top-k experts under `capacity`."""
    if logits.ndim != 3:
        raise ValueError(f"top_k_gating wants logits [groups, tokens, experts], got shape {logits.shape}.")
    g, t, e = logits.shape
    if not 1 <= k <= e:
        raise ValueError(f"k={k} must be between 1 and the number of experts ({e}).")
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    gate, expert = _top_k(probs, k)                              # [G, T, k]
    if k > 1:
        gate = gate / jnp.sum(gate, axis=-1, keepdims=True)
    onehot = jax.nn.one_hot(expert, e, dtype=jnp.int32)          # [G, T, k, E]
    order = onehot.transpose(0, 2, 1, 3).reshape(g, k * t, e)    # choice-major priority
    filled = jnp.cumsum(order, axis=1) - 1
    position = jnp.sum(filled * order, axis=-1).reshape(g, k, t).transpose(0, 2, 1)
    keep = position < capacity
    gate = jnp.where(keep, gate, 0.0)
    # Switch load-balancing loss: experts * sum_e (fraction of first choices to e) * (mean prob of e).
    fraction = jnp.mean(onehot[:, :, 0, :].astype(jnp.float32), axis=1)
    mean_prob = jnp.mean(probs, axis=1)
    aux = jnp.mean(e * jnp.sum(fraction * mean_prob, axis=-1))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return Routing(expert.astype(jnp.int32), position.astype(jnp.int32), keep, gate, aux, z)
