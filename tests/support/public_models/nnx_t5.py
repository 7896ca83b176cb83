"""The T5-style encoder-decoder of t5.py written in Flax NNX, following Hugging Face transformers'
FlaxT5ForConditionalGeneration: RMS norms, bucketed relative position biases (computed in each
stack's first layer and shared by the rest), encoder self-attention, decoder causal self-attention
and cross-attention with the padding masks broadcast to `(batch_size,) + shape[1:]`, a ReLU
feed-forward, shared embeddings tied to the output (`nnx.Embed.attend`), a token-weighted loss on
padded targets (one target row all padding)."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from support.public_models import annotate
from support.public_models.t5 import Config, relative_position_bucket, shift_right


class Attention(nnx.Module):
    def __init__(self, cfg, causal, has_relative_bias, rngs):
        self.cfg, self.causal, d = cfg, causal, cfg.hidden // cfg.heads
        self.q = nnx.LinearGeneral(cfg.hidden, (cfg.heads, d), use_bias=False, rngs=rngs)
        self.k = nnx.LinearGeneral(cfg.hidden, (cfg.heads, d), use_bias=False, rngs=rngs)
        self.v = nnx.LinearGeneral(cfg.hidden, (cfg.heads, d), use_bias=False, rngs=rngs)
        self.o = nnx.LinearGeneral((cfg.heads, d), cfg.hidden, axis=(-2, -1), use_bias=False, rngs=rngs)
        self.relative_attention_bias = nnx.Embed(cfg.buckets, cfg.heads, rngs=rngs) if has_relative_bias else None

    def __call__(self, x, kv, mask, position_bias=None):
        cfg = self.cfg
        q, k, v = self.q(x), self.k(kv), self.v(kv)
        if position_bias is None and self.relative_attention_bias is not None:
            rel = np.arange(kv.shape[1])[None, :] - np.arange(x.shape[1])[:, None]
            bucket = relative_position_bucket(rel, not self.causal, cfg.buckets, cfg.max_distance)
            position_bias = jnp.transpose(self.relative_attention_bias(jnp.asarray(bucket)), (2, 0, 1))[None]
        bias = jax.lax.select(mask > 0, jnp.zeros(mask.shape, x.dtype), jnp.full(mask.shape, -1e10, x.dtype))
        if position_bias is not None:
            bias = bias + position_bias
        weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias, axis=-1)
        return self.o(jnp.einsum("bhqk,bkhd->bqhd", weights, v)), position_bias


class FeedForward(nnx.Module):
    def __init__(self, cfg, rngs):
        self.wi = nnx.Linear(cfg.hidden, cfg.ff, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(cfg.ff, cfg.hidden, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.wo(nnx.relu(self.wi(x)))


def _norm(cfg, rngs):
    return nnx.RMSNorm(cfg.hidden, epsilon=1e-6, rngs=rngs)


class EncoderLayer(nnx.Module):
    def __init__(self, cfg, first, where, rngs):
        self.where = where
        self.ln_0, self.ln_1 = _norm(cfg, rngs), _norm(cfg, rngs)
        self.self_attention = Attention(cfg, False, first, rngs)
        self.ff = FeedForward(cfg, rngs)

    def __call__(self, x, mask, position_bias):
        with self.where("layer"):
            with self.where("attention"):
                h = self.ln_0(x)
                y, position_bias = self.self_attention(h, h, mask, position_bias)
            x = x + y
            with self.where("mlp"):
                x = x + self.ff(self.ln_1(x))
        return x, position_bias


class DecoderLayer(nnx.Module):
    def __init__(self, cfg, first, where, rngs):
        self.where = where
        self.ln_0, self.ln_1, self.ln_2 = _norm(cfg, rngs), _norm(cfg, rngs), _norm(cfg, rngs)
        self.self_attention = Attention(cfg, True, first, rngs)
        self.cross_attention = Attention(cfg, False, False, rngs)
        self.ff = FeedForward(cfg, rngs)

    def __call__(self, x, encoded, self_mask, cross_mask, position_bias):
        with self.where("layer"):
            with self.where("attention"):
                h = self.ln_0(x)
                y, position_bias = self.self_attention(h, h, self_mask, position_bias)
                x = x + y
                y, _ = self.cross_attention(self.ln_1(x), encoded, cross_mask)
            x = x + y
            with self.where("mlp"):
                x = x + self.ff(self.ln_2(x))
        return x, position_bias


class T5ForConditionalGeneration(nnx.Module):
    def __init__(self, rngs, where=annotate.none, cfg=Config):
        self.cfg, self.where = cfg, where
        self.shared = nnx.Embed(cfg.vocab, cfg.hidden, rngs=rngs)
        self.encoder = nnx.List([EncoderLayer(cfg, i == 0, where, rngs) for i in range(cfg.layers)])
        self.encoder_norm = _norm(cfg, rngs)
        self.decoder = nnx.List([DecoderLayer(cfg, i == 0, where, rngs) for i in range(cfg.layers)])
        self.decoder_norm = _norm(cfg, rngs)

    def __call__(self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask):
        batch_size, tgt = decoder_input_ids.shape
        x, mask, bias = self.shared(input_ids), jnp.expand_dims(attention_mask, axis=(-3, -2)), None
        for layer in self.encoder:
            x, bias = layer(x, mask, bias)
        encoded = self.encoder_norm(x)
        causal = nnx.make_causal_mask(jnp.ones((batch_size, tgt), dtype="i4"))
        causal = jnp.broadcast_to(causal, (batch_size,) + causal.shape[1:])
        self_mask = nnx.combine_masks(
            jnp.broadcast_to(jnp.expand_dims(decoder_attention_mask, axis=(-3, -2)), causal.shape), causal)
        y, bias = self.shared(decoder_input_ids), None
        for layer in self.decoder:
            y, bias = layer(y, encoded, self_mask, mask, bias)
        y = self.decoder_norm(y) * self.cfg.hidden ** -0.5
        with self.where("head"):
            return self.shared.attend(y)


def problem(batch=16, src=8, tgt=6, seed=0, where=annotate.none):
    """(make_model, loss_fn, batch): t5.py's data (padded sources, padded targets, one target row of
    padding only), cross-entropy over the real target tokens."""
    rng = np.random.default_rng(seed)
    src_mask = (np.arange(src)[None] < rng.integers(src // 2, src + 1, (batch, 1))).astype(np.int32)
    tgt_len = rng.integers(1, tgt + 1, (batch, 1))
    tgt_len[1] = 0
    tgt_mask = (np.arange(tgt)[None] < tgt_len).astype(np.int32)
    labels = rng.integers(1, Config.vocab, (batch, tgt)) * tgt_mask
    data = {"input_ids": jnp.asarray(rng.integers(1, Config.vocab, (batch, src)) * src_mask, jnp.int32),
            "attention_mask": jnp.asarray(src_mask), "labels": jnp.asarray(labels, jnp.int32),
            "decoder_attention_mask": jnp.asarray(tgt_mask)}

    def make_model():
        return T5ForConditionalGeneration(nnx.Rngs(seed), where)

    def loss_fn(model, b):
        logits = model(b["input_ids"], b["attention_mask"], shift_right(b["labels"]), b["decoder_attention_mask"])
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), b["labels"][..., None], axis=-1)[..., 0]
        w = b["decoder_attention_mask"].astype(nll.dtype)
        return (nll * w).sum() / w.sum()
    return make_model, loss_fn, data
