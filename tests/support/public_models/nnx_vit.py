"""The ViT classifier of vit.py written in Flax NNX, following google-research/vision_transformer's
ViT: a strided convolution embeds patches, a class token tiled over the batch
(`jnp.tile(cls, [n, 1, 1])`) and prepended, learned position embeddings, pre-norm encoder blocks
(nnx.MultiHeadAttention, a GELU MLP), the class token's representation classified."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from support.public_models import annotate


class Config:
    classes = 10
    patch = 4
    hidden = 32
    heads = 4
    mlp = 64
    layers = 2
    size = 8


class EncoderBlock(nnx.Module):
    def __init__(self, cfg, where, rngs):
        self.where = where
        self.norm1 = nnx.LayerNorm(cfg.hidden, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(num_heads=cfg.heads, in_features=cfg.hidden, decode=False,
                                                rngs=rngs)
        self.norm2 = nnx.LayerNorm(cfg.hidden, rngs=rngs)
        self.mlp_in = nnx.Linear(cfg.hidden, cfg.mlp, rngs=rngs)
        self.mlp_out = nnx.Linear(cfg.mlp, cfg.hidden, rngs=rngs)

    def __call__(self, x):
        with self.where("layer"):
            with self.where("attention"):
                y = self.norm1(x)
                x = x + self.attention(y, y)
            with self.where("mlp"):
                return x + self.mlp_out(nnx.gelu(self.mlp_in(self.norm2(x))))


class VisionTransformer(nnx.Module):
    def __init__(self, rngs, where=annotate.none, cfg=Config):
        self.where = where
        c, tokens = cfg.hidden, (cfg.size // cfg.patch) ** 2 + 1
        self.embedding = nnx.Conv(3, c, (cfg.patch, cfg.patch), strides=(cfg.patch, cfg.patch), padding="VALID",
                                  rngs=rngs)
        self.cls = nnx.Param(jnp.zeros((1, 1, c)))
        self.pos_embedding = nnx.Param(0.02 * jax.random.normal(rngs.params(), (1, tokens, c)))
        self.blocks = nnx.List([EncoderBlock(cfg, where, rngs) for _ in range(cfg.layers)])
        self.encoder_norm = nnx.LayerNorm(c, rngs=rngs)
        self.head = nnx.Linear(c, cfg.classes, rngs=rngs)

    def __call__(self, images):
        x = self.embedding(images)
        n, h, w, c = x.shape
        x = jnp.reshape(x, [n, h * w, c])
        cls = jnp.tile(self.cls[...], [n, 1, 1])
        x = jnp.concatenate([cls, x], axis=1) + self.pos_embedding[...]
        for block in self.blocks:
            x = block(x)
        x = self.encoder_norm(x)
        with self.where("head"):
            return self.head(x[:, 0])


def problem(batch=16, seed=0, where=annotate.none):
    """(make_model, loss_fn, batch): `make_model()` a fresh module, `loss_fn(model, batch)` softmax
    cross-entropy, a mean over the images."""
    rng = np.random.default_rng(seed)
    data = {"image": jnp.asarray(rng.standard_normal((batch, Config.size, Config.size, 3)), jnp.float32),
            "label": jnp.asarray(rng.integers(0, Config.classes, (batch,)), jnp.int32)}

    def make_model():
        """Parameters nudged off their zero initialisation, as vit.py's: the attention key bias has
        a zero gradient (softmax ignores a per-query constant), so a zero bias would be compared as
        float noise against float noise."""
        model = VisionTransformer(nnx.Rngs(seed), where)
        params = nnx.state(model, nnx.Param)
        leaves, tree = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
        nnx.update(model, jax.tree.unflatten(tree, [a + 0.05 * jax.random.normal(k, a.shape)
                                                    for a, k in zip(leaves, keys)]))
        return model

    def loss_fn(model, b):
        logits = model(b["image"])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b["label"][:, None], axis=-1))
    return make_model, loss_fn, data
