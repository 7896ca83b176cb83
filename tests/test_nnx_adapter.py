"""whalex.nnx: an NNX model and loss_fn(model, batch) as whalex's functional loss.

Training through the adapter (plain jax.jit + jax.value_and_grad + optax) must equal plain NNX
training (nnx.value_and_grad + nnx.Optimizer, train mode) from the same initial model: losses,
params, batch statistics, and the dropout randomness carried in the model state.
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
from whalex.jaxpr.capture import capture
from whalex.nnx import NnxModel, is_key, is_module

STEPS = 3


# ---------------------------------------------------------------- models (tiny)

class CNN(nnx.Module):
    """Flax's NNX MNIST example, shrunk: conv, BatchNorm, dropout, dense."""

    def __init__(self, rngs):
        self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.lin = nnx.Linear(4 * 4 * 4, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv(x)))
        x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
        x = self.drop(x)
        return self.lin(x.reshape(x.shape[0], -1))


class Block(nnx.Module):
    """A pre-LN transformer block over embeddings, with attention and residual dropout."""

    def __init__(self, rngs, vocab=11, d=8, heads=2):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, dropout_rate=0.2, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.mlp = nnx.List([nnx.Linear(d, 2 * d, rngs=rngs), nnx.Linear(2 * d, d, rngs=rngs)])
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.out = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.drop(self.attn(self.ln1(x)))
        h = nnx.gelu(self.mlp[0](self.ln2(x)))
        x = x + self.drop(self.mlp[1](h))
        return self.out(x)


def cnn():
    kx, ky = jax.random.split(jax.random.key(7))
    batch = {"x": jax.random.normal(kx, (8, 8, 8, 1)), "y": jax.random.randint(ky, (8,), 0, 10)}

    def loss_fn(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return (lambda: CNN(nnx.Rngs(0, dropout=1))), loss_fn, batch


def block():
    tokens = jax.random.randint(jax.random.key(3), (4, 6), 0, 11)
    batch = {"tokens": tokens, "mask": (jnp.arange(6)[None] < jnp.array([[6], [4], [5], [2]])).astype(jnp.float32)}

    def loss_fn(model, batch):     # next-token cross-entropy, masked, token-weighted
        logits = model(batch["tokens"][:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
        m = batch["mask"][:, 1:]
        return (ce * m).sum() / m.sum()
    return (lambda: Block(nnx.Rngs(0, dropout=5))), loss_fn, batch


MODELS = {"cnn": cnn, "block": block}


# ---------------------------------------------------------------- the two ways of training

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
    make, loss_fn, batch = MODELS[name]()
    tx = optax.sgd(0.1) if opt == "sgd" else adam(1e-2)
    batch = jax.device_put(batch, jax.devices()[0])
    return make, nnx_train(make, loss_fn, batch, tx), adapter_train(make, loss_fn, batch, tx)


@pytest.mark.parametrize("opt", ["sgd"])          # Adam: end to end in tests/test_nnx.py
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
    make, loss_fn, batch = block()
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


# ---------------------------------------------------------------- whalex annotations on NNX classes

@wh.split(8)
class SplitHead(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(16, 32, rngs=rngs)

    def __call__(self, h):
        return self.lin(h)


@wh.replicate(4)
class ReplicatedBody(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, h):
        return nnx.relu(self.lin(h))


class Annotated(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(6, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.body = ReplicatedBody(rngs)
        self.head = SplitHead(rngs)

    def __call__(self, x):
        with wh.replicate(8):
            h = self.drop(nnx.tanh(self.lin(x)))
        return self.head(self.body(h))


class Plain(nnx.Module):
    """Annotated without the annotations."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(6, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.body = nnx.Module()
        self.body.lin = nnx.Linear(16, 16, rngs=rngs)
        self.head = nnx.Module()
        self.head.lin = nnx.Linear(16, 32, rngs=rngs)

    def __call__(self, x):
        h = self.drop(nnx.tanh(self.lin(x)))
        return self.head.lin(nnx.relu(self.body.lin(h)))


def test_whalex_annotations_on_nnx_modules():
    x = jax.random.normal(jax.random.key(0), (16, 6))
    y = jnp.arange(16) % 32
    ann, plain = Annotated(nnx.Rngs(0, dropout=2)), Plain(nnx.Rngs(0, dropout=2))

    # without whalex the annotated model runs unchanged: eagerly and under nnx.jit, train and eval
    np.testing.assert_allclose(ann(x), plain(x), rtol=1e-6)             # dropout on, same stream
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(ann, x), nnx.jit(lambda m, x: m(x))(plain, x),
                               rtol=1e-6)
    ann.eval(), plain.eval()
    np.testing.assert_allclose(ann(x), plain(x), rtol=1e-6)
    ann.train()

    # through the adapter the scopes reach the jaxpr: one TaskGraph per scope, in order
    def loss_fn(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()
    nm, params, ms = NnxModel.split(ann)
    loss = nm.wrap(loss_fn)
    cap = capture(lambda p, b: loss(p, b, model_state=ms)[0], params, {"x": x, "y": y})
    annotated = [t.strategy.label() for t in cap.taskgraphs if t.annotated]
    assert annotated == ["replicate(8)", "replicate(4)", "split(8)"]
    head = [cap.param_paths[i] for i in cap.taskgraphs[[t.strategy.label() for t in cap.taskgraphs]
                                                         .index("split(8)")].params]
    assert head == ["['head']['lin']['bias']", "['head']['lin']['kernel']"]


def test_annotated_nnx_model_trains_under_whalex():
    """A whalex step on the adapter's loss (model state held fixed) equals one-device training."""
    from conftest import assert_matches

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(6, 16, rngs=rngs)
            self.drop = nnx.Dropout(0.25, rngs=rngs)
            self.head = SplitHead(rngs)

        def __call__(self, x):
            with wh.replicate(8):
                h = self.drop(nnx.tanh(self.lin(x)))
            return self.head(h)

    nm, params, ms = NnxModel.split(Model(nnx.Rngs(0, dropout=2)))
    loss = nm.wrap(lambda m, b: optax.softmax_cross_entropy_with_integer_labels(m(b["x"]), b["y"]).mean())
    batch = {"x": jax.random.normal(jax.random.key(0), (16, 6)), "y": jnp.arange(16) % 32}
    # the typed RngKey becomes a constant of the captured jaxpr: capture, plan and lowering take it
    assert_matches(lambda p, b: loss(p, b, model_state=ms)[0], params, batch, steps=3, optimizer=optax.sgd(0.1))


def test_decorating_a_module_class_without_call_is_an_error():
    class NoCall(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    with pytest.raises(wh.ScopeError, match="has none"):      # not PytreeMeta.__call__, the constructor
        wh.split(8)(NoCall)

    class Base(nnx.Module):
        def __call__(self, x):
            return x + 1

    Sub = wh.replicate(8)(type("Sub", (Base,), {}))              # an inherited __call__ is found and wrapped
    assert Sub.__call__ is not Base.__call__ and Sub.__call__.__wrapped__ is Base.__call__
    assert Sub()(1) == 2 and Base()(1) == 2
