"""Models the benches share: what users write (stock Flax layers, no whalex annotation)."""
import flax.linen as nn
import jax
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
