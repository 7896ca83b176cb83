"""Operations whalex knows how to shard beyond what sharding annotations can express.

`softmax_cross_entropy_head(x, kernel, bias, labels)` is Whale's classification head (Figure 3):
a dense layer to many classes followed by softmax cross-entropy. Outside whalex, and in even
plans, it is exactly `optax.softmax_cross_entropy_with_integer_labels(x @ kernel + bias, labels)
.mean()`. Under `wh.split` on a heterogeneous cluster, whalex gives each device a number of
classes proportional to its speed (uneven shards, Whale section 3.3.1) and runs it with
per-device work proportional to its real shard.
"""
from __future__ import annotations

import jax
import optax

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
