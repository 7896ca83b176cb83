"""Models the benches share: what users write (stock Flax layers, no whalex annotation)."""
import flax.linen as nn


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
