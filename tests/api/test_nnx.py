"""Flax NNX models under whalex: the adapter (whalex.nnx) and whalex plans, each equal to plain NNX
training on one device.

The adapter turns an NNX model and loss_fn(model, batch) into whalex's functional loss: training
through it (plain jax.jit + jax.value_and_grad + optax) equals plain NNX training (nnx.value_and_grad +
nnx.Optimizer, train mode) from the same initial model: losses, params, batch statistics, and the
dropout randomness carried in the model state. Under a plan, `step.init(model, batch)` trains the
module's nnx.Params; BatchStats and the dropout streams' RngKey/RngCount are model state, carried in
`TrainState.model_state`; `step.model(state)` is the module again. Checked for a CNN with BatchNorm and
Dropout and a small transformer block (their annotations are inert outside whalex).
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
from whalex.nnx import NnxModel, is_key, is_module

B = 16
STEPS = 3


# ---------------------------------------------------------------- models (tiny)

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
        self.mlp = nnx.List([nnx.Linear(d, 2 * d, rngs=rngs), nnx.Linear(2 * d, d, rngs=rngs)])
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.out = nnx.Linear(d, vocab, rngs=rngs)
        self.split_head = split_head

    def __call__(self, tokens):
        with wh.replicate(8):
            x = self.embed(tokens)
            x = x + self.drop(self.attn(self.ln1(x)))
            x = x + self.drop(self.mlp[1](nnx.gelu(self.mlp[0](self.ln2(x)))))
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



def _maker(name):
    """A function that builds the problem's model afresh, the same initial model every call."""
    cls = PROBLEMS[name]()[0]
    return lambda: cls(nnx.Rngs(0, dropout=1))


# ---------------------------------------------------------------- under whalex plans

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


# ---------------------------------------------------------------- the adapter: the two ways of training

def nnx_train(make, loss_fn, batch, tx, steps=STEPS):
    """Plain NNX: nnx.Optimizer and nnx.value_and_grad under nnx.jit, model in train mode."""
    model = make()
    model.train()
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, batch)) for _ in range(steps)]
    return losses, model


def adapter_train(make, loss_fn, batch, tx, steps=STEPS):
    """The adapter's functional loss under plain jax.jit + jax.value_and_grad + optax, one device."""
    model = make()
    model.train()
    nm, params, ms = NnxModel.split(model)
    loss = nm.wrap(loss_fn)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, ms, batch):
        (value, ms), grads = jax.value_and_grad(loss, has_aux=True)(params, batch, model_state=ms)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ms, value

    losses, states = [], [ms]
    for _ in range(steps):
        params, opt_state, ms, value = step(params, opt_state, ms, batch)
        losses.append(float(value))
        states.append(ms)
    return losses, nm, params, states


def _pure(model, kind):
    return nnx.to_pure_dict(nnx.state(model, kind))


def _assert_close(tree, ref, tol=1e-4):
    assert jax.tree.structure(tree) == jax.tree.structure(ref)
    errs = jax.tree.map(rel_err, tree, ref)
    worst = max(jax.tree.leaves(errs))
    assert worst < tol, errs


# ---------------------------------------------------------------- equivalence with plain NNX

@functools.cache
def trained(name, opt):
    """Both trainings of one model from the same initial model and batch (shared between tests)."""
    _, loss_fn, batch = PROBLEMS[name]()
    make = _maker(name)
    tx = optax.sgd(0.1) if opt == "sgd" else adam(1e-2)
    batch = jax.device_put(batch, jax.devices()[0])
    return make, nnx_train(make, loss_fn, batch, tx), adapter_train(make, loss_fn, batch, tx)


@pytest.mark.parametrize("opt", ["sgd"])          # Adam: end to end under the plans above
@pytest.mark.parametrize("name", ["cnn", "block"])
def test_adapter_training_equals_plain_nnx(name, opt):
    make, (ref_losses, ref), (losses, nm, params, states) = trained(name, opt)

    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=0)
    _assert_close(params, _pure(ref, nnx.Param))
    moved = max(jax.tree.leaves(jax.tree.map(rel_err, params, _pure(make(), nnx.Param))))
    assert moved > 1e-3, "training did not move the parameters"

    # every non-Param variable (batch stats, rng keys and counts) equals NNX's after the same steps
    ref_state = _pure(ref, nnx.Not(nnx.Param))
    final = states[-1]
    assert jax.tree.structure(final) == jax.tree.structure(ref_state)
    for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(ref_state)):
        if is_key(b):
            np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))
        elif jnp.issubdtype(b.dtype, jnp.floating):
            assert rel_err(a, b) < 1e-4
        else:
            np.testing.assert_array_equal(a, b)

    # the model built back from the trained state (step.model) holds NNX's trained variables
    back = nm.module(params, final)
    assert type(back) is type(ref)
    _assert_close(_pure(back, nnx.Param), _pure(ref, nnx.Param))
    if name == "cnn":
        stats = _pure(back, nnx.BatchStat)
        _assert_close(stats, _pure(ref, nnx.BatchStat))
        assert rel_err(stats["bn"]["mean"], jnp.zeros(4)) > 0      # the statistics really moved


