"""Model state (BatchNorm statistics) and randomness (dropout) under every plan.

Plans that see the whole batch keep global statistics (synchronised BatchNorm) and one device's
dropout masks. Plans that evaluate the loss in parts refuse a BatchNorm in training mode by name,
or, with `batch_coupling="per_part"`, compute its statistics per part; their dropout masks are the
rows of the whole-batch draw, so they equal one device's too (never a mask repeated across parts).
"""
import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import whalex as wh
from conftest import HETERO, adam, rel_err

B, D, H, C = 32, 6, 16, 5


class Body(nn.Module):
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(H, use_bias=False)(x)     # (a bias before BatchNorm has zero gradient)
        h = nn.BatchNorm(use_running_average=False, momentum=0.8)(h)
        h = nn.relu(h)
        return nn.Dropout(self.dropout, deterministic=self.dropout == 0.0)(h)


class Head(nn.Module):
    @nn.compact
    def __call__(self, h):
        return nn.Dense(C)(h)


def problem(dropout=0.0, head_scope=contextlib.nullcontext, body_scope=contextlib.nullcontext):
    body, head = Body(dropout), Head()
    kx, ky, k1, k2 = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (B, D))
    batch = {"x": x, "y": jax.random.randint(ky, (B,), 0, C)}
    vb = body.init({"params": k1, "dropout": k1}, x)
    vh = head.init(k2, jnp.zeros((1, H)))
    params = {"body": vb["params"], "head": vh["params"]}
    state = {"batch_stats": vb["batch_stats"]}

    def loss_fn(p, b, model_state, rng=None):
        rngs = {"dropout": rng} if rng is not None else {}
        with body_scope():
            h, upd = body.apply({"params": p["body"], **model_state}, b["x"], rngs=rngs, mutable=["batch_stats"])
        with head_scope():
            logits = head.apply({"params": p["head"]}, h)
            return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean(), upd

    return loss_fn, params, state, batch


def reference(loss_fn, params, state, batch, optimizer, steps, rng=None, parts=None):
    """One device. `parts`: row index arrays; BatchNorm statistics then per part (the loss is the
    sample-weighted sum of the parts' means, the new statistics the mean of the parts')."""
    opt_state = optimizer.init(params)

    def whole(p, ms, key):
        kw = {"rng": key} if key is not None else {}
        if parts is None:
            return loss_fn(p, batch, ms, **kw)
        loss, news = 0.0, []
        for rows in parts:
            sub = jax.tree.map(lambda a: a[rows], batch)  # noqa: B023  (called at once)
            l_k, s_k = loss_fn(p, sub, ms, **kw)
            loss = loss + l_k * len(rows) / B
            news.append(s_k)
        return loss, jax.tree.map(lambda *xs: sum(xs) / len(xs), *news)

    @jax.jit
    def step(p, o, ms, key):
        (loss, ms), g = jax.value_and_grad(whole, has_aux=True)(p, ms, key)
        u, o = optimizer.update(g, o, p)
        return optax.apply_updates(p, u), o, ms, loss

    losses = []
    for _ in range(steps):
        key = None
        if rng is not None:
            rng, key = jax.random.split(rng)
        params, opt_state, state, loss = step(params, opt_state, state, key)
        losses.append(float(loss))
    return losses, params, state


def train(loss_fn, params, state, batch, optimizer, steps, rng=None, **kw):
    step = wh.parallelize(loss_fn, optimizer, **kw)
    st = step.init(params, batch, model_state=state, rng=rng)
    losses = []
    for _ in range(steps):
        st, metrics = step(st, batch)
        losses.append(float(metrics["loss"]))
    return losses, step, st


def check(ref, got, step, st, tol=1e-4):
    ref_losses, ref_params, ref_state = ref
    losses = got
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    errs = jax.tree.map(rel_err, step.params(st), ref_params)
    assert max(jax.tree.leaves(errs)) < tol, errs
    serrs = jax.tree.map(rel_err, st.model_state, ref_state)
    assert max(jax.tree.leaves(serrs)) < tol, serrs


