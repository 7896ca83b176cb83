"""Dispatch tokens to expert buffers, run the experts, combine their outputs.

`experts` is a named call (`whalex_moe_experts`): outside whalex, and wherever experts are not
split, it is a batched feed-forward over [groups, experts, capacity, d]. Under `wh.split`, whalex
replaces it with expert parallelism (`whalex.moe.parallel`): experts sharded over devices, the
buffer exchanged with all-to-all before and after. Gating, dispatch and combine are plain
operations that run data parallel with the rest of the model (Whale's Example 5).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from whalex.moe.gating import Routing
from whalex.records.call_names import EXPERT_ACTIVATIONS, call_name

ACTIVATIONS = {"relu": jax.nn.relu, "gelu": jax.nn.gelu, "silu": jax.nn.silu, "tanh": jnp.tanh}
assert tuple(ACTIVATIONS) == EXPERT_ACTIVATIONS       # the names the sharding patterns recognise


def _slots(routing: Routing, num_experts: int, capacity: int) -> jax.Array:
    """[G, T, k] row of each choice in the flattened [E * C] buffer; dropped ones -> the extra row E * C."""
    return jnp.where(routing.keep, routing.expert * capacity + routing.position, num_experts * capacity)


def dispatch(x: jax.Array, routing: Routing, num_experts: int, capacity: int) -> jax.Array:
    """Tokens [G, T, d] into expert buffers [G, E, C, d] (empty and dropped slots stay zero)."""
    g, t, d = x.shape
    k = routing.expert.shape[-1]
    slot = _slots(routing, num_experts, capacity)

    def one(xs, sl):
        buf = jnp.zeros((num_experts * capacity + 1, d), x.dtype)
        return buf.at[sl.reshape(-1)].add(jnp.repeat(xs, k, axis=0))

    buf = jax.vmap(one)(x, slot)[:, :-1]
    return buf.reshape(g, num_experts, capacity, d)


def combine(out: jax.Array, routing: Routing) -> jax.Array:
    """Expert outputs [G, E, C, d] back to tokens [G, T, d], weighted by the gates."""
    g, e, c, d = out.shape
    flat = jnp.concatenate([out.reshape(g, e * c, d), jnp.zeros((g, 1, d), out.dtype)], axis=1)
    slot = _slots(routing, e, c)
    t, k = slot.shape[1:]
    picked = jnp.take_along_axis(flat, slot.reshape(g, t * k, 1), axis=1).reshape(g, t, k, d)
    return jnp.einsum("gtk,gtkd->gtd", routing.gate.astype(out.dtype), picked)


def feed_forward(buf, w_in, b_in, w_out, b_out, activation: str):
    """Every expert's two-layer MLP on its buffer: [G, E, C, d] -> [G, E, C, d]."""
    act = ACTIVATIONS[activation]
    h = act(jnp.einsum("gecd,edh->gech", buf, w_in) + b_in[None, :, None, :])
    return jnp.einsum("gech,ehd->gecd", h, w_out) + b_out[None, :, None, :]


@functools.cache
def _named(activation: str):
    def f(buf, w_in, b_in, w_out, b_out):
        return feed_forward(buf, w_in, b_in, w_out, b_out, activation)
    f.__name__ = call_name(activation)
    return jax.jit(f)


def experts(buf, w_in, b_in, w_out, b_out, activation: str = "gelu") -> jax.Array:
    """Expert feed-forward on dispatched buffers [G, E, C, d]; weights [E, d, h], [E, h], [E, h, d], [E, d]."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {activation!r}; use one of {sorted(ACTIVATIONS)}.")
    e = buf.shape[1]
    for name, w in (("w_in", w_in), ("b_in", b_in), ("w_out", w_out), ("b_out", b_out)):
        if w.shape[0] != e:
            raise ValueError(f"expert weight {name} has leading dim {w.shape[0]} but the buffer has {e} experts.")
    return _named(activation)(buf, w_in, b_in, w_out, b_out)
