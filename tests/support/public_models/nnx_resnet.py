"""The ResNet of resnet.py written in Flax NNX, following the ResNet of Flax's ImageNet example
(stem convolution, residual blocks of two 3x3 convolutions with BatchNorm, a strided 1x1 projection
shortcut where the shape changes, global average pooling, a dense classifier). BatchNorm in train
mode takes statistics over the batch: `nnx.BatchStat` model state."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from support.public_models import annotate


class ResNetBlock(nnx.Module):
    def __init__(self, cin, cout, strides, rngs):
        self.conv1 = nnx.Conv(cin, cout, (3, 3), strides, use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(cout, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(cout, cout, (3, 3), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(cout, momentum=0.9, rngs=rngs)
        self.project = cin != cout or strides != (1, 1)
        if self.project:
            self.conv_proj = nnx.Conv(cin, cout, (1, 1), strides, use_bias=False, rngs=rngs)
            self.bn_proj = nnx.BatchNorm(cout, momentum=0.9, rngs=rngs)

    def __call__(self, x):
        y = nnx.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        if self.project:
            x = self.bn_proj(self.conv_proj(x))
        return nnx.relu(x + y)


class ResNet(nnx.Module):
    def __init__(self, rngs, where=annotate.none, classes=16, widths=(8, 16)):
        self.where = where
        self.conv_init = nnx.Conv(3, widths[0], (3, 3), use_bias=False, rngs=rngs)
        self.bn_init = nnx.BatchNorm(widths[0], momentum=0.9, rngs=rngs)
        ins = (widths[0],) + widths[:-1]
        self.blocks = nnx.List([ResNetBlock(i, o, (2, 2) if k else (1, 1), rngs)
                               for k, (i, o) in enumerate(zip(ins, widths))])
        self.head = nnx.Linear(widths[-1], classes, rngs=rngs)

    def __call__(self, x):
        with self.where("layer"):
            x = nnx.relu(self.bn_init(self.conv_init(x)))
            for block in self.blocks:
                x = block(x)
            x = jnp.mean(x, axis=(1, 2))
        with self.where("head"):
            return self.head(x)


def problem(batch=16, size=8, seed=0, where=annotate.none):
    """(make_model, loss_fn, batch): softmax cross-entropy, a mean over the images."""
    rng = np.random.default_rng(seed)
    data = {"image": jnp.asarray(rng.standard_normal((batch, size, size, 3)), jnp.float32),
            "label": jnp.asarray(rng.integers(0, 16, (batch,)), jnp.int32)}

    def make_model():
        model = ResNet(nnx.Rngs(seed), where)
        model.train()
        return model

    def loss_fn(model, b):
        logp = jax.nn.log_softmax(model(b["image"]))
        return -jnp.mean(jnp.take_along_axis(logp, b["label"][:, None], axis=-1))
    return make_model, loss_fn, data
