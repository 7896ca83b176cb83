"""Every plan trains the same model, whatever the loss computes (docs/architecture.md#the-loss-contract).

A tiny language model on padded sequences, with the losses real training code writes: a plain
mean, a sum, a masked mean over examples, lm1b's token-weighted cross-entropy (some rows all
padding), and cross-entropy plus a z-loss and a weight penalty written in the loss. Each runs under
the plans that see the whole batch and those that evaluate the loss in parts, with SGD and Adam,
against single-device training of the same model on the same batch.
"""
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import whalex as wh
from conftest import HETERO, adam, assert_matches, reference_train, rel_err, whalex_train

B, T, V, D = 32, 6, 16, 12


def lm_batch(seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    tok = jax.random.randint(k1, (B, T + 1), 1, V)
    lengths = jax.random.randint(k2, (B,), 1, T + 1)
    lengths = lengths.at[jnp.array([3, 17, 18, 30])].set(0)          # rows that are all padding
    pos = jnp.arange(T + 1)[None]
    tok = jnp.where(pos <= lengths[:, None], tok, 0)                 # 0 is padding
    weight = jax.random.uniform(k3, (B,)) * (lengths > 0)              # per-example weights (masked mean)
    return {"inputs": tok[:, :-1], "targets": tok[:, 1:], "weight": weight}


def lm_params(seed=1):
    k = jax.random.split(jax.random.key(seed), 4)
    return {"emb": jax.random.normal(k[0], (V, D)) * 0.5, "w1": jax.random.normal(k[1], (D, D)) * 0.3,
            "w2": jax.random.normal(k[2], (D, D)) * 0.3, "out": jax.random.normal(k[3], (D, V)) * 0.3}


def _reduce(kind, logits, b, p):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"])       # [B, T]
    if kind == "mean":
        return ce.mean()
    if kind == "sum":
        return ce.sum() * 0.01
    if kind == "masked":                                                # sum(e * m) / sum(m) over examples
        w = b["weight"]
        return (ce.mean(-1) * w).sum() / w.sum()
    if kind == "token":                                                 # lm1b: weights = targets > 0
        w = (b["targets"] > 0).astype(jnp.float32)
        return (ce * w).sum() / jnp.maximum(w.sum(), 1.0)
    if kind == "aux":                                                   # + z-loss + a weight penalty
        z = jax.nn.logsumexp(logits, -1)
        w = (b["targets"] > 0).astype(jnp.float32)
        return (ce * w).sum() / w.sum() + 1e-2 * jnp.mean(z ** 2) + 1e-3 * jnp.sum(p["out"] ** 2)
    raise ValueError(kind)


def lm_hidden(scopes, p, b):
    """The LM's first three layers (embedding, w1, w2), each under its scope: the last hidden state."""
    with scopes[0]():
        h = p["emb"][b["inputs"]]
    with scopes[1]():
        h = jnp.tanh(h @ p["w1"])
    with scopes[2]():
        return jnp.tanh(h @ p["w2"])


def lm_loss(kind, scopes):
    """scopes: 4 context factories, one per layer (embedding, w1, w2, head + loss)."""

    def loss_fn(p, b):
        h = lm_hidden(scopes, p, b)
        with scopes[3]():
            return _reduce(kind, h @ p["out"], b, p)

    return loss_fn


none = contextlib.nullcontext
PLANS = {
    # name: (scopes, Config kwargs, cluster kinds)
    "dp": ((none,) * 4, {}, None),
    "hybrid": ((lambda: wh.replicate(8),) * 3 + (lambda: wh.split(8),), {}, None),
    "micro4": ((none,) * 4, {"num_micro_batch": 4}, None),
    "hetero": ((none,) * 4, {}, HETERO),
    "zero1": ((none,) * 4, {"zero_level": 1}, None),
    "zero2": ((none,) * 4, {"zero_level": 2}, None),
    "zero3": ((none,) * 4, {"zero_level": 3}, None),
    "pipe2_1f1b": ((lambda: wh.replicate(1),) * 2 + (none,) * 2, {"num_micro_batch": 4}, None),
    "pipe4_gpipe": ((lambda: wh.replicate(1),) * 4, {"num_micro_batch": 4, "schedule": "gpipe"}, None),
    "pipe4_1f1b": ((lambda: wh.replicate(1),) * 4, {"num_micro_batch": 2}, None),
}
KINDS = ("mean", "sum", "masked", "token", "aux")


OPTIMIZERS = {"sgd": lambda: optax.sgd(0.5), "adam": lambda: adam(1e-2)}


@functools.cache
def _reference(kind, opt, steps=3):
    """Single-device training (annotations are inert there: one reference serves every plan)."""
    return reference_train(lm_loss(kind, (none,) * 4), lm_params(), lm_batch(), OPTIMIZERS[opt](), steps)


def _run(kind, plan, opt, steps=3):
    scopes, cfg, kinds = PLANS[plan]
    cluster = wh.Cluster(kinds=kinds) if kinds else None
    ref_losses, ref_params = _reference(kind, opt, steps)
    losses, state, step = whalex_train(lm_loss(kind, scopes), lm_params(), lm_batch(), OPTIMIZERS[opt](), steps,
                                       config=wh.Config(**cfg), cluster=cluster)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    errs = jax.tree.map(rel_err, step.params(state), ref_params)
    assert max(jax.tree.leaves(errs)) < 1e-4, errs
    assert max(jax.tree.leaves(jax.tree.map(rel_err, ref_params, lm_params()))) > 1e-3     # training moved
    return step


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("kind", KINDS)
def test_losses_sgd(kind, plan):
    step = _run(kind, plan, "sgd")
    if plan == "hetero":
        assert len(set(step.plan.batch_sizes)) > 1
        assert all(any(bits) for bits in step.plan.program.remainder_bits)   # full and remainder chunks run


@pytest.mark.parametrize("plan", list(PLANS))
def test_losses_adam(plan):
    _run("aux", plan, "adam")


@pytest.mark.parametrize("plan", ["micro4", "pipe4_gpipe"])
def test_token_loss_adam(plan):
    _run("token", plan, "adam")


@pytest.mark.parametrize("plan", ["micro4", "hetero"])
def test_aux_outputs_keep_global_meaning(plan):
    """aux: a per-example output (gathered by rows) and a ratio of sums (token accuracy)."""
    scopes, cfg, kinds = PLANS[plan]
    base = lm_loss("token", scopes)

    def loss_fn(p, b):
        logits = jnp.tanh(jnp.tanh(p["emb"][b["inputs"]] @ p["w1"]) @ p["w2"]) @ p["out"]
        w = (b["targets"] > 0).astype(jnp.float32)
        acc = ((logits.argmax(-1) == b["targets"]) * w).sum() / w.sum()
        return base(p, b), {"per_example": (logits.max(-1) * w).sum(-1), "accuracy": acc}

    cluster = wh.Cluster(kinds=kinds) if kinds else None
    step, state = assert_matches(loss_fn, lm_params(), lm_batch(), steps=2, optimizer=optax.sgd(0.5), tol=1e-4,
                                 has_aux=True, config=wh.Config(**cfg), cluster=cluster)
    before = jax.tree.map(np.asarray, step.params(state))
    _, metrics = step(state, lm_batch())
    ref = loss_fn(before, lm_batch())[1]
    np.testing.assert_allclose(metrics["aux"]["per_example"], ref["per_example"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["aux"]["accuracy"], ref["accuracy"], rtol=1e-6)


def test_all_padding_part_is_not_nan():
    """A chunk with no real token: the normaliser is global, so no 0/0 anywhere."""
    batch = lm_batch()
    batch["targets"] = batch["targets"].at[:8].set(0)                # the first 8 rows: all padding
    step = wh.parallelize(lm_loss("token", (none,) * 4), optax.sgd(0.5), cluster=wh.Cluster(kinds=HETERO))
    state = step.init(lm_params(), batch)
    state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(step.params(state)))


def test_summary_lists_couplings():
    plan = wh.plan(lm_loss("token", (none,) * 4), lm_params(), lm_batch(), optax.sgd(0.1),
                   config=wh.Config(num_micro_batch=4))
    text = plan.summary()
    assert "normaliser (global pre-pass)" in text and "global sum (accumulated over parts)" in text


def _log_mean(p, b):
    """Not affine in its batch sum: log of a mean (exact in two passes over the parts)."""
    logits = jnp.tanh(p["emb"][b["inputs"]] @ p["w1"]) @ p["out"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"])
    return jnp.log(ce.mean())


@pytest.mark.parametrize("plan", ["micro4", "hetero"])
def test_loss_not_affine_in_its_sums_is_exact_in_two_passes(plan):
    scopes, cfg, kinds = PLANS[plan]
    cluster = wh.Cluster(kinds=kinds) if kinds else None
    step, _ = assert_matches(_log_mean, lm_params(), lm_batch(), steps=3, optimizer=optax.sgd(0.5), tol=1e-4,
                             config=wh.Config(**cfg), cluster=cluster)
    assert any("two passes" in c for c in step.plan.couplings)


def test_pipeline_refuses_a_loss_not_affine_in_its_sums():
    def staged(p, b):
        with wh.replicate(1):
            h = jnp.tanh(p["emb"][b["inputs"]] @ p["w1"])
        with wh.replicate(1):
            ce = optax.softmax_cross_entropy_with_integer_labels(h @ p["out"], b["targets"])
            return jnp.log(ce.mean())
    with pytest.raises(wh.PlanError, match="not affine"):
        wh.plan(staged, lm_params(), lm_batch(), optax.sgd(0.1), config=wh.Config(num_micro_batch=4))


def test_samples_coupled_across_the_batch_are_refused_in_parts():
    """A contrastive loss (each sample against every other) cannot be split over parts."""
    def contrastive(p, b):
        z = jnp.tanh(p["emb"][b["inputs"]].mean(1) @ p["w1"])
        logits = z @ z.T                                     # [B, B]: samples against samples
        return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.arange(z.shape[0])).mean()
    with pytest.raises(wh.PlanError, match="mixes samples"):
        wh.plan(contrastive, lm_params(), lm_batch(), optax.sgd(0.1), config=wh.Config(num_micro_batch=4))
    plan = wh.plan(contrastive, lm_params(), lm_batch(), optax.sgd(0.1))     # the whole batch at once: fine
    assert plan.program_kind == "Program"
