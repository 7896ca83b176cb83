"""A Llama-style decoder, following Hugging Face transformers' FlaxLlama: RMSNorm, rotary position
embeddings, grouped-query attention with the causal mask broadcast to `(batch_size,) + shape[1:]`
and combined with the padding mask as Hugging Face's Flax Llama does, a SwiGLU MLP, untied output
projection."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from support.public_models import annotate


class Config:
    vocab = 48
    hidden = 32
    heads = 4
    kv_heads = 2
    mlp = 64
    layers = 2
    max_len = 16


def rotary(x, positions):
    """Rotary embedding of x [batch, seq, heads, dim] at `positions` [batch, seq]."""
    dim = x.shape[-1]
    freqs = 1.0 / (10000 ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    angles = positions[..., None].astype(jnp.float32) * freqs                # [batch, seq, dim/2]
    sin, cos = jnp.sin(angles)[:, :, None], jnp.cos(angles)[:, :, None]
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nn.Module):
    cfg: type = Config

    @nn.compact
    def __call__(self, x, attention_mask, positions):
        cfg = self.cfg
        batch_size, seq = x.shape[:2]
        head_dim = cfg.hidden // cfg.heads
        q = nn.DenseGeneral((cfg.heads, head_dim), use_bias=False, name="q_proj")(x)
        k = nn.DenseGeneral((cfg.kv_heads, head_dim), use_bias=False, name="k_proj")(x)
        v = nn.DenseGeneral((cfg.kv_heads, head_dim), use_bias=False, name="v_proj")(x)
        q, k = rotary(q, positions), rotary(k, positions)
        k = jnp.repeat(k, cfg.heads // cfg.kv_heads, axis=2)
        v = jnp.repeat(v, cfg.heads // cfg.kv_heads, axis=2)
        causal_mask = nn.make_causal_mask(jnp.ones((1, cfg.max_len), dtype="bool"), dtype="bool")[:, :, :seq, :seq]
        causal_mask = jnp.broadcast_to(causal_mask, (batch_size,) + causal_mask.shape[1:])
        attention_mask = jnp.broadcast_to(jnp.expand_dims(attention_mask, axis=(-3, -2)), causal_mask.shape)
        attention_mask = nn.combine_masks(attention_mask, causal_mask)
        bias = jax.lax.select(attention_mask > 0, jnp.full(attention_mask.shape, 0.0, x.dtype),
                              jnp.full(attention_mask.shape, jnp.finfo(x.dtype).min, x.dtype))
        out = nn.dot_product_attention_weights(q, k, bias=bias)
        out = jnp.einsum("...hqk,...khd->...qhd", out, v)
        return nn.DenseGeneral(cfg.hidden, axis=(-2, -1), use_bias=False, name="o_proj")(out)


class MLP(nn.Module):
    cfg: type = Config

    @nn.compact
    def __call__(self, x):
        gate = nn.Dense(self.cfg.mlp, use_bias=False, name="gate_proj")(x)
        up = nn.Dense(self.cfg.mlp, use_bias=False, name="up_proj")(x)
        return nn.Dense(self.cfg.hidden, use_bias=False, name="down_proj")(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    cfg: type = Config
    where: object = annotate.none

    @nn.compact
    def __call__(self, x, attention_mask, positions):
        with self.where("layer"):
            with self.where("attention"):
                x = x + Attention(self.cfg)(nn.RMSNorm(name="input_layernorm")(x), attention_mask, positions)
            with self.where("mlp"):
                return x + MLP(self.cfg)(nn.RMSNorm(name="post_attention_layernorm")(x))


class LlamaForCausalLM(nn.Module):
    cfg: type = Config
    where: object = annotate.none

    @nn.compact
    def __call__(self, input_ids, attention_mask):
        positions = jnp.cumsum(attention_mask, axis=-1) - 1
        x = nn.Embed(self.cfg.vocab, self.cfg.hidden, name="embed_tokens")(input_ids)
        for i in range(self.cfg.layers):
            x = DecoderLayer(self.cfg, self.where, name=f"layers_{i}")(x, attention_mask, positions)
        x = nn.RMSNorm(name="norm")(x)
        with self.where("head"):
            return nn.Dense(self.cfg.vocab, use_bias=False, name="lm_head")(x)


def problem(batch=16, seq=8, seed=0, where=annotate.none):
    """(loss_fn, params, batch): next-token cross-entropy, a token-weighted mean over real tokens;
    `where` places the annotations (public_models.annotate)."""
    model = LlamaForCausalLM(where=where)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, Config.vocab, (batch, seq + 1)).astype(np.int32)
    lengths = rng.integers(seq // 2, seq + 1, (batch, 1))
    mask = (np.arange(seq)[None] < lengths).astype(np.int32)
    data = {"input_ids": jnp.asarray(ids[:, :-1]), "attention_mask": jnp.asarray(mask),
            "labels": jnp.asarray(ids[:, 1:])}
    params = model.init(jax.random.key(seed), data["input_ids"], data["attention_mask"])["params"]

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["input_ids"], b["attention_mask"])
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(logp, b["labels"][..., None], axis=-1)[..., 0]
        w = b["attention_mask"].astype(nll.dtype)
        return (nll * w).sum() / w.sum()
    return loss_fn, params, data