WHOLE = {
    "dp": ({}, None, {}),
    "hybrid": ({}, None, {"head_scope": lambda: wh.split(8), "body_scope": lambda: wh.replicate(8)}),
    "zero1": ({"zero_level": 1}, None, {}),
    "zero2": ({"zero_level": 2}, None, {}),
    "zero3": ({"zero_level": 3}, None, {}),
}


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("plan", list(WHOLE))
def test_batchnorm_exact_on_whole_batch_plans(plan, opt):
    cfg, kinds, scopes = WHOLE[plan]
    loss_fn, params, state, batch = problem(**scopes)
    optimizer = optax.sgd(0.3) if opt == "sgd" else adam(1e-2)
    ref = reference(loss_fn, params, state, batch, optimizer, 3)
    losses, step, st = train(loss_fn, params, state, batch, optimizer, 3, config=wh.Config(**cfg))
    check(ref, losses, step, st)
    assert any("over the whole batch in one program (exact)" in c for c in step.plan.couplings)
    moved = rel_err(st.model_state["batch_stats"]["BatchNorm_0"]["mean"],
                    state["batch_stats"]["BatchNorm_0"]["mean"])
    assert moved > 1e-3                       # the statistics were really updated by the step


PARTS = {
    "micro4": ({"num_micro_batch": 4}, None, {}, "micro-batches"),
    "hetero": ({}, HETERO, {}, "uneven per-device chunks"),
    "pipe2": ({"num_micro_batch": 2}, None, {"head_scope": lambda: wh.replicate(1),
                                              "body_scope": lambda: wh.replicate(1)}, "pipeline micro-batches"),
    "pipe2zb": ({"num_micro_batch": 2, "schedule": "zb-h1"}, None,
                {"head_scope": lambda: wh.replicate(1), "body_scope": lambda: wh.replicate(1)},
                "pipeline micro-batches"),
}


@pytest.mark.parametrize("plan", list(PARTS))
def test_batchnorm_refused_by_name_on_plans_in_parts(plan):
    cfg, kinds, scopes, context = PARTS[plan]
    loss_fn, params, state, batch = problem(**scopes)
    cluster = wh.Cluster(kinds=kinds) if kinds else None
    with pytest.raises(wh.PlanError) as err:
        wh.plan(loss_fn, params, batch, optax.sgd(0.1), config=wh.Config(**cfg), cluster=cluster,
                model_state=state)
    msg = str(err.value)
    assert "BatchNorm_0" in msg and "test_model_state.py" in msg          # the operation and its source line
    assert context in msg and "samples" in msg                            # where, and the part size
    assert "batch_coupling='per_part'" in msg                             # the way out


def _contiguous(p):
    return [np.arange(k, k + p) for k in range(0, B, p)]


