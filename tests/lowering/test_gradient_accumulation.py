"""Gradient accumulation reduces the gradients once a step, not once per micro-batch.

The compiled HLO of a micro-batched GSPMD step is read for its gradient collectives (results shaped
like a parameter, possibly with a leading per-shard dimension of 1), a collective inside a `while`
body counted once per trip: their count and bytes must not grow with num_micro_batch. Training with
micro-batches must still equal single-device training (SGD and Adam) on a token-weighted masked mean
over a padded batch.
"""
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import whalex as wh
from conftest import adam, assert_matches, reference_train, rel_err, whalex_train
from whalex.jaxpr import hlo

B, T, F, H1, H2, C = 128, 3, 12, 20, 24, 40     # 3-d activations: no activation looks like a parameter
none = contextlib.nullcontext


def params0():
    k = jax.random.split(jax.random.key(0), 4)
    return {"w1": jax.random.normal(k[0], (F, H1)) * 0.3, "b1": jnp.zeros((H1,)),
            "w2": jax.random.normal(k[1], (H1, H2)) * 0.3, "out": jax.random.normal(k[2], (H2, C)) * 0.3}


def batch0():
    """Tokens with a per-token mask: rows of varying length, some rows all padding."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, T + 1, B)
    lengths[::7] = 0
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    return {"x": jnp.asarray(rng.normal(size=(B, T, F)), jnp.float32),
            "y": jnp.asarray(rng.integers(0, C, (B, T)), jnp.int32), "mask": jnp.asarray(mask)}


def make_loss(backbone, head):
    """Token-weighted masked mean cross-entropy: sum(ce * mask) / sum(mask) over the whole batch."""
    def loss_fn(p, b):
        with backbone():
            h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
            h = jnp.tanh(h @ p["w2"])
        with head():
            ce = optax.softmax_cross_entropy_with_integer_labels(h @ p["out"], b["y"])
            return (ce * b["mask"]).sum() / jnp.maximum(b["mask"].sum(), 1.0)
    return loss_fn


DP = (none, none)
HYBRID = (lambda: wh.replicate(8), lambda: wh.split(2))      # collocated: data 4 x model 2
HYBRID8 = (lambda: wh.replicate(8), lambda: wh.split(8))     # collocated: data 1 x model 8
SCOPES = {"dp": DP, "hybrid": HYBRID, "hybrid8": HYBRID8}


def config(scopes, m, **kw):
    if scopes is not DP:
        kw["share_devices"] = True
    return wh.Config(num_micro_batch=m, **kw)


# -- reading the compiled program ---------------------------------------------------------------------
def gradient_collectives(text: str, param_shapes) -> tuple[int, float, int]:
    """(count, bytes, how many of them sit in a loop) of the parameter-shaped collective results per
    step, a leading per-shard dimension of 1 dropped and dimensions sorted (XLA may transpose)."""
    dims = {tuple(sorted(s)) for s in param_shapes}
    count, nbytes, looped = 0, 0.0, 0
    for c, trips in hlo.looped_collectives(text):
        for dt, shape in c.arrays:
            s = shape
            while len(s) > 1 and s[0] == 1:          # per-shard accumulators: [1, ...] on each device
                s = s[1:]
            if tuple(sorted(s)) in dims and len(s):
                count += trips
                nbytes += trips * hlo.nbytes([(dt, shape)])
                looped += trips > 1
    return count, nbytes, looped


@functools.cache
def compiled(scopes_name, m, zero=0):
    scopes = SCOPES[scopes_name]
    plan = wh.plan(make_loss(*scopes), params0(), batch0(), optax.sgd(0.1), config=config(scopes, m, zero_level=zero))
    return plan, plan.lowered().compile().as_text()


SHAPES = [tuple(x.shape) for x in jax.tree.leaves(params0())]


def test_hlo_reader_counts_loop_trips():
    """The reader multiplies a while body's collectives by its trip count (so the tests below could fail):
    the hybrid's activation collectives run once per micro-batch."""
    per_step = [sum(trips for c, trips in hlo.looped_collectives(compiled("hybrid", m)[1]) if trips > 1)
                for m in (4, 16)]
    assert per_step[0] > 0 and per_step[1] == 4 * per_step[0]


