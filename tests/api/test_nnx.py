"""Flax NNX models under whalex plans equal plain NNX training on one device.

`step.init(model, batch)` trains the module's nnx.Params; BatchStats and the dropout streams'
RngKey/RngCount are model state, carried in `TrainState.model_state`; `step.model(state)` is the
module again. Checked for a CNN with BatchNorm and Dropout and a small transformer block.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import whalex as wh
from conftest import adam, rel_err

B = 16


def _scope(split_head):
    return (lambda: wh.split(8)) if split_head else (lambda: wh.replicate(8))


class CNN(nnx.Module):
    """Flax's NNX MNIST example, shrunk: conv, BatchNorm, dropout, a linear head."""

    def __init__(self, rngs, split_head=False):
        self.conv = nnx.Conv(1, 4, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.lin = nnx.Linear(4 * 4 * 4, 16, rngs=rngs)
        self.split_head = split_head

    def __call__(self, x):
        with wh.replicate(8):
            x = nnx.relu(self.bn(self.conv(x)))
            x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
            x = self.drop(x).reshape(x.shape[0], -1)
        with _scope(self.split_head)():
            return self.lin(x)


class Block(nnx.Module):
    """A pre-LN transformer block with attention and residual dropout, and a vocabulary head."""

    def __init__(self, rngs, split_head=False, vocab=16, d=8, heads=2):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, dropout_rate=0.2, decode=False, use_bias=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 2 * d, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.out = nnx.Linear(d, vocab, rngs=rngs)
        self.split_head = split_head

    def __call__(self, tokens):
        with wh.replicate(8):
            x = self.embed(tokens)
            x = x + self.drop(self.attn(self.ln1(x)))
            x = x + self.drop(self.down(nnx.gelu(self.up(self.ln2(x)))))
        with _scope(self.split_head)():
            return self.out(x)


def cnn_problem():
    kx, ky = jax.random.split(jax.random.key(7))
    batch = {"x": jax.random.normal(kx, (B, 8, 8, 1)), "y": jax.random.randint(ky, (B,), 0, 16)}

    def loss_fn(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()
    return CNN, loss_fn, batch


def block_problem():
    k1, k2 = jax.random.split(jax.random.key(3))
    tokens = jax.random.randint(k1, (B, 7), 0, 16)
    lengths = jax.random.randint(k2, (B, 1), 0, 7)
    batch = {"tokens": tokens, "mask": (jnp.arange(7)[None] < lengths).astype(jnp.float32)}

    def loss_fn(model, batch):         # next-token cross-entropy, token-weighted, some rows all padding
        logits = model(batch["tokens"][:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
        m = batch["mask"][:, 1:]
        return (ce * m).sum() / m.sum()
    return Block, loss_fn, batch


PROBLEMS = {"cnn": cnn_problem, "block": block_problem}


@functools.cache
def nnx_reference(name, opt, steps=3):
    """Plain NNX on one device (annotations are inert there, so one reference serves every plan)."""
    cls, loss_fn, batch = PROBLEMS[name]()
    tx = _tx(opt)
    model = cls(nnx.Rngs(0, dropout=1))
    model.train()
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    return [float(step(model, opt, batch)) for _ in range(steps)], model


def whalex_train(cls, loss_fn, batch, tx, config, split_head=False, steps=3):
    """The same model trained by a whalex step: (step, trained module, losses)."""
    model = cls(nnx.Rngs(0, dropout=1), split_head=split_head)
    model.train()
    step = wh.parallelize(loss_fn, tx, config=config)
    state = step.init(model, batch)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return step, step.model(state), losses


def _tx(opt):
    return optax.sgd(0.2) if opt == "sgd" else adam(1e-2)


def _err(a, b):
    """rel_err with a floor: a parameter whose true gradient is zero (attention's key bias: softmax
    is shift invariant) holds only float noise, ~1e-9, which says nothing about the plan."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-3))


PLANS = {"dp": ({}, False), "hybrid": ({}, True), "zero2": ({"zero_level": 2}, False)}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("name", list(PROBLEMS))
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_nnx_equals_plain_nnx(name, plan, opt):
    cls, loss_fn, batch = PROBLEMS[name]()
    cfg, split_head = PLANS[plan]
    tx = _tx(opt)
    ref_losses, ref_model = nnx_reference(name, opt)

    step, trained, losses = whalex_train(cls, loss_fn, batch, tx, wh.Config(**cfg), split_head)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert isinstance(trained, cls)
    for kind in (nnx.Param, nnx.BatchStat, nnx.RngState):
        got = nnx.to_pure_dict(nnx.state(trained, kind))
        ref = nnx.to_pure_dict(nnx.state(ref_model, kind))
        got = jax.tree.map(lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
                           got)
        ref = jax.tree.map(lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
                           ref)
        errs = jax.tree.map(_err, got, ref)
        assert not jax.tree.leaves(errs) or max(jax.tree.leaves(errs)) < 1e-4, (kind, errs)
    if split_head:
        assert any(t.strategy.startswith("split") for t in step.plan.task_graphs)
    moved = rel_err(nnx.to_pure_dict(nnx.state(trained, nnx.Param))["lin" if name == "cnn" else "out"]["kernel"],
                    nnx.to_pure_dict(nnx.state(cls(nnx.Rngs(0, dropout=1)), nnx.Param))[
                        "lin" if name == "cnn" else "out"]["kernel"])
    assert moved > 1e-3


def test_nnx_model_plans_and_runs_unchanged_without_whalex():
    cls, loss_fn, batch = cnn_problem()
    model = cls(nnx.Rngs(0, dropout=1), split_head=True)
    model.eval()
    out = model(batch["x"])                                    # annotations are inert outside whalex
    assert out.shape == (B, 16)
    plan = wh.plan(loss_fn, model, batch, optax.sgd(0.1))
    assert [t.strategy for t in plan.task_graphs][:2] == ["replicate(8)", "split(8)"]


def test_step_model_needs_an_nnx_step():
    step = wh.parallelize(lambda p, b: jnp.mean(b["x"] @ p["w"]), optax.sgd(0.1))
    state = step.init({"w": jnp.ones((3,))}, {"x": jnp.ones((8, 3))})
    with pytest.raises(wh.PlanError, match="NNX module"):
        step.model(state)


@pytest.mark.parametrize("level", [1, 3])
def test_nnx_batchnorm_exact_under_zero(level):
    cls, loss_fn, batch = cnn_problem()
    ref_losses, ref_model = nnx_reference("cnn", "sgd")
    _, trained, losses = whalex_train(cls, loss_fn, batch, _tx("sgd"), wh.Config(zero_level=level))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for kind in (nnx.Param, nnx.BatchStat):
        errs = jax.tree.map(_err, nnx.to_pure_dict(nnx.state(trained, kind)),
                            nnx.to_pure_dict(nnx.state(ref_model, kind)))
        assert max(jax.tree.leaves(errs)) < 1e-4, (kind, errs)


def test_nnx_batchnorm_refused_by_name_on_uneven_chunks():
    cls, loss_fn, batch = cnn_problem()
    model = cls(nnx.Rngs(0, dropout=1))
    model.train()
    with pytest.raises(wh.PlanError, match=r"(?s)self.bn.*batch_coupling='per_part'"):
        wh.plan(loss_fn, model, batch, optax.sgd(0.1), cluster=wh.Cluster(kinds=["V100-32GB"] * 4 + ["T4-16GB"] * 4))
