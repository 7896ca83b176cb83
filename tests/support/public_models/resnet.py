"""A ResNet, following the ResNet of Flax's ImageNet example: a stem convolution, residual blocks of
two 3x3 convolutions with BatchNorm (a strided projection shortcut where the shape changes), global
average pooling, a dense classifier. BatchNorm in training mode takes statistics over the batch:
model state."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


class ResNetBlock(nn.Module):
    filters: int
    strides: tuple = (1, 1)

    @nn.compact
    def __call__(self, x):
        norm = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9)
        y = nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)
        y = nn.relu(norm()(y))
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
        y = norm(scale_init=nn.initializers.ones)(y)
        if x.shape != y.shape:
            x = norm(name="norm_proj")(nn.Conv(self.filters, (1, 1), self.strides, use_bias=False,
                                               name="conv_proj")(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    classes: int = 10
    widths: tuple = (8, 16)

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.widths[0], (3, 3), use_bias=False, name="conv_init")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, name="bn_init")(x))
        for i, w in enumerate(self.widths):
            x = ResNetBlock(w, (2, 2) if i else (1, 1))(x)
        return nn.Dense(self.classes)(jnp.mean(x, axis=(1, 2)))


def problem(batch=16, size=8, seed=0):
    """(loss_fn, params, model_state, batch): cross-entropy mean; loss_fn takes model_state= and
    returns (loss, new_model_state)."""
    model = ResNet()
    rng = np.random.default_rng(seed)
    data = {"image": jnp.asarray(rng.standard_normal((batch, size, size, 3)), jnp.float32),
            "label": jnp.asarray(rng.integers(0, 10, (batch,)), jnp.int32)}
    variables = model.init(jax.random.key(seed), data["image"])

    def loss_fn(p, b, model_state):
        logits, new = model.apply({"params": p, **model_state}, b["image"], mutable=["batch_stats"])
        loss = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b["label"][:, None], axis=-1))
        return loss, new
    return loss_fn, variables["params"], {"batch_stats": variables["batch_stats"]}, data
