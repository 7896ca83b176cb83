"""A T5-style encoder-decoder, following Hugging Face transformers' FlaxT5ForConditionalGeneration:
RMS layer norms without bias, bucketed relative position biases (bidirectional in the encoder,
causal in the decoder, computed in the first layer of each stack and shared by the rest), encoder
self-attention, decoder causal self-attention and cross-attention with the padding masks broadcast
as the Hugging Face code does, a ReLU feed-forward, shared input embeddings tied to the output
(scaled by d_model ** -0.5), decoder inputs the labels shifted right."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from support.public_models import annotate


class Config:
    vocab = 40
    hidden = 32
    heads = 4
    ff = 64
    layers = 1
    buckets = 8
    max_distance = 16
    dropout = 0.0


def relative_position_bucket(relative_position, bidirectional, num_buckets, max_distance):
    """T5's bucket of each relative position (memory minus query): exact for small distances,
    logarithmic up to max_distance; static (NumPy), as it depends on the lengths only."""
    buckets = 0
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0) * num_buckets
        relative_position = np.abs(relative_position)
    else:
        relative_position = -np.clip(relative_position, None, 0)
    max_exact = num_buckets // 2
    large = max_exact + (np.log(np.maximum(relative_position, 1) / max_exact)
                         / np.log(max_distance / max_exact) * (num_buckets - max_exact))
    large = np.clip(large, None, num_buckets - 1)
    return (buckets + np.where(relative_position < max_exact, relative_position, large)).astype(np.int32)


class Attention(nn.Module):
    cfg: type = Config
    causal: bool = False
    has_relative_bias: bool = False

    @nn.compact
    def __call__(self, x, kv, mask, position_bias=None):
        cfg = self.cfg
        head_dim = cfg.hidden // cfg.heads
        q = nn.DenseGeneral((cfg.heads, head_dim), use_bias=False, name="q")(x)
        k = nn.DenseGeneral((cfg.heads, head_dim), use_bias=False, name="k")(kv)
        v = nn.DenseGeneral((cfg.heads, head_dim), use_bias=False, name="v")(kv)
        if position_bias is None and self.has_relative_bias:
            q_len, k_len = x.shape[1], kv.shape[1]
            rel = np.arange(k_len)[None, :] - np.arange(q_len)[:, None]
            bucket = relative_position_bucket(rel, not self.causal, cfg.buckets, cfg.max_distance)
            table = nn.Embed(cfg.buckets, cfg.heads, name="relative_attention_bias")(jnp.asarray(bucket))
            position_bias = jnp.transpose(table, (2, 0, 1))[None]                # [1, heads, q, k]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        bias = jax.lax.select(mask > 0, jnp.zeros(mask.shape, x.dtype), jnp.full(mask.shape, -1e10, x.dtype))
        if position_bias is not None:
            bias = bias + position_bias
        weights = jax.nn.softmax(scores + bias, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        return nn.DenseGeneral(cfg.hidden, axis=(-2, -1), use_bias=False, name="o")(out), position_bias


class FeedForward(nn.Module):
    cfg: type = Config

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(self.cfg.ff, use_bias=False, name="wi")(x))
        h = _dropout(self.cfg)(h)
        return nn.Dense(self.cfg.hidden, use_bias=False, name="wo")(h)


def _dropout(cfg):
    return nn.Dropout(cfg.dropout, deterministic=cfg.dropout == 0.0)


def _norm(name):
    return nn.RMSNorm(epsilon=1e-6, name=name)


class EncoderLayer(nn.Module):
    cfg: type = Config
    first: bool = False
    where: object = annotate.none

    @nn.compact
    def __call__(self, x, mask, position_bias):
        with self.where("layer"):
            with self.where("attention"):
                h = _norm("ln_0")(x)
                y, position_bias = Attention(self.cfg, False, self.first, name="self_attention")(
                    h, h, mask, position_bias)
            x = x + y
            with self.where("mlp"):
                x = x + FeedForward(self.cfg, name="ff")(_norm("ln_1")(x))
        return x, position_bias


class DecoderLayer(nn.Module):
    cfg: type = Config
    first: bool = False
    where: object = annotate.none

    @nn.compact
    def __call__(self, x, encoded, self_mask, cross_mask, position_bias):
        with self.where("layer"):
            with self.where("attention"):
                h = _norm("ln_0")(x)
                y, position_bias = Attention(self.cfg, True, self.first, name="self_attention")(
                    h, h, self_mask, position_bias)
                x = x + y
                y, _ = Attention(self.cfg, name="cross_attention")(_norm("ln_1")(x), encoded, cross_mask)
            x = x + y
            with self.where("mlp"):
                x = x + FeedForward(self.cfg, name="ff")(_norm("ln_2")(x))
        return x, position_bias


class T5ForConditionalGeneration(nn.Module):
    cfg: type = Config
    where: object = annotate.none

    @nn.compact
    def __call__(self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask):
        cfg = self.cfg
        shared = nn.Embed(cfg.vocab, cfg.hidden, name="shared")
        batch_size, tgt = decoder_input_ids.shape
        x = _dropout(cfg)(shared(input_ids))
        mask = jnp.expand_dims(attention_mask, axis=(-3, -2))                   # [batch, 1, 1, src]
        bias = None
        for i in range(cfg.layers):
            x, bias = EncoderLayer(cfg, i == 0, self.where, name=f"encoder_{i}")(x, mask, bias)
        encoded = _norm("encoder_norm")(x)
        causal = nn.make_causal_mask(jnp.ones((batch_size, tgt), dtype="i4"))
        causal = jnp.broadcast_to(causal, (batch_size,) + causal.shape[1:])
        self_mask = nn.combine_masks(
            jnp.broadcast_to(jnp.expand_dims(decoder_attention_mask, axis=(-3, -2)), causal.shape), causal)
        y = _dropout(cfg)(shared(decoder_input_ids))
        bias = None
        for i in range(cfg.layers):
            y, bias = DecoderLayer(cfg, i == 0, self.where, name=f"decoder_{i}")(y, encoded, self_mask, mask, bias)
        y = _norm("decoder_norm")(y) * cfg.hidden ** -0.5
        with self.where("head"):
            return shared.attend(y)


def shift_right(labels, start=0):
    """Decoder inputs: the labels moved one position right behind the start token."""
    return jnp.concatenate([jnp.full(labels[:, :1].shape, start, labels.dtype), labels[:, :-1]], axis=1)


def problem(batch=16, src=8, tgt=6, seed=0, where=annotate.none, dropout=0.0):
    """(loss_fn, params, batch): cross-entropy over the real target tokens (padding masked out, a
    token-weighted mean; one row's target is all padding), padded source sequences; `where` places
    the annotations (public_models.annotate). With `dropout`, T5's dropout on the embeddings and the
    feed-forward activations, and `loss_fn(params, batch, rng)`."""
    cfg = type("Config", (Config,), {"dropout": dropout})
    model = T5ForConditionalGeneration(cfg, where)
    rng = np.random.default_rng(seed)
    src_len = rng.integers(src // 2, src + 1, (batch, 1))
    tgt_len = rng.integers(1, tgt + 1, (batch, 1))
    src_mask = (np.arange(src)[None] < src_len).astype(np.int32)
    tgt_len[1] = 0                                                           # a row of padding only
    tgt_mask = (np.arange(tgt)[None] < tgt_len).astype(np.int32)
    labels = rng.integers(1, Config.vocab, (batch, tgt)) * tgt_mask
    data = {"input_ids": jnp.asarray(rng.integers(1, Config.vocab, (batch, src)) * src_mask, jnp.int32),
            "attention_mask": jnp.asarray(src_mask), "labels": jnp.asarray(labels, jnp.int32),
            "decoder_attention_mask": jnp.asarray(tgt_mask)}
    inputs = lambda b: (b["input_ids"], b["attention_mask"], shift_right(b["labels"]),  # noqa: E731
                        b["decoder_attention_mask"])
    params = jax.jit(lambda key: model.init(key, *inputs(data)))(jax.random.key(seed))["params"]

    def token_mean(logits, b):
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), b["labels"][..., None], axis=-1)[..., 0]
        w = b["decoder_attention_mask"].astype(nll.dtype)
        return (nll * w).sum() / w.sum()

    if dropout:
        def loss_fn(p, b, rng):
            return token_mean(model.apply({"params": p}, *inputs(b), rngs={"dropout": rng}), b)
    else:
        def loss_fn(p, b):
            return token_mean(model.apply({"params": p}, *inputs(b)), b)
    return loss_fn, params, data