def _strided(dp, m):                   # gradient accumulation's micro-batches (lowering/step.py)
    c = B // (dp * m)
    return [np.concatenate([np.arange(j * (B // dp) + k * c, j * (B // dp) + (k + 1) * c) for j in range(dp)])
            for k in range(m)]


@pytest.mark.parametrize("plan", list(PARTS))
def test_batchnorm_per_part_opt_in_equals_per_part_reference(plan):
    cfg, kinds, scopes, _ = PARTS[plan]
    loss_fn, params, state, batch = problem(**scopes)
    cluster = wh.Cluster(kinds=kinds) if kinds else None
    optimizer = optax.sgd(0.3)
    losses, step, st = train(loss_fn, params, state, batch, optimizer, 3, cluster=cluster,
                             config=wh.Config(batch_coupling="per_part", **cfg))
    if plan == "micro4":
        parts = _strided(8, 4)
    elif plan == "hetero":
        parts = [np.arange(a, a + n) for a, n in step.plan.program.part_ranges()]   # full and remainder chunks
        assert len(set(step.plan.batch_sizes)) > 1
    else:
        parts = _contiguous(B // (4 * 2))                                 # 4 replicas x 2 micro-batches
    ref = reference(loss_fn, params, state, batch, optimizer, 3, parts=parts)
    check(ref, losses, step, st)
    whole = reference(loss_fn, params, state, batch, optimizer, 3)
    assert abs(losses[-1] - whole[0][-1]) > 1e-4          # per-part statistics really differ from global ones
    assert any("statistic (per part, opt-in)" in c for c in step.plan.couplings)


DROPOUT_PLANS = {
    "dp": ({}, None, {}),
    "hybrid": ({}, None, {"head_scope": lambda: wh.split(8), "body_scope": lambda: wh.replicate(8)}),
    "zero2": ({"zero_level": 2}, None, {}),
}


def _dropout_problem(**scopes):
    """Dropout without BatchNorm statistics in the way (eval-mode BatchNorm)."""
    loss_fn, params, state, batch = problem(dropout=0.5, **scopes)
    return loss_fn, params, state, batch


@pytest.mark.parametrize("plan", list(DROPOUT_PLANS))
def test_dropout_whole_batch_plans_equal_one_device(plan):
    cfg, kinds, scopes = DROPOUT_PLANS[plan]
    loss_fn, params, state, batch = _dropout_problem(**scopes)
    rng = jax.random.key(42)
    ref = reference(loss_fn, params, state, batch, optax.sgd(0.3), 3, rng=rng)
    losses, step, st = train(loss_fn, params, state, batch, optax.sgd(0.3), 3, rng=rng, config=wh.Config(**cfg))
    check(ref, losses, step, st)
    assert not jnp.array_equal(jax.random.key_data(st.rng), jax.random.key_data(rng))     # the key advanced


def _mask_problem():
    """loss = mean over samples of (dropout(1) . w): its gradient is the dropout mask itself."""
    def loss_fn(p, b, rng):
        keep = jax.random.bernoulli(rng, 0.5, b["x"].shape)
        return jnp.mean(jnp.where(keep, b["x"], 0.0) @ p["w"])
    params = {"w": jnp.zeros((8,))}
    batch = {"x": jnp.ones((B, 8))}
    return loss_fn, params, batch


@pytest.mark.parametrize("plan", ["micro4", "hetero", "pipe", "pipe-zb"])
def test_dropout_masks_in_parts_are_the_whole_batch_masks(plan):
    """In plans that work in parts, each part draws its own rows of the whole-batch mask: masks
    never repeat across devices or micro-batches, and equal one device's with the same key."""
    loss_fn, params, batch = _mask_problem()
    rng = jax.random.key(3)
    if plan.startswith("pipe"):
        def staged(p, b, rng):
            with wh.replicate(1):
                keep = jax.random.bernoulli(rng, 0.5, b["x"].shape)
                h = jnp.where(keep, b["x"], 0.0)
            with wh.replicate(1):
                return jnp.mean(h @ p["w"])
        fn, kw = staged, dict(config=wh.Config(num_micro_batch=4, schedule="zb-h1" if plan == "pipe-zb" else "1f1b"))
    elif plan == "micro4":
        fn, kw = loss_fn, dict(config=wh.Config(num_micro_batch=4))
    else:
        fn, kw = loss_fn, dict(cluster=wh.Cluster(kinds=HETERO))
    step = wh.parallelize(fn, optax.sgd(1.0), **kw)
    st = step.init(params, batch, rng=rng)
    st, _ = step(st, batch)
    _, key = jax.random.split(rng)
    mask = jax.random.bernoulli(key, 0.5, (B, 8)).astype(jnp.float32)
    expected = -mask.sum(0) / B                               # w -= grad; grad = mean of masked ones
    np.testing.assert_allclose(step.params(st)["w"], expected, rtol=1e-6)
    rows = np.asarray(mask)
    assert len({r.tobytes() for r in rows}) > B // 2          # rows differ (no mask reused per part)
    assert any("equal to one device" in c for c in step.plan.couplings)


def test_batch_stats_in_params_is_an_error():
    loss_fn, params, state, batch = problem()
    bad = {**params, "batch_stats": state["batch_stats"]}
    with pytest.raises(wh.PlanError, match="pass it as|model_state"):
        wh.plan(lambda p, b: 0.0, bad, batch)


def test_model_state_structure_must_round_trip():
    loss_fn, params, state, batch = problem()

    def drops(p, b, model_state):
        loss, _ = loss_fn(p, b, model_state)
        return loss, {}
    with pytest.raises(wh.PlanError, match="structure differs"):
        wh.plan(drops, params, batch, model_state=state)