@pytest.mark.parametrize("zero", [0, 1])
def test_data_parallel_reduces_once(zero):
    found = {m: gradient_collectives(compiled("dp", m, zero)[1], SHAPES) for m in (1, 4, 16)}
    # each gradient once (ZeRO 1 also gathers the updated leaves it shards, once)
    assert found[1][0] == len(SHAPES) if not zero else found[1][0] > len(SHAPES), found
    assert found[4] == found[1] and found[16] == found[1], found
    assert found[16][2] == 0


def test_data_parallel_zero2_reduces_once():
    found = {m: gradient_collectives(compiled("dp", m, 2)[1], SHAPES) for m in (1, 4, 16)}
    assert found[1][0] >= len(SHAPES)
    assert found[4] == found[1] and found[16] == found[1], found


@pytest.mark.parametrize("hybrid", ["hybrid", "hybrid8"])
def test_collocated_hybrid_reduces_once(hybrid):
    """replicate(8) beside split(2) (data 4 x model 2) or split(8) (data 1 x model 8): the backbone's
    gradients stay per data and per model shard in the loop, the split head's need no sum."""
    found = {m: gradient_collectives(compiled(hybrid, m)[1], SHAPES) for m in (1, 4, 16)}
    assert found[1][0] >= len(SHAPES) - 1, found
    assert found[4] == found[1] and found[16] == found[1], found
    assert found[16][2] == 0
    assert "summed over them once a step" in compiled(hybrid, 4)[0].summary()


@pytest.mark.parametrize("memory", [{"remat": "full"}, {"remat": "dots_saveable"},
                                    {"remat": "full", "offload": "activations"}])
def test_remat_hybrid_reduces_once(memory):
    """remat's segments (checkpointed per TaskGraph) and offloaded activations run per model shard too."""
    s = HYBRID
    step, _ = assert_matches(make_loss(*s), params0(), batch0(), steps=3, optimizer=optax.sgd(0.5), tol=1e-5,
                             param_tol=1e-4, config=config(s, 4, **memory))
    found = [gradient_collectives(wh.plan(make_loss(*s), params0(), batch0(), optax.sgd(0.1),
                                          config=config(s, m, **memory)).lowered().compile().as_text(), SHAPES)
             for m in (1, 4)]
    assert found[1] == found[0], found
    assert "summed over them once a step" in step.plan.summary()


def dropout_loss(scopes):
    """make_loss with dropout on the backbone's first layer (a per-sample random draw)."""
    def loss_fn(p, b, rng):
        with scopes[0]():
            h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
            h = jnp.where(jax.random.bernoulli(rng, 0.8, h.shape), h / 0.8, 0.0)
            h = jnp.tanh(h @ p["w2"])
        with scopes[1]():
            ce = optax.softmax_cross_entropy_with_integer_labels(h @ p["out"], b["y"])
            return (ce * b["mask"]).sum() / jnp.maximum(b["mask"].sum(), 1.0)
    return loss_fn