@pytest.mark.parametrize("name", ["cnn", "block"])
def test_dropout_randomness_advances_through_model_state(name):
    """Dropout keys come from the model's nnx.Rngs (RngKey + RngCount), carried in model_state."""
    _, _, (_, nm, params, states) = trained(name, "sgd")

    # the stream's key never changes, its count grows by the draws of each step
    def rng_leaves(ms, kind):
        model = nm.module(params, ms)
        return jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, kind)))
    key0 = rng_leaves(states[0], nnx.RngKey)
    counts = [np.array(rng_leaves(ms, nnx.RngCount)) for ms in states]
    for ms in states[1:]:
        for a, b in zip(rng_leaves(ms, nnx.RngKey), key0):
            np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))
    draws = counts[1] - counts[0]
    assert draws.sum() >= 1
    for k in range(1, len(counts)):
        np.testing.assert_array_equal(counts[k] - counts[k - 1], draws)

    # the masks the model's Dropout draws differ from one step's state to the next
    probe = nm.wrap(lambda model, _: (jnp.float32(0), model.drop(jnp.ones((4, 64)))), has_aux=True)
    masks = [np.asarray(jax.jit(probe)(params, None, model_state=ms)[1][1]) != 0 for ms in states]
    for i in range(len(masks)):
        assert 0 < masks[i].mean() < 1
        for j in range(i):
            assert (masks[i] != masks[j]).any(), f"dropout masks of steps {j} and {i} are equal"


# ---------------------------------------------------------------- layout of the functional form

def test_split_layout_and_new_state_keeps_structure_and_dtypes():
    _, loss_fn, batch = block_problem()
    make = _maker("block")
    model = make()
    model.train()
    assert is_module(model) and not is_module({"a": 1}) and not is_module(nnx.Rngs(0))
    nm, params, ms = NnxModel.split(model)
    hash(nm)                                                 # static: usable as a jit static argument
    again = make()
    again.train()
    assert nm == NnxModel.split(again)[0]
    assert isinstance(params, dict) and isinstance(ms, dict)  # plain dicts, not nnx.State
    assert set(params["mlp"]) == {0, 1}                       # list entries keyed by index
    leaves = jax.tree.leaves(ms)
    assert any(is_key(x) for x in leaves)
    counts = [x for x in leaves if not is_key(x) and jnp.issubdtype(x.dtype, jnp.integer)]
    assert counts and all(x.dtype == jnp.uint32 for x in counts)

    loss = nm.wrap(loss_fn)
    value, new = jax.jit(loss)(params, batch, model_state=ms)
    assert value.shape == ()
    assert jax.tree.structure(new) == jax.tree.structure(ms)
    assert jax.tree.map(lambda x: x.dtype, new) == jax.tree.map(lambda x: x.dtype, ms)
    # through jax.grad too (the step's path): the gradient has the params' structure
    (_, new), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, batch, model_state=ms)
    assert jax.tree.structure(g) == jax.tree.structure(params)
    assert jax.tree.map(lambda x: x.dtype, new) == jax.tree.map(lambda x: x.dtype, ms)

    with pytest.raises(ValueError, match="structure"):
        loss({"embed": params["embed"]}, batch, model_state=ms)
    with pytest.raises(TypeError, match="nnx.Module"):
        NnxModel.split(params)


def test_has_aux_and_a_model_without_state():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    nm, params, ms = NnxModel.split(model)
    assert ms == {}
    loss = nm.wrap(lambda m, b: ((m(b) ** 2).mean(), {"out": m(b)}), has_aux=True)
    x = jnp.ones((4, 3))
    value, (new, aux) = loss(params, x, model_state=ms)
    assert new == {} and aux["out"].shape == (4, 2)
    np.testing.assert_allclose(value, (model(x) ** 2).mean(), rtol=1e-6)
    with pytest.raises(TypeError, match="has_aux"):
        nm.wrap(lambda m, b: m(b).sum(), has_aux=True)(params, x, model_state=ms)


class Custom(nnx.Variable):
    pass


class Odd(nnx.Module):
    """Writes its state in another dtype, sows intermediates, and may reshape a variable."""

    def __init__(self, reshape=False):
        self.lin = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
        self.total = Custom(jnp.zeros((3,), jnp.float32))
        self.reshape = reshape

    def __call__(self, x):
        y = self.lin(x)
        self.sow(nnx.Intermediate, "y", y)                   # created during the call
        s = y.sum(0).astype(jnp.bfloat16)                    # stored as bfloat16 by the call
        self.total.set_value(s if not self.reshape else jnp.concatenate([s, s]))
        return (y ** 2).mean()


@pytest.mark.filterwarnings("ignore:Using 'Module.sow")
def test_new_state_is_typed_like_the_input():
    nm, params, ms = NnxModel.split(Odd())
    assert set(ms) == {"total"}
    value, new = jax.jit(nm.wrap(lambda m, b: m(b)))(params, jnp.ones((2, 3)), model_state=ms)
    assert jax.tree.structure(new) == jax.tree.structure(ms)       # the sown intermediate is dropped
    assert new["total"].dtype == jnp.float32                        # cast back from bfloat16
    assert rel_err(new["total"], ms["total"] + 1) > 0

    nm, params, ms = NnxModel.split(Odd(reshape=True))
    with pytest.raises(ValueError, match="changed shape"):
        nm.wrap(lambda m, b: m(b))(params, jnp.ones((2, 3)), model_state=ms)
