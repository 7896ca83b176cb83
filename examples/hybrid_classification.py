#!/usr/bin/env python
"""Whale's Figure 3 / Example 2 in whalex: replicate the feature extractor, split the classifier.

A large-class image classifier is two very different halves. The convolutional backbone has few
parameters and most of the FLOPs, so it is data parallel: `wh.replicate(n)`, each device takes
1/n of the batch and the (small) backbone gradients are all-reduced. The classifier head is one
huge Dense layer (features x classes: 100K classes in the paper) with few FLOPs, so it is
tensor parallel: `wh.split(n)` shards the class dimension, and the softmax cross-entropy and the
argmax are computed on the sharded logits without ever gathering them; the head's gradients are
not all-reduced at all. In Whale (TensorFlow) this is:

    with wh.replicate(total_gpu):
        features = ResNet50(inputs)
    with wh.split(total_gpu):
        logits = FC(features)
        predictions = Softmax(logits)

Here the three annotation styles are used where they fit:
  * the backbone opens `with wh.replicate(n):` inside its `__call__` (context manager),
  * the classifier head class is decorated with `@wh.split(n)` (Flax module-class decorator),
  * the softmax cross-entropy and accuracy are a plain function decorated with `@wh.split(n)`
    (function decorator); it is a second split TaskGraph whose layout agrees with the head's, so
    the bridge between them is fused away.

The data set is synthetic and learnable: each class is a random mixture of a few smooth random
"texture" images, and every sample is its class's image plus noise. Class frequencies follow a
Zipf law (`--zipf 1`), as in real large-vocabulary data: with uniform labels a few hundred steps
show each of thousands of classes only a handful of times, too few to learn. The script prints
the entropy of the label distribution: the best loss a model that ignores the images can reach.

    python examples/hybrid_classification.py                    # 8192 classes, ~1-2 min on 2 CPU cores
    python examples/hybrid_classification.py --classes 100000   # the paper's 100K-class head
    python examples/hybrid_classification.py --check            # also trains on one device, compares
                                                                # the parameters, exits 1 if they differ

On CPU the script simulates `--devices` devices (XLA_FLAGS=--xla_force_host_platform_device_count)
unless XLA_FLAGS already sets a device count.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--classes", type=int, default=8192, help="number of classes (the paper uses 100000)")
    p.add_argument("--steps", type=int, default=300, help="training steps")
    p.add_argument("--batch", type=int, default=128, help="global batch size (a multiple of --devices)")
    p.add_argument("--image-size", type=int, default=16, help="height and width of the square RGB images")
    p.add_argument("--width", type=int, default=32, help="channels of the first backbone stage")
    p.add_argument("--devices", type=int, default=8,
                   help="devices for replicate(n) and split(n); simulated on CPU")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--noise", type=float, default=0.5, help="noise std relative to the class signal")
    p.add_argument("--zipf", type=float, default=1.0,
                   help="class frequency ~ 1 / rank**zipf; 0 gives uniform labels")
    p.add_argument("--check", action="store_true",
                   help="also train on one device and compare the parameters; exit 1 if they differ")
    p.add_argument("--check-steps", type=int, default=5, help="Adam steps of the --check comparison")
    p.add_argument("--check-tol", type=float, default=1e-4, help="largest accepted relative parameter error")
    p.add_argument("--perturb", action="store_true", help=argparse.SUPPRESS)   # tests: a deliberately wrong plan
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < (0 if args.check else 1):
        p.error("--steps must be at least 1 (0 only with --check: the comparison alone)")
    for name in ("classes", "batch", "image_size", "width", "devices"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.batch % args.devices:
        p.error(f"--batch {args.batch} must be a multiple of --devices {args.devices} "
                "(each replica takes batch/devices samples)")
    return args


def simulate_cpu_devices(n: int) -> None:
    """Ask XLA for `n` host (CPU) devices; must run before jax is imported.

    The flag only affects the CPU platform: on a GPU machine jax.devices() is still the GPUs.
    A device count the user already put in XLA_FLAGS is left alone.
    """
    if "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    simulate_cpu_devices(ARGS.devices)

import flax.linen as nn  # noqa: E402  (after XLA_FLAGS)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import whalex as wh  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import single_device_check  # noqa: E402  (--check)


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------
class ResidualBlock(nn.Module):
    """Conv-GroupNorm-ReLU-Conv-GroupNorm plus a (projected) skip connection.

    GroupNorm normalises each sample on its own, so the backbone gives the same result whatever
    the per-device batch (BatchNorm's batch statistics would make data parallelism change the maths).
    """

    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x):
        groups = min(8, self.features)
        y = nn.Conv(self.features, (3, 3), (self.strides, self.strides), use_bias=False)(x)
        y = nn.relu(nn.GroupNorm(num_groups=groups)(y))
        y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
        y = nn.GroupNorm(num_groups=groups, scale_init=nn.initializers.zeros)(y)
        if x.shape != y.shape:
            x = nn.Conv(self.features, (1, 1), (self.strides, self.strides), use_bias=False)(x)
            x = nn.GroupNorm(num_groups=groups)(x)
        return nn.relu(x + y)


class Backbone(nn.Module):
    """A small ResNet: stem, three stages of residual blocks, global average pool -> features."""

    width: int
    devices: int

    @nn.compact
    def __call__(self, images):
        with wh.replicate(self.devices):                       # annotation style 1: context manager
            x = nn.Conv(self.width, (3, 3), use_bias=False)(images)
            x = nn.relu(nn.GroupNorm(num_groups=min(8, self.width))(x))
            x = ResidualBlock(self.width)(x)
            x = ResidualBlock(2 * self.width, strides=2)(x)
            x = ResidualBlock(4 * self.width, strides=2)(x)
            return jnp.mean(x, axis=(1, 2))                    # (batch, 4 * width)


def build_model(devices: int, classes: int, width: int):
    """The classifier module and the loss function, annotated for `devices` devices."""

    @wh.split(devices)                                         # annotation style 2: class decorator
    class ClassifierHead(nn.Module):
        """The very wide fully connected layer: features -> logits over every class."""

        classes: int

        @nn.compact
        def __call__(self, features):
            return nn.Dense(self.classes, kernel_init=nn.initializers.normal(0.01))(features)

    @wh.split(devices)                                         # annotation style 3: function decorator
    def softmax_cross_entropy_and_accuracy(logits, labels):
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == labels)
        return loss, accuracy

    class Classifier(nn.Module):
        @nn.compact
        def __call__(self, images):
            features = Backbone(width, devices)(images)
            return ClassifierHead(classes)(features)

    model = Classifier()

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["image"])
        loss, accuracy = softmax_cross_entropy_and_accuracy(logits, batch["label"])
        return loss, {"accuracy": accuracy}

    return model, loss_fn


# --------------------------------------------------------------------------------------------
# Synthetic, learnable data
# --------------------------------------------------------------------------------------------
class SyntheticImages:
    """Class prototypes = random mixtures of `basis` smooth random textures; samples = prototype + noise.

    Labels are drawn with probability ~ 1 / rank**zipf (class 0 the most frequent).

    Only the (classes x basis) mixing codes and the (basis x H x W x 3) textures are stored, so
    100K classes cost a few MB. Deterministic for a given seed.
    """

    def __init__(self, classes: int, image_size: int, noise: float, seed: int, zipf: float = 1.0,
                 basis: int = 48):
        rng = np.random.default_rng(seed)
        self.classes, self.noise = classes, noise
        weights = 1.0 / np.arange(1, classes + 1, dtype=np.float64) ** zipf
        self.probs = weights / weights.sum()
        self.cdf = np.cumsum(self.probs)
        self.codes = rng.standard_normal((classes, basis), dtype=np.float32) / np.sqrt(basis)
        textures = rng.standard_normal((basis, image_size, image_size, 3)).astype(np.float32)
        # Smooth a little (a 3x3 box blur, wrapping around) so the textures look like images.
        smooth = sum(np.roll(np.roll(textures, dy, 1), dx, 2) for dy in (-1, 0, 1) for dx in (-1, 0, 1))
        smooth /= smooth.reshape(basis, -1).std(axis=1)[:, None, None, None]
        self.textures = smooth.reshape(basis, -1)
        self.shape = (image_size, image_size, 3)
        self.rng = np.random.default_rng(seed + 1)

    @property
    def label_entropy(self) -> float:
        p = self.probs[self.probs > 0]
        return float(-(p * np.log(p)).sum())

    def batch(self, size: int) -> dict:
        labels = np.minimum(np.searchsorted(self.cdf, self.rng.random(size)), self.classes - 1)
        clean = self.codes[labels] @ self.textures
        images = clean + self.noise * self.rng.standard_normal(clean.shape, dtype=np.float32)
        return {"image": images.reshape((size,) + self.shape), "label": labels.astype(np.int32)}


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------
def main(args) -> dict:
    if jax.device_count() < args.devices:
        raise SystemExit(
            f"--devices {args.devices} but JAX sees {jax.device_count()} device(s) ({jax.devices()[0].platform}). "
            "On CPU, leave XLA_FLAGS unset (the script sets --xla_force_host_platform_device_count) or set "
            f"it to at least {args.devices}; on GPUs pass --devices {jax.device_count()} or fewer.")

    data = SyntheticImages(args.classes, args.image_size, args.noise, args.seed, args.zipf)
    model, loss_fn = build_model(args.devices, args.classes, args.width)
    example = data.batch(args.batch)
    # jit: eager init compiles op by op
    params = jax.jit(model.init)(jax.random.key(args.seed), example["image"])["params"]
    n_params = sum(x.size for x in jax.tree.leaves(params))
    n_head = sum(x.size for x in jax.tree.leaves(params["ClassifierHead_0"]))
    print(f"{args.classes:,} classes, {args.image_size}x{args.image_size} images, global batch {args.batch}, "
          f"{n_params:,} parameters ({n_head:,} in the classifier head), {jax.device_count()} "
          f"{jax.devices()[0].platform} device(s)")

    if args.steps == 0:                                        # --check --steps 0: the comparison alone
        return check(args, {}, loss_fn, params, data)
    step = wh.parallelize(loss_fn, optax.adam(args.lr), has_aux=True)
    t0 = time.perf_counter()
    state = step.init(params, example)
    del params
    print(step.plan.summary())

    losses, accuracies = [], []
    t_first = None
    with tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=True) as bar:
        for i in bar:
            batch = example if i == 0 else data.batch(args.batch)
            state, metrics = step(state, batch)
            loss = float(metrics["loss"])                       # waits for the step: fine here
            accuracy = float(metrics["aux"]["accuracy"])
            if t_first is None:
                t_first = time.perf_counter() - t0              # planning + compilation + first step
                t1 = time.perf_counter()
            losses.append(loss)
            accuracies.append(accuracy)
            bar.set_postfix(loss=f"{loss:.4f}", acc=f"{accuracy:.3f}")
    t_rest = time.perf_counter() - t1

    k = max(1, min(10, len(losses) // 5))
    first, last = float(np.mean(losses[:k])), float(np.mean(losses[-k:]))
    print(f"plan + compile + first step: {t_first:.1f} s; "
          + (f"then {1000 * t_rest / (len(losses) - 1):.0f} ms/step" if len(losses) > 1 else ""))
    print(f"loss: first {losses[0]:.4f}, mean of first {k} steps {first:.4f}, mean of last {k} steps {last:.4f} "
          f"(uniform guess ln({args.classes}) = {np.log(args.classes):.4f}; "
          f"label entropy, the best loss without looking at the images = {data.label_entropy:.4f})")
    print(f"train accuracy: mean of first {k} steps {np.mean(accuracies[:k]):.3f}, "
          f"mean of last {k} steps {np.mean(accuracies[-k:]):.3f} "
          f"(always guessing the most frequent class: {data.probs.max():.3f})")
    print(f"final loss: {losses[-1]:.4f}")
    result = {"losses": losses, "accuracies": accuracies, "state": state, "plan": step.plan}
    params = jax.jit(model.init)(jax.random.key(args.seed), example["image"])["params"]
    return check(args, result, loss_fn, params, data)


def check(args, result: dict, loss_fn, params, data) -> dict:
    """--check: whalex and one device train from `params` for --check-steps steps; the verdict in `result`."""
    if args.check:
        batches = [data.batch(args.batch) for _ in range(args.check_steps)]
        worst = single_device_check.compare(loss_fn, params, batches, args.lr, has_aux=True, perturb=args.perturb)
        result["max_rel_err"] = worst
        result["check_ok"] = single_device_check.verdict(worst, args.check_tol, args.check_steps)
    return result


if __name__ == "__main__":
    single_device_check.exit_status(main(ARGS))
