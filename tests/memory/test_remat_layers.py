"""Remat per layer without annotations. The layers of an un-annotated model are found in
the captured program (module paths that repeat), remat applies per layer, and training is exact."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import whalex as wh
from architectures.test_stock_gpt import LAYERS, SEQ, VOCAB, Block, D, loss_fn, problem
from conftest import adam, assert_matches
from whalex.jaxpr.capture import capture
from whalex.jaxpr.flops import training_flops
from whalex.memory import vjp_residual_bytes
from whalex.memory.layers import find_layers


def test_layers_are_the_repeated_blocks_not_their_sublayers():
    params, batch = problem()
    layers = find_layers(capture(loss_fn, params, batch))
    blocks = [n for n in layers.names if n.startswith("GPT/Block_")]
    assert blocks == [f"GPT/Block_{i}" for i in range(LAYERS)]       # whole blocks, once each
    assert layers.depth == 2 and list(layers.starts) == sorted(set(layers.starts))
    assert layers.names[0] == "GPT/Embed_0" and layers.names[-1] == "GPT/Dense_0"


@pytest.mark.parametrize("optimizer", [optax.sgd(0.5), adam()], ids=["sgd", "adam"])
def test_remat_full_per_layer_trains_as_one_device(optimizer):
    params, batch = problem()
    step, _ = assert_matches(loss_fn, params, batch, steps=3, optimizer=optimizer, tol=1e-4,
                             config=wh.Config(remat="full"))
    text = step.plan.summary()
    assert "per layer" in text and "GPT/Block_0" in text


class _HandRemat(nn.Module):
    """test_gpt's GPT with `nn.remat(Block)`, what a user writes by hand (the same parameter names)."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D)(tokens) + self.param("pos", nn.initializers.normal(0.02), (SEQ, D))
        for i in range(LAYERS):
            x = nn.remat(Block)(name=f"Block_{i}")(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def _hand_loss(params, batch):
    logits = _HandRemat().apply({"params": params}, batch["x"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return (ce * batch["w"]).sum() / jnp.maximum(batch["w"].sum(), 1.0)


def _saved(fn, params, batch) -> float:
    """What JAX keeps for the backward pass of fn w.r.t. the parameters (bytes)."""
    leaves, tree = jax.tree.flatten((params, batch))
    n = len(jax.tree.leaves(params))
    return vjp_residual_bytes(lambda *xs: fn(*jax.tree.unflatten(tree, xs)), leaves, range(n))


def test_full_remat_of_an_unannotated_model_saves_like_nn_remat_per_block():
    """The plan's activation bytes with remat="full" over those without,
    at most 1.10x the same fraction of the hand-written nn.remat(Block) model."""
    params, batch = problem()
    hand = _saved(_hand_loss, params, batch) / _saved(loss_fn, params, batch)
    r = wh.plan(loss_fn, params, batch, optax.sgd(0.1), config=wh.Config(remat="full")).report.remat
    assert r.saved / r.baseline <= 1.10 * hand, (r.saved / r.baseline, hand)
    assert 0 < r.saved < r.baseline
    assert "saved for the backward pass" in wh.plan(loss_fn, params, batch, optax.sgd(0.1),
                                                    config=wh.Config(remat="full")).summary()


@pytest.mark.parametrize("optimizer", [optax.sgd(0.5), adam()], ids=["sgd", "adam"])
def test_auto_remat_fits_half_the_no_remat_step_and_trains_as_one_device(optimizer):
    """`remat="auto"` fits 50% of the no-remat step (state + what the backward
    keeps, as JAX counts it: true on CPU too), choosing per layer. A batch of 256 rows: activations,
    not the state, fill the step (as in the models remat is for)."""
    params, batch = problem(rows=256)
    probe = wh.plan(loss_fn, params, batch, optimizer, config=wh.Config(remat="auto")).report.remat
    whole = probe.state + probe.baseline
    config = wh.Config(remat="auto", memory_budget=0.5 * whole)
    step, _ = assert_matches(loss_fn, params, batch, steps=3, optimizer=optimizer, tol=1e-4, config=config)
    r = step.plan.report.remat
    assert r.state + r.saved <= 0.5 * whole < r.state + r.baseline
    assert len(r.segment_levels) == len(r.layers.names) and any(r.segment_levels)


def _flops(fn, params, batch) -> float:
    """Training FLOPs (recomputed forwards included) of fn w.r.t. the parameters."""
    leaves, tree = jax.tree.flatten((params, batch))
    n = len(jax.tree.leaves(params))
    jaxpr = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(tree, xs)))(*leaves)
    return training_flops(jaxpr, [k < n for k in range(len(leaves))], [True])


def test_full_remat_recomputes_the_blocks_like_nn_remat_and_not_the_head():
    """remat="full" rematerializes the repeated layers (the blocks) and leaves the embedding and the
    head their residuals, as nn.remat(Block) does: the same saved fraction and the same recomputed
    FLOPs (what its step time costs), both within 3% of the hand-written model's; the summary
    lists the level per layer and the FLOPs recomputation adds."""
    params, batch = problem()
    r = wh.plan(loss_fn, params, batch, optax.sgd(0.1), config=wh.Config(remat="full")).report.remat
    hand_flops = _flops(_hand_loss, params, batch) / _flops(loss_fn, params, batch)
    assert hand_flops > 1.05                                   # nn.remat(Block) recomputes something
    assert r.flops / r.baseline_flops == pytest.approx(hand_flops, rel=0.03)
    hand_saved = _saved(_hand_loss, params, batch) / _saved(loss_fn, params, batch)
    assert r.saved / r.baseline == pytest.approx(hand_saved, rel=0.03)
    levels = dict(zip(r.layers.names, r.segment_levels))
    assert levels["GPT/Embed_0"] is None and levels["GPT/Dense_0"] is None
    assert all(levels[f"GPT/Block_{i}"] == "full" for i in range(LAYERS))
    assert r.describe().count("full") >= 2 and "recomputation adds" in r.describe()


def test_activation_offload_is_per_layer_on_an_unannotated_model():
    """offload="activations" on one TaskGraph: each layer's boundary goes to pinned host memory (a
    block-shaped host value per block at least; one TaskGraph has no other boundary), and the step
    still trains as one device."""
    import re
    params, batch = problem()
    step, _ = assert_matches(loss_fn, params, batch, steps=2, optimizer=optax.sgd(0.5), tol=1e-4,
                             config=wh.Config(offload="activations"))
    rows = batch["x"].shape[0]
    jaxpr = str(step.plan.functions.traced_step().jaxpr)
    host = set(re.findall(rf"(\w+):f32<host>\[{rows},{SEQ},{D}\]", jaxpr))
    assert len(host) >= LAYERS, host
    assert len(step.plan.report.remat.layers.names) > LAYERS and "layer and TaskGraph boundaries" in step.plan.summary()
