"""The Llama-style decoder of llama.py written in Flax NNX, following Hugging Face transformers'
FlaxLlama: RMSNorm, rotary embeddings, grouped-query attention with the causal mask broadcast to
`(batch_size,) + shape[1:]` and combined with the padding mask, a SwiGLU MLP, an untied head."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from support.public_models import annotate
from support.public_models.llama import Config, rotary


class Attention(nnx.Module):
    def __init__(self, cfg, rngs):
        self.cfg, d = cfg, cfg.hidden // cfg.heads
        self.q_proj = nnx.LinearGeneral(cfg.hidden, (cfg.heads, d), use_bias=False, rngs=rngs)
        self.k_proj = nnx.LinearGeneral(cfg.hidden, (cfg.kv_heads, d), use_bias=False, rngs=rngs)
        self.v_proj = nnx.LinearGeneral(cfg.hidden, (cfg.kv_heads, d), use_bias=False, rngs=rngs)
        self.o_proj = nnx.LinearGeneral((cfg.heads, d), cfg.hidden, axis=(-2, -1), use_bias=False, rngs=rngs)

    def __call__(self, x, attention_mask, positions):
        cfg = self.cfg
        batch_size, seq = x.shape[:2]
        q, k = rotary(self.q_proj(x), positions), rotary(self.k_proj(x), positions)
        k = jnp.repeat(k, cfg.heads // cfg.kv_heads, axis=2)
        v = jnp.repeat(self.v_proj(x), cfg.heads // cfg.kv_heads, axis=2)
        causal_mask = nnx.make_causal_mask(jnp.ones((1, cfg.max_len), dtype="bool"), dtype="bool")[:, :, :seq, :seq]
        causal_mask = jnp.broadcast_to(causal_mask, (batch_size,) + causal_mask.shape[1:])
        attention_mask = jnp.broadcast_to(jnp.expand_dims(attention_mask, axis=(-3, -2)), causal_mask.shape)
        attention_mask = nnx.combine_masks(attention_mask, causal_mask)
        bias = jax.lax.select(attention_mask > 0, jnp.full(attention_mask.shape, 0.0, x.dtype),
                              jnp.full(attention_mask.shape, jnp.finfo(x.dtype).min, x.dtype))
        weights = jax.nn.softmax(jnp.einsum("...qhd,...khd->...hqk", q / np.sqrt(q.shape[-1]), k) + bias, axis=-1)
        return self.o_proj(jnp.einsum("...hqk,...khd->...qhd", weights, v))


class MLP(nnx.Module):
    def __init__(self, cfg, rngs):
        self.gate_proj = nnx.Linear(cfg.hidden, cfg.mlp, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(cfg.hidden, cfg.mlp, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(cfg.mlp, cfg.hidden, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg, where, rngs):
        self.where = where
        self.input_layernorm = nnx.RMSNorm(cfg.hidden, rngs=rngs)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = nnx.RMSNorm(cfg.hidden, rngs=rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, attention_mask, positions):
        with self.where("layer"):
            with self.where("attention"):
                x = x + self.self_attn(self.input_layernorm(x), attention_mask, positions)
            with self.where("mlp"):
                return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nnx.Module):
    def __init__(self, rngs, where=annotate.none, cfg=Config):
        self.where = where
        self.embed_tokens = nnx.Embed(cfg.vocab, cfg.hidden, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, where, rngs) for _ in range(cfg.layers)])
        self.norm = nnx.RMSNorm(cfg.hidden, rngs=rngs)
        self.lm_head = nnx.Linear(cfg.hidden, cfg.vocab, use_bias=False, rngs=rngs)

    def __call__(self, input_ids, attention_mask):
        positions = jnp.cumsum(attention_mask, axis=-1) - 1
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, attention_mask, positions)
        x = self.norm(x)
        with self.where("head"):
            return self.lm_head(x)


def problem(batch=16, seq=8, seed=0, where=annotate.none):
    """(make_model, loss_fn, batch): `make_model()` a fresh module in train mode, `loss_fn(model,
    batch)` next-token cross-entropy, a token-weighted mean over the real tokens."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, Config.vocab, (batch, seq + 1)).astype(np.int32)
    lengths = rng.integers(seq // 2, seq + 1, (batch, 1))
    mask = (np.arange(seq)[None] < lengths).astype(np.int32)
    data = {"input_ids": jnp.asarray(ids[:, :-1]), "attention_mask": jnp.asarray(mask),
            "labels": jnp.asarray(ids[:, 1:])}

    def make_model():
        model = LlamaForCausalLM(nnx.Rngs(seed), where)
        model.train()
        return model

    def loss_fn(model, b):
        logp = jax.nn.log_softmax(model(b["input_ids"], b["attention_mask"]))
        nll = -jnp.take_along_axis(logp, b["labels"][..., None], axis=-1)[..., 0]
        w = b["attention_mask"].astype(nll.dtype)
        return (nll * w).sum() / w.sum()
    return make_model, loss_fn, data
