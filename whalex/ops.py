"""Operations whalex knows how to shard beyond what sharding annotations can express.

`attention(x, wq, bq, wk, bk, wv, bv, wo, bo, causal)` is multi-head self-attention with
DenseGeneral-shaped kernels (flax's `MultiHeadDotProductAttention` parameters fit it as they are);
on a heterogeneous model axis each device gets a number of heads proportional to its speed.
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

from whalex.records.call_names import EXPERT_ACTIVATIONS, HEAD_NAME, attention_call_name, mlp_call_name


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


@functools.cache
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


def attention_project(x, wq, bq, wk, bk, wv, bv):
    """q, k, v of a block of heads: x [..., length, d] -> [..., length, heads, head_dim] each."""
    return tuple(jnp.einsum("...d,dhk->...hk", x, w) + b for w, b in ((wq, bq), (wk, bk), (wv, bv)))


def attention_scores(q, k, causal: bool):
    """Scaled (and causally masked) scores [..., heads, length, length]."""
    s = jnp.einsum("...qhk,...shk->...hqs", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
    if causal:
        length = q.shape[-3]
        s = jnp.where(jnp.tril(jnp.ones((length, length), bool)), s, jnp.finfo(s.dtype).min)
    return s


def attention_mix(s, v):
    """Softmax of the scores applied to v: [..., length, heads, head_dim]."""
    return jnp.einsum("...hqs,...shk->...qhk", jax.nn.softmax(s, axis=-1), v)


def attention_out(o, wo):
    return jnp.einsum("...qhk,hko->...qo", o, wo)


def attention_heads(x, wq, bq, wk, bk, wv, bv, wo, causal: bool):
    """The heads' part of `attention` (without the output bias): also the per-block function of
    the uneven lowering, for any block of heads (which runs it in the four steps above, keeping
    each step's inputs for the backward pass)."""
    q, k, v = attention_project(x, wq, bq, wk, bk, wv, bv)
    return attention_out(attention_mix(attention_scores(q, k, causal), v), wo)


@functools.cache
def _named_attention(causal: bool):
    def fn(x, wq, bq, wk, bk, wv, bv, wo, bo):
        return attention_heads(x, wq, bq, wk, bk, wv, bv, wo, causal) + bo

    fn.__name__ = attention_call_name(causal)
    return jax.jit(fn)


def attention(x, wq, bq, wk, bk, wv, bv, wo, bo, causal: bool = False):
    """Multi-head self-attention: x [..., length, d]; wq, wk, wv [d, heads, head_dim]; bq, bk, bv
    [heads, head_dim]; wo [heads, head_dim, d_out]; bo [d_out]. Scores scaled by 1/sqrt(head_dim),
    a causal mask when `causal`."""
    return _named_attention(bool(causal))(x, wq, bq, wk, bk, wv, bv, wo, bo)
