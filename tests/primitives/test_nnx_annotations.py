"""whalex's annotations on Flax NNX module classes: `@wh.split(8)` / `@wh.replicate(4)` on a class and
`with wh.replicate(8)` inside `__call__`. Without whalex the model runs unchanged; through the NNX
adapter each scope is a TaskGraph of the captured program, and the annotated model trains as one
device."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import whalex as wh
from conftest import assert_matches
from whalex.jaxpr.capture import capture
from whalex.nnx import NnxModel


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
