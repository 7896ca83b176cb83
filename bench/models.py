"""Models the benches share: what users write (stock Flax layers, no whalex annotation)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


class MLP(nn.Module):
    """`depth` x (nn.Dense(width) + ReLU), then an nn.Dense(classes) head; biases as Flax makes them."""

    width: int
    depth: int
    classes: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(self.classes)(x)


def mlp_regression(width: int, depth: int, out: int, rows: int):
    """The MLP benches' regression setup: (model, params, batch) with `rows` standard-normal inputs and
    0.5-scaled targets, the same draws (seed 0) wherever it is used."""
    model = MLP(width, depth, out)
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((rows, width)).astype(np.float32),
             "y": (0.5 * rng.standard_normal((rows, out))).astype(np.float32)}
    params = jax.device_get(model.init(jax.random.key(0), batch["x"][:1])["params"])
    return model, params, batch


class Block(nn.Module):
    """A pre-LN GPT block of stock layers: LayerNorm, causal MultiHeadDotProductAttention, GELU MLP."""

    heads: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        y = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(y, y, mask=mask)
        y = nn.LayerNorm()(x)
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(4 * x.shape[-1])(y)))


class GPT(nn.Module):
    """`layers` Blocks between nn.Embed (+ a learned position table) and an untied nn.Dense head;
    `remat_block`: each block under `nn.remat` (with the `jax.checkpoint_policies` name `remat_policy`,
    if given), as a user writes remat by hand."""

    vocab: int
    d: int
    heads: int
    layers: int
    remat_block: bool = False
    remat_policy: str | None = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.d)).astype(x.dtype)
        policy = getattr(jax.checkpoint_policies, self.remat_policy) if self.remat_policy else None
        block = nn.remat(Block, policy=policy) if self.remat_block else Block
        for _ in range(self.layers):
            x = block(self.heads)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))
