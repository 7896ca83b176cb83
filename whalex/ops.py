"""Operations whalex knows how to shard beyond what sharding annotations can express.

`mlp(x, w1, b1, w2, b2, activation)` is the Megatron MLP, `activation(x @ w1 + b1) @ w2 + b2`.
In even plans `split` shards it like the same layers written with `nn.Dense` (column, then row);
on a heterogeneous model axis each device gets a share of the hidden units proportional to its
speed (Whale section 3.3.1), with per-device work proportional to its real share.

`softmax_cross_entropy_head(x, kernel, bias, labels)` is Whale's classification head (Figure 3):
a dense layer to many classes followed by softmax cross-entropy. Outside whalex, and in even
plans, it is exactly `optax.softmax_cross_entropy_with_integer_labels(x @ kernel + bias, labels)
.mean()`. Under `wh.split` on a heterogeneous cluster, whalex gives each device a number of
classes proportional to its speed (uneven shards, Whale section 3.3.1) and runs it with
per-device work proportional to its real shard.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from whalex.core.names import EXPERT_ACTIVATIONS, mlp_call_name

HEAD_NAME = "whalex_softmax_cross_entropy_head"


def _head(x, kernel, bias, labels):
    logits = x @ kernel + bias
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


_head.__name__ = HEAD_NAME
_jitted_head = jax.jit(_head)


def softmax_cross_entropy_head(x, kernel, bias, labels):
    """Mean softmax cross-entropy of `x @ kernel + bias` against integer `labels`.

    x: [batch, features], kernel: [features, classes], bias: [classes], labels: [batch] int.
    """
    return _jitted_head(x, kernel, bias, labels)


ACTIVATIONS = {"relu": jax.nn.relu, "gelu": jax.nn.gelu, "silu": jax.nn.silu, "tanh": jnp.tanh}
assert tuple(ACTIVATIONS) == EXPERT_ACTIVATIONS       # the names the planner recognises


@functools.lru_cache(maxsize=None)
def _named_mlp(activation: str):
    act = ACTIVATIONS[activation]

    def fn(x, w1, b1, w2, b2):
        return act(x @ w1 + b1) @ w2 + b2

    fn.__name__ = mlp_call_name(activation)
    return jax.jit(fn)


def mlp(x, w1, b1, w2, b2, activation: str = "gelu"):
    """`activation(x @ w1 + b1) @ w2 + b2`: x [..., d], w1 [d, hidden], b1 [hidden], w2 [hidden, d_out],
    b2 [d_out]; activation one of relu, gelu, silu, tanh."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown mlp activation {activation!r}; use one of {sorted(ACTIVATIONS)}.")
    return _named_mlp(activation)(x, w1, b1, w2, b2)