@pytest.mark.parametrize("scopes", ["dp", "hybrid", "hybrid8"])
def test_dropout_reduces_once(scopes):
    """A random draw per sample (dropout) in parts: each data (and model) shard draws its own rows of the
    whole-batch mask, equal to one device's (a wrong row would fail here), and the gradients are still
    summed once a step."""
    loss_fn, s = dropout_loss(SCOPES[scopes]), SCOPES[scopes]
    found = []
    for m in (1, 4):
        step = wh.parallelize(loss_fn, optax.sgd(0.1), config=config(s, m))
        state = step.init(params0(), batch0(), rng=jax.random.key(1))
        found.append(gradient_collectives(step.plan.lowered().compile().as_text(), SHAPES))
    assert found[1] == found[0], found
    assert "once a step" in step.plan.summary() and "once per micro-batch" not in step.plan.summary()
    state, _ = step(state, batch0())
    key = jax.random.split(jax.random.key(1))[1]                  # the key of the first step
    grads = jax.jit(jax.grad(lambda p: loss_fn(p, batch0(), key)))(params0())
    want = jax.tree.map(lambda p, g: p - 0.1 * g, params0(), grads)
    errs = jax.tree.map(rel_err, step.params(state), want)
    assert max(jax.tree.leaves(errs)) < 1e-5, errs


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("scopes", ["dp", "hybrid", "hybrid8"])
def test_micro_batches_train_like_one_device(scopes, opt):
    s = SCOPES[scopes]
    optimizer = optax.sgd(0.5) if opt == "sgd" else adam(1e-2)
    step, _ = assert_matches(make_loss(*s), params0(), batch0(), steps=3, optimizer=optimizer, tol=1e-5,
                             param_tol=1e-4, config=config(s, 4))
    assert "summed over 'data' once a step" in step.plan.summary()


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("scopes", ["dp", "hybrid"])
def test_zero_micro_batches_train_like_one_device(scopes, zero):
    """ZeRO 2/3 (gradients reduce-scattered to their owners; ZeRO 3 gathers parameters where used) over the
    per-shard accumulators."""
    s = SCOPES[scopes]
    assert_matches(make_loss(*s), params0(), batch0(), steps=3, optimizer=adam(1e-2), tol=1e-5, param_tol=1e-4,
                   config=config(s, 4, zero_level=zero))
    found = {m: gradient_collectives(compiled(scopes, m, zero)[1], SHAPES) for m in (1, 4)}
    assert found[4] == found[1], found


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_hybrid_micro_batches(amp):
    """amp (fp16: a dynamic loss scale multiplies each part's cotangent) over the per-shard accumulators:
    within amp's tolerance of fp32 single-device training and of the same plan without micro-batches."""
    from memory.test_mixed_precision import SGD, TOL, moved_err
    loss_fn = make_loss(*HYBRID)
    _, fp32 = reference_train(loss_fn, params0(), batch0(), SGD, 3)
    runs = {m: whalex_train(loss_fn, params0(), batch0(), SGD, 3, config=config(HYBRID, m, amp=amp)) for m in (1, 4)}
    got = {m: step.params(state) for m, (_, state, step) in runs.items()}
    assert moved_err(got[4], fp32, params0()) < TOL[amp]
    assert moved_err(got[4], got[1], params0()) < TOL[amp] / 2
    assert "summed over them once a step" in runs[4][2].plan.summary()


def test_per_micro_batch_batch_statistics_keep_per_micro_batch_sums_and_say_so():
    """BatchNorm statistics accepted per micro-batch (batch_coupling='per_part'): per data shard they would
    be other numbers, so the gradients are summed once per micro-batch, as before, and the summary says why."""
    from api.test_model_state import problem
    loss_fn, params, state, batch = problem()
    plan = wh.plan(loss_fn, params, batch, optax.sgd(0.1), model_state=state,
                   config=wh.Config(num_micro_batch=4, batch_coupling="per_part"))
    assert "once per micro-batch (4 times a step): the loss's batch statistics are per micro-batch" in plan.summary()


@pytest.mark.parametrize("split", [2, 8])
@pytest.mark.parametrize("kind", ["mean", "sum", "masked", "token", "aux"])
def test_loss_contract_on_collocated_hybrid(kind, split):
    """The loss contract's losses (tests/loss/test_loss_contract.py: an embedding, two layers, a head, padded rows)
    on replicate(8) x 3 beside split(n) with 4 micro-batches, against one device (SGD; Adam for 'aux')."""
    from loss.test_loss_contract import OPTIMIZERS, lm_batch, lm_loss, lm_params
    scopes = (lambda: wh.replicate(8),) * 3 + (lambda: wh.split(split),)
    for opt in ["sgd"] + (["adam"] if kind == "aux" else []):
        step, _ = assert_matches(lm_loss(kind, scopes), lm_params(), lm_batch(), steps=3, optimizer=OPTIMIZERS[opt](),
                                 tol=1e-5, param_tol=1e-4,
                                 config=wh.Config(num_micro_batch=4, share_devices=True))
        assert "summed over them once a step" in step.plan.summary()
