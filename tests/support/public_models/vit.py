"""A ViT classifier, following google-research/vision_transformer's ViT: a strided convolution embeds
patches, a class token is tiled over the batch (`jnp.tile(cls, [n, 1, 1])`) and prepended, learned
position embeddings, pre-norm encoder blocks (multi-head self-attention, GELU MLP), the class
token's representation classified."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


class EncoderBlock(nn.Module):
    heads: int
    mlp: int

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(y, y)
        y = nn.LayerNorm()(x)
        y = nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(self.mlp)(y)))
        return x + y


class VisionTransformer(nn.Module):
    classes: int = 10
    patch: int = 4
    hidden: int = 32
    heads: int = 4
    mlp: int = 64
    layers: int = 2

    @nn.compact
    def __call__(self, images):
        x = nn.Conv(self.hidden, (self.patch, self.patch), strides=(self.patch, self.patch), padding="VALID",
                    name="embedding")(images)
        n, h, w, c = x.shape
        x = jnp.reshape(x, [n, h * w, c])
        cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
        cls = jnp.tile(cls, [n, 1, 1])
        x = jnp.concatenate([cls, x], axis=1)
        x = x + self.param("pos_embedding", nn.initializers.normal(0.02), (1, x.shape[1], c))
        for i in range(self.layers):
            x = EncoderBlock(self.heads, self.mlp, name=f"encoderblock_{i}")(x)
        x = nn.LayerNorm(name="encoder_norm")(x)
        return nn.Dense(self.classes, name="head")(x[:, 0])


def problem(batch=16, size=8, seed=0):
    """(loss_fn, params, batch): softmax cross-entropy, a mean over the images."""
    model = VisionTransformer()
    rng = np.random.default_rng(seed)
    data = {"image": jnp.asarray(rng.standard_normal((batch, size, size, 3)), jnp.float32),
            "label": jnp.asarray(rng.integers(0, 10, (batch,)), jnp.int32)}
    params = model.init(jax.random.key(seed), data["image"])["params"]
    params = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(seed + 1), a.shape), params)

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["image"])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b["label"][:, None], axis=-1))
    return loss_fn, params, data
