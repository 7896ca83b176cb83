"""A GPT-style stock Flax model (Embed, LayerNorm, MultiHeadDotProductAttention, Dense) plans and
trains exactly as one device on whichever jax this interpreter resolved: CI runs it on the oldest
(Python 3.11) and the newest (Python 3.12) supported jax."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import whalex as wh
from conftest import adam, assert_matches

VOCAB, D, HEADS, LAYERS, SEQ, B = 64, 32, 2, 2, 8, 16


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        y = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(y, y, mask=mask)
        return x + nn.Dense(D)(nn.gelu(nn.Dense(4 * D)(nn.LayerNorm()(x))))


class GPT(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D)(tokens) + self.param("pos", nn.initializers.normal(0.02), (SEQ, D))
        for _ in range(LAYERS):
            x = Block()(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


MODEL = GPT()


def loss_fn(params, batch):
    """Token-weighted cross-entropy over the non-padding targets of the whole batch."""
    logits = MODEL.apply({"params": params}, batch["x"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return (ce * batch["w"]).sum() / jnp.maximum(batch["w"].sum(), 1.0)


def problem(rows=B):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (rows, SEQ + 1)).astype(np.int32)
    lengths = rng.integers(0, SEQ + 1, rows)
    lengths[:3] = 0                                    # rows that are all padding
    w = (np.arange(SEQ)[None] < lengths[:, None]).astype(np.float32)
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:], "w": w}
    params = jax.device_get(MODEL.init(jax.random.key(0), batch["x"])["params"])
    # Biases as after some training, not Flax's zeros: the attention key's bias has an exactly zero
    # gradient (softmax ignores a shift per query), so from zero both runs would only move it by noise.
    params = jax.tree_util.tree_map_with_path(
        lambda path, p: p + 0.05 * rng.standard_normal(p.shape).astype(p.dtype) if path[-1].key == "bias" else p,
        params)
    return params, batch


def test_supported_jax():
    major_minor = tuple(int(p) for p in jax.__version__.split(".")[:3])
    assert (0, 10, 2) <= major_minor < (0, 13), f"jax {jax.__version__} is outside whalex's supported range"


@pytest.mark.parametrize("optimizer, config", [
    (optax.sgd(0.5), wh.Config()),                              # data parallel over 8 devices
    (adam(), wh.Config()),
    (optax.sgd(0.5), wh.Config(num_micro_batch=2)),             # gradient accumulation
], ids=["dp-sgd", "dp-adam", "accumulate-sgd"])
def test_gpt_trains_as_one_device(optimizer, config):
    params, batch = problem()
    step, _ = assert_matches(loss_fn, params, batch, steps=3, optimizer=optimizer, tol=1e-4, config=config)
    flops = sum(t.flops for t in step.plan.task_graphs)
    assert flops > 0                                            # the cost model sees the model's work


def test_predicted_step_time_counts_at_the_precision_of_the_step():
    """On a GPU kind the prediction is the jaxpr FLOPs over the spec speed: FP32, or bf16 under amp."""
    from whalex.mesh.specs import lookup
    from whalex.view.timing import predict
    params, batch = problem()
    cluster = wh.Cluster.abstract(kinds=["H100-80GB"])
    spec = lookup("H100-80GB")
    for amp, speed in ((None, spec.fp32_flops), ("bf16", spec.bf16_flops)):
        plan = wh.plan(loss_fn, params, batch, optax.sgd(0.1), config=wh.Config(amp=amp), cluster=cluster)
        flops = sum(t.flops for t in plan.task_graphs)
        assert flops > 0
        assert predict(plan).step_time == pytest.approx(flops / speed, rel=1e-9)
